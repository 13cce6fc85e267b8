"""GRPO's reward functions as TRL 1.16's ``GRPOTrainer._calculate_rewards`` calls them (issue 54): every
field of a prompt row reaches them as a keyword, chat completions are message lists, signatures are
checked when the config loads and against the rows' fields when the data is read, a failure during the
run is one line naming the function and the step with its own traceback below, and what would train
nothing (no reward in a step, exact_match without answers, mask_truncated_completions without an
end-of-text id) is refused or stopped. Rollouts are built without a model (no plan, nothing compiled):
``_score`` is fed token ids as the sampler would return them."""
import json
import os
import re
import sys

import numpy as np
import pytest

from jaxcolossal.config import ConfigError, config_from_dict
from jaxcolossal.config.reward_funcs import import_reward
from jaxcolossal.data import get_tokenizer
from jaxcolossal.data.prompts import load_prompts
from jaxcolossal.errors import DataError, RewardError, exit_status
from jaxcolossal.posttrain.rewards import TrainerState, make_rewards
from jaxcolossal.posttrain.rollout import Rollouts, group_advantages

CALLS = []


def trl_reward_func(completions, ground_truth, **kwargs):
    """TRL's documented reward function over a dataset column (``ground_truth``), unchanged."""
    matches = [re.search(r"\\boxed\{(.*?)\}", completion) for completion in completions]
    contents = [match.group(1) if match else "" for match in matches]
    return [1.0 if c == gt else 0.0 for c, gt in zip(contents, ground_truth)]


def trl_format_reward_func(completions, **kwargs):
    """TRL's documented conversational reward function, unchanged: completions are message lists."""
    pattern = r"^<think>.*?</think><answer>.*?</answer>$"
    completion_contents = [completion[0]["content"] for completion in completions]
    matches = [re.match(pattern, content) for content in completion_contents]
    return [1.0 if match else 0.0 for match in matches]


def recorder(**kwargs):
    """Records what it is called with; logs a metric and an extra column as TRL lets a function do."""
    CALLS.append(kwargs)
    kwargs["log_metric"]("my_metric", 2.0)
    kwargs["log_extra"]("why", ["x"] * len(kwargs["completions"]))
    return [0.5] * len(kwargs["completions"])


def no_kwargs(prompts, completions):
    return [0.0] * len(completions)


def positional_only(completions, /, **kwargs):
    return [0.0] * len(completions)


def all_keywords_only(prompts, completions, completion_ids, trainer_state, log_extra, log_metric):
    return [0.0] * len(completions)


def raising(completions, **kwargs):
    return [1.0 / 0 for _ in completions]


def too_few(completions, **kwargs):
    return [1.0]


def strings(completions, **kwargs):
    return ["1.0"] * len(completions)


def nones(completions, **kwargs):
    return [None] * len(completions)


def grpo_cfg(corpus, **posttrain):
    return config_from_dict({"model": {"vocab_size": 256, "num_layers": 1, "hidden_size": 32,
                                       "num_attention_heads": 2, "num_key_value_heads": 2, "intermediate_size": 64,
                                       "max_position_embeddings": 64},
                             "training": {"objective": "grpo", "batch_size": 4, "seq_len": 24, "max_steps": 10},
                             "data": {"format": "prompts", "corpus": str(corpus), "tokenizer": "byte"},
                             "posttrain": {"num_generations": 2, "max_completion_length": 8, **posttrain},
                             "parallel": {"data_parallel_size": 1}})


def rollouts(tmp_path, rows, **posttrain):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = grpo_cfg(path, **posttrain)
    tok = get_tokenizer("byte")
    return Rollouts(cfg, None, load_prompts(cfg.data, tok, 17), tok, None)


def score(ro, texts, where="step 1"):
    """``_score`` of one completion per prompt row, from byte ids as the sampler returns them."""
    width = max(len(t) for t in texts)
    comps = np.array([list(t.encode()) + [0] * (width - len(t)) for t in texts], np.int32)
    return ro._score(ro.data, np.arange(len(texts)), comps, np.array([len(t) for t in texts]), where,
                     TrainerState(0, 10))


TEXT_ROWS = [{"prompt": "1+1=", "ground_truth": "2", "answer": "2", "level": 1},
             {"prompt": "2+2=", "ground_truth": "4", "answer": "4"}]
CHAT_ROWS = [{"prompt": [{"role": "user", "content": "think"}], "answer": "x"},
             {"prompt": [{"role": "user", "content": "then answer"}], "answer": "y"}]


def test_every_field_of_a_row_and_the_step_reach_the_function_as_trl_passes_them(tmp_path):
    CALLS.clear()
    ro = rollouts(tmp_path, TEXT_ROWS, reward_funcs=f"{__name__}:recorder")
    per_func, _ = score(ro, ["2", "5"])
    kw = CALLS[-1]
    assert set(kw) == {"prompts", "completions", "completion_ids", "ground_truth", "answer", "level", "trainer_state",
                       "log_extra", "log_metric"}
    assert kw["prompts"] == ["1+1=", "2+2="] and kw["completions"] == ["2", "5"]
    assert kw["completion_ids"] == [[50], [53]]
    assert kw["ground_truth"] == ["2", "4"] and kw["level"] == [1, None]  # a row without a field: None, as datasets
    assert kw["trainer_state"].global_step == 0 and kw["trainer_state"].max_steps == 10
    assert ro.rewards.metrics == {"my_metric": 2.0} and ro.rewards.extra == {"why": ["x", "x"]}
    np.testing.assert_array_equal(per_func, [[0.5], [0.5]])


def test_a_trl_reward_over_a_column_and_a_conversational_one_run_unchanged(tmp_path):
    ro = rollouts(tmp_path, TEXT_ROWS, reward_funcs=f"{__name__}:trl_reward_func,exact_match")
    per_func, _ = score(ro, [r"\boxed{2}", r"\boxed{3}"])
    np.testing.assert_array_equal(per_func, [[1, 1], [0, 0]])
    CALLS.clear()
    chat = rollouts(tmp_path, CHAT_ROWS, reward_funcs=f"{__name__}:trl_format_reward_func,{__name__}:recorder,"
                                                      "exact_match,format", format_pattern="answer")
    per_func, _ = score(chat, ["<think>a</think><answer>x</answer>", "y"])
    np.testing.assert_array_equal(per_func, [[1, 0.5, 0, 1], [0, 0.5, 1, 0]])  # built-ins read the message content
    assert CALLS[-1]["prompts"] == [r["prompt"] for r in CHAT_ROWS]  # the messages, as given
    assert CALLS[-1]["completions"][1] == [{"role": "assistant", "content": "y"}]


@pytest.mark.parametrize("func, words", [
    ("no_kwargs", "no_kwargs(prompts, completions) does not take the keywords completion_ids, trainer_state, "
                  "log_extra, log_metric that every reward function is called with (TRL's contract): add **kwargs"),
    ("positional_only", "takes completions by position only"),
])
def test_a_signature_that_cannot_be_called_is_refused_when_the_config_loads(tmp_path, func, words):
    with pytest.raises(ConfigError) as e:
        grpo_cfg(tmp_path / "p.jsonl", reward_funcs=f"{__name__}:{func}")
    assert words in str(e.value) and f"{__name__}:{func}" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("func, words", [
    ("trl_reward_func", "trl_reward_func(completions, ground_truth, **kwargs) needs 'ground_truth', which no "
                        "prompt row of data.corpus has (the rows' other fields: answer)"),
    ("all_keywords_only", "does not take the keyword 'answer', a field of the prompt rows"),
])
def test_a_function_the_rows_fields_do_not_fit_is_refused_when_the_data_is_read(tmp_path, func, words):
    with pytest.raises(ConfigError) as e:
        rollouts(tmp_path, [{"prompt": "1+1=", "answer": "2"}], reward_funcs=f"{__name__}:{func}")
    assert words in str(e.value) and f"{__name__}:{func}" in str(e.value) and "\n" not in str(e.value)


def test_a_field_named_like_a_reward_keyword_is_refused(tmp_path):
    with pytest.raises(DataError, match="the field 'completions' has the name of a keyword"):
        rollouts(tmp_path, [{"prompt": "1+1=", "answer": "2", "completions": []}])


@pytest.mark.parametrize("func, words", [
    ("raising", "reward function {m}:raising raised at step 3: ZeroDivisionError: float division by zero"),
    ("too_few", "reward function {m}:too_few returned 1 values for 2 completions at step 3"),
    ("strings", "reward function {m}:strings returned a str ('1.0') for completion 0 at step 3"),
])
def test_a_failure_during_the_run_names_the_function_and_the_step(tmp_path, func, words):
    ro = rollouts(tmp_path, TEXT_ROWS, reward_funcs=f"{__name__}:{func}")
    with pytest.raises(RewardError) as e:
        score(ro, ["2", "5"], where="step 3")
    assert str(e.value).startswith(words.format(m=__name__)) and "\n" not in str(e.value)
    text, code = exit_status(e.value)
    assert code == 2 and text.splitlines()[0] == f"reward error: {e.value}"
    if func == "raising":  # the user's own traceback below the line, without our frames
        assert "in raising" in text and "1.0 / 0" in text and "ZeroDivisionError" in text.splitlines()[-1]
        assert "jaxcolossal/posttrain" not in text  # none of our frames


def test_a_step_without_any_reward_stops_and_a_partial_one_warns_once(tmp_path):
    ro = rollouts(tmp_path, TEXT_ROWS, reward_funcs=f"{__name__}:nones")
    per_func, _ = score(ro, ["2", "5"])
    with pytest.raises(RewardError, match=rf"every reward function \({__name__}:nones\) returned None or NaN for all "
                                          "2 completions of step 4: a step without a reward trains nothing"):
        ro._check_scored(per_func, 3)
    ro._check_scored(np.array([[np.nan], [1.0]], np.float32), 3)  # some scored: trains, warns (once)
    assert ro._warned_unscored


def test_frac_reward_zero_std_counts_groups_without_a_reward():
    """A group with no reward (or one scored completion) has no signal: it is not a 0 of the fraction."""
    _, no_signal = group_advantages(np.full(4, np.nan, np.float32), 2, "group")
    assert no_signal.all()
    _, no_signal = group_advantages(np.array([np.nan, 1, 0, 1], np.float32), 2, "group")
    np.testing.assert_array_equal(no_signal, [True, True, False, False])


def test_exact_match_without_answers_is_refused(tmp_path):
    with pytest.raises(ConfigError) as e:
        rollouts(tmp_path, [{"prompt": "1+1="}, {"prompt": "2+2=", "solution": "4"}])
    assert "exact_match compares a completion with its row's 'answer', and no prompt row of data.corpus" in str(e.value)
    rollouts(tmp_path, [{"prompt": "1+1="}], reward_funcs="format")  # another function: fine


def test_mask_truncated_completions_without_an_end_of_text_id_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="posttrain.mask_truncated_completions=true needs an end-of-text id, and "
                                          "data.tokenizer=byte has none"):
        rollouts(tmp_path, TEXT_ROWS, mask_truncated_completions=True)


def test_a_reward_module_in_the_current_folder_imports_without_pythonpath(tmp_path, monkeypatch):
    """``python scripts/train.py`` puts scripts/ on sys.path, not the folder it was started in."""
    (tmp_path / "my_rewards_54.py").write_text("def concise(completions, **kw):\n    return [0.0] * len(completions)\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", os.getcwd(), str(tmp_path))])
    monkeypatch.delitem(sys.modules, "my_rewards_54", raising=False)
    assert import_reward("my_rewards_54:concise")(completions=["a"]) == [0.0]
    with pytest.raises(ConfigError, match=r"cannot import 'nope_54' for 'nope_54:f' \(searched sys.path and the "
                                          "current folder"):
        import_reward("nope_54:f")


@pytest.mark.parametrize("funcs, words", [
    ("exact_match,format,exact_match", "lists exact_match twice"),
    (f"{__name__}:nones,{__name__}:nones", f"lists {__name__}:nones twice"),
])
def test_the_same_function_twice_is_refused(tmp_path, funcs, words):
    with pytest.raises(ConfigError, match=re.escape(words)):
        grpo_cfg(tmp_path / "p.jsonl", reward_funcs=funcs)
    assert make_rewards("exact_match,format", "", "x").names == ["exact_match", "format"]
