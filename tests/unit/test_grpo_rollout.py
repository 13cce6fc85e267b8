"""GRPO's host-side pieces: the built-in rewards, a user's reward function, the weighted sum, the group
advantages (TRL 1.16's sum_then_normalize, Bessel-corrected std + 1e-4), the row layout, and the end
of a completion at any id of an eos list."""
import numpy as np
import pytest

from jaxcolossal.config import ConfigError
from jaxcolossal.posttrain.rewards import exact_match, final_answer, make_rewards
from jaxcolossal.generate import run_eos_ids
from jaxcolossal.posttrain.rollout import completion_ids, group_advantages, row_layout, truncated_rows


def length_reward(prompts, completions, **kwargs):
    """A user's reward function (imported by name in the test below): 0.1 per character."""
    return [0.1 * len(c) for c in completions]


@pytest.mark.parametrize("completion, answer", [("19\n3+4=7", "19"), ("so #### 1,234", "1234"), (r"\boxed{12.0}", 12),
                                                (" 7 ", "7")])
def test_exact_match_reads_the_final_answer(completion, answer):
    assert exact_match(["p"], [completion], answer=[answer]) == [1.0]
    assert exact_match(["p"], [completion], answer=["8"]) == [0.0]
    assert exact_match(["p"], [completion], answer=[None]) == [None]  # no answer: not scored
    assert final_answer("a\nb") == "a"


def test_weighted_sum_and_a_users_function():
    rs = make_rewards(f"exact_match,format,{__name__}:length_reward", "1,0.5,2", r"####")
    per = rs.score(["1+1="] * 3, ["2", "#### 2", "3"], [[50], [35, 35], [51]], {"answer": ["2", "2", None]}, "step 1")
    np.testing.assert_allclose(per, [[1, 0, 0.1], [1, 1, 0.6], [np.nan, 0, 0.1]], rtol=1e-6)
    np.testing.assert_allclose(rs.total(per), [1.2, 2.7, 0.2], rtol=1e-6)  # NaN skipped, as TRL's nansum
    with pytest.raises(ConfigError, match="has no function 'nope'"):
        make_rewards(f"{__name__}:nope", "", "")


def test_group_advantages_as_trl():
    r = np.array([1, 0, 0, 0, 1, 1, 1, 1, 0.5, np.nan, 0, 1], np.float32)
    adv, zero = group_advantages(r, 4, "group")
    g0 = np.array([1, 0, 0, 0.0])
    np.testing.assert_allclose(adv[:4], (g0 - g0.mean()) / (g0.std(ddof=1) + 1e-4), rtol=1e-5)
    np.testing.assert_array_equal(adv[4:8], 0)  # equal rewards: no signal
    g2 = np.array([0.5, 0, 1])
    np.testing.assert_allclose(adv[[8, 10, 11]], (g2 - g2.mean()) / (g2.std(ddof=1) + 1e-4), rtol=1e-5)
    assert adv[9] == 0  # unscorable: advantage 0
    np.testing.assert_array_equal(zero, [False] * 4 + [True] * 4 + [False] * 4)
    plain, _ = group_advantages(r, 4, "none")  # Dr. GRPO: not scaled
    np.testing.assert_allclose(plain[:4], g0 - g0.mean(), rtol=1e-6)
    batch, _ = group_advantages(r, 4, "batch")
    np.testing.assert_allclose(batch[:4], (g0 - g0.mean()) / (np.nanstd(r, ddof=1) + 1e-4), rtol=1e-5)


def test_row_layout():
    prompts = np.array([[0, 0, 5, 6], [7, 8, 9, 10]], np.int32)
    pmask = prompts > 0
    comps = np.array([[1, 2, 0], [3, 4, 5]], np.int32)
    rows = row_layout(prompts, pmask, comps, np.array([2, 3]), truncated_out=np.array([False, True]))
    np.testing.assert_array_equal(rows["inputs"][0], [0, 0, 5, 6, 1, 2])
    np.testing.assert_array_equal(rows["targets"][0], [0, 5, 6, 1, 2, 0])
    np.testing.assert_array_equal(rows["loss_mask"], [[0, 0, 0, 1, 1, 0], [0] * 6])  # row 1 truncated: out
    np.testing.assert_array_equal(rows["segment_ids"][0], [0, 0, 1, 1, 1, 1])
    np.testing.assert_array_equal(rows["positions"][0], [0, 0, 0, 1, 2, 3])  # from the first real token
    np.testing.assert_array_equal(rows["positions"][1], [0, 1, 2, 3, 4, 5])


def test_every_eos_id_of_a_list_ends_a_completion():
    """LLaMA 3's ``[end_of_text, eom, eot]``: a row that ends at any of them is not truncated, and no
    eos id reaches the reward text; a row that ran to the end without one is truncated."""
    eos = (7, 8, 9)
    completions = np.array([[3, 4, 8, 0], [3, 9, 0, 0], [3, 4, 5, 6], [7, 0, 0, 0], [5, 300, 6, 2]])
    lengths = np.array([3, 2, 4, 1, 4])
    np.testing.assert_array_equal(truncated_rows(completions, lengths, eos), [False, False, True, False, True])
    assert completion_ids(completions, lengths, eos, 256) == [[3, 4], [3], [3, 4, 5, 6], [], [5, 6, 2]]
    np.testing.assert_array_equal(truncated_rows(completions, lengths, ()), [True] * 5)  # no eos: nothing ends


def test_run_eos_ids_join_the_tokenizer_and_init_from_folder(tmp_path):
    """The tokenizer's eos first, then ``model.init_from``'s ``generation_config.json`` list (else its
    ``config.json`` id), each id once."""
    class Tok:
        eos_id = 9

    (tmp_path / "config.json").write_text('{"eos_token_id": 5}')
    assert run_eos_ids(Tok(), str(tmp_path)) == (9, 5)
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": [7, 8, 9]}')
    assert run_eos_ids(Tok(), str(tmp_path)) == (9, 7, 8)
    assert run_eos_ids(Tok(), None) == (9,) and run_eos_ids(object(), str(tmp_path)) == (7, 8, 9)
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": ["<eot>"]}')
    with pytest.raises(ValueError, match="eos_id must be"):
        run_eos_ids(Tok(), str(tmp_path))
