"""Preference data (jaxcolossal.data.preference): rows, response-only masks, pair interleaving and
one-line errors naming the file and line."""
import json
from types import SimpleNamespace

import numpy as np
import pytest

from jaxcolossal.data import ByteTokenizer
from jaxcolossal.data.loader import PairLoader
from jaxcolossal.data.preference import load_preferences, pair_rows
from jaxcolossal.errors import DataError


def _write(tmp_path, lines, name="pairs.jsonl"):
    path = tmp_path / name
    path.write_text("\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines) + "\n")
    return SimpleNamespace(corpus=str(path), skip_long_examples=False), str(path)


def test_text_pairs_mask_only_the_response(tmp_path):
    cfg, _ = _write(tmp_path, [{"prompt": "Q: 2+2?", "chosen": " 4", "rejected": " five"}])
    d = load_preferences(cfg, ByteTokenizer(), seq_len=16)
    assert d.chosen.shape == (1, 17) and d.chosen_masks.shape == (1, 16)
    row, m = d.chosen[0], d.chosen_masks[0]
    assert bytes(row[:9].astype(np.uint8)) == b"Q: 2+2? 4"
    # targets are row[1:]: target j is token j + 1; the response " 4" is tokens 7, 8
    assert np.flatnonzero(m).tolist() == [6, 7]
    assert np.flatnonzero(d.rejected_masks[0]).tolist() == [6, 7, 8, 9, 10]


def test_chat_pairs_mask_only_the_final_assistant_turn(tmp_path):
    prompt = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
              {"role": "user", "content": "name?"}]
    cfg, _ = _write(tmp_path, [{"prompt": prompt, "chosen": [{"role": "assistant", "content": "Ann"}],
                                "rejected": [{"role": "assistant", "content": "no"}]}])
    d = load_preferences(cfg, ByteTokenizer(), seq_len=80)
    text = bytes(d.chosen[0].astype(np.uint8)).rstrip(b"\0").decode()
    assert text == "user: hi\nassistant: hello\nuser: name?\nassistant: Ann\n"
    trained = bytes(d.chosen[0][1:][d.chosen_masks[0] > 0].astype(np.uint8)).decode()
    assert trained == "Ann\n"  # the prompt's own assistant turn is not trained on


def test_pair_rows_interleave():
    c, r = np.arange(6).reshape(3, 2), -np.arange(6).reshape(3, 2)
    out = pair_rows(c, r)
    assert out[0::2].tolist() == c.tolist() and out[1::2].tolist() == r.tolist()


@pytest.mark.parametrize("line, words", [
    ({"prompt": "a", "chosen": "b"}, "no 'rejected'"),
    ({"prompt": "a", "rejected": "b"}, "no 'chosen'"),
    ({"prompt": "a", "chosen": 3, "rejected": "b"}, "all strings or all message lists"),
    ({"prompt": "a", "chosen": [{"role": "x", "content": "b"}], "rejected": [{"role": "assistant", "content": "c"}]},
     "chosen[0]"),
    ([1, 2], "expected an object"),
    ("{not json", "invalid JSON"),
])
def test_bad_lines_name_file_and_line(tmp_path, line, words):
    cfg, path = _write(tmp_path, [{"prompt": "p", "chosen": "c", "rejected": "r"}, "", line])
    with pytest.raises(DataError) as e:
        load_preferences(cfg, ByteTokenizer(), seq_len=16)
    msg = str(e.value)
    assert f"{path}:3:" in msg and words in msg and "\n" not in msg


def test_pairs_that_are_all_chosen_equals_rejected_are_refused(tmp_path):
    """DPO's loss is then log 2 with a zero gradient at every step: nothing would train."""
    cfg, path = _write(tmp_path, [{"prompt": "p", "chosen": "same", "rejected": "same"},
                                  {"prompt": "q", "chosen": "c" * 30, "rejected": "c" * 29 + "d"}])
    with pytest.raises(DataError) as e:  # the second pair differs only past seq_len
        load_preferences(cfg, ByteTokenizer(), seq_len=16)
    assert f"data.corpus={path!r}: in all 2 preference pairs the chosen response equals the rejected one" in str(e.value)
    assert "\n" not in str(e.value)
    assert len(load_preferences(cfg, ByteTokenizer(), seq_len=40)) == 2  # one pair that differs is enough


def test_response_cut_off_is_refused_or_skipped(tmp_path):
    cfg, path = _write(tmp_path, [{"prompt": "x" * 40, "chosen": "c", "rejected": "r"},
                                  {"prompt": "p", "chosen": "c", "rejected": "r"}])
    with pytest.raises(DataError, match=f"{path}:1: no chosen or rejected response token"):
        load_preferences(cfg, ByteTokenizer(), seq_len=16)
    cfg.skip_long_examples = True
    d = load_preferences(cfg, ByteTokenizer(), seq_len=16)
    assert len(d) == 1 and d.skipped == [f"{path}:1"]


def test_pair_loader_keeps_pairs_together_and_is_a_function_of_the_step(tmp_path):
    cfg, _ = _write(tmp_path, [{"prompt": f"p{i}", "chosen": f"c{i}", "rejected": f"r{i}"} for i in range(7)])
    d = load_preferences(cfg, ByteTokenizer(), seq_len=8)
    loader = PairLoader(d, batch_size=6, seed=3)
    b = loader.local_batch(5)
    assert b["inputs"].shape == (6, 8) and b["loss_mask"].shape == (6, 8)
    for i in range(0, 6, 2):
        c, r = bytes(b["inputs"][i].astype(np.uint8)), bytes(b["inputs"][i + 1].astype(np.uint8))
        assert c[:2] == r[:2] and c[2:3] == b"c" and r[2:3] == b"r"  # one pair: same prompt, chosen then rejected
    assert all((b[k] == loader.local_batch(5)[k]).all() for k in b)
    with pytest.raises(ValueError, match="even number of rows"):
        PairLoader(d, batch_size=5, seed=3)


def test_num_tokens_counts_every_row_before_its_padding_and_resumes(tmp_path):
    """TRL's ``num_tokens``: the running sum of the whole batches' unpadded tokens (prompt + response + eos),
    the same from a loader asked at a later step first (a resume) as counted step by step."""
    lines = [{"prompt": "Q" * (i % 3 + 1), "chosen": "c" * (i % 4 + 1), "rejected": "r" * (i % 5 + 1)}
             for i in range(9)]
    cfg, _ = _write(tmp_path, lines)
    d = load_preferences(cfg, ByteTokenizer(), seq_len=7)  # "QQQ" + "rrrrr" is cut to 8 tokens
    text = [(len(x["prompt"]) + len(x["chosen"]), len(x["prompt"]) + len(x["rejected"])) for x in lines]
    assert d.chosen_lengths.tolist() == [min(c, 8) for c, _ in text]
    assert d.rejected_lengths.tolist() == [min(r, 8) for _, r in text]
    # read off the masks when no lengths were recorded: the response ends the row
    bare = type(d)(d.chosen, d.rejected, d.chosen_masks, d.rejected_masks)
    assert (bare.row_lengths(np.arange(9)) == d.row_lengths(np.arange(9))).all()
    loader = PairLoader(d, batch_size=4, seed=1)
    by_step = [sum(int(d.row_lengths(np.arange(9))[i]) for i in loader.row_index(s)) for s in range(6)]
    counted = [loader.step_metrics(s)["num_tokens"] for s in range(6)]
    assert counted == np.cumsum(by_step).tolist() and counted[0] > 0
    assert PairLoader(d, batch_size=4, seed=1).num_tokens(4) == counted[4]  # resumed: counts from step 0
    assert loader.num_tokens(2) == counted[2]  # an earlier step after a later one
