"""One bad input of each kind a user can cause (jaxcolossal.errors), through the command line:
each ends in one line on stderr, starting with its kind, and its documented exit status; no
traceback."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
SMALL = ["model.num_layers=2", "model.hidden_size=64", "model.intermediate_size=128", "training.seq_len=32",
         "training.batch_size=16", "training.max_steps=2", "logging.progress_bar=false"]


def _cli(tmp_path, *overrides):
    return subprocess.run([sys.executable, "scripts/train.py", *SMALL, f"logging.run_dir={tmp_path}/run", *overrides],
                          cwd=ROOT, capture_output=True, text=True, timeout=240)


def _one_line(r, code: int, kind: str, message: str) -> None:
    assert r.returncode == code, r.stderr[-3000:]
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    lines = [x for x in r.stderr.splitlines() if x.startswith(f"{kind}: ")]
    assert len(lines) == 1 and message in lines[0], r.stderr[-3000:]


def _chat_file(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return path


def test_config(tmp_path):
    _one_line(_cli(tmp_path, "parallel.zero_stag=2"), 2, "config error", "did you mean 'parallel.zero_stage'?")


def test_data_file_malformed_json_line(tmp_path):
    good = json.dumps({"prompt": "hi", "response": "there"})
    f = _chat_file(tmp_path / "chat.jsonl", [good, "{not json", good])
    _one_line(_cli(tmp_path, "data.format=chat", f"data.corpus={f}"), 3, "data error",
              "chat.jsonl:2: invalid JSON line")


def test_data_file_parquet_without_the_text_column(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq  # optional: pyarrow (the data extra), skipped above without it
    f = tmp_path / "docs.parquet"
    pq.write_table(pa.table({"body": ["some text " * 50] * 40}), f)
    _one_line(_cli(tmp_path, "data.format=parquet", f"data.corpus={f}"), 3, "data error",
              "parquet file has no column 'text' (data.text_key); its columns: ['body']")


def test_tokenizer_file_that_does_not_load(tmp_path):
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.json").write_text("{ this is not a tokenizer")
    _one_line(_cli(tmp_path, f"data.tokenizer={tmp_path / 'tok'}"), 3, "tokenizer error",
              "is not a readable tokenizers file")


def test_checkpoint_that_does_not_restore(tmp_path):
    (tmp_path / "ckpt" / "5").mkdir(parents=True)  # a step folder with nothing in it
    _one_line(_cli(tmp_path, f"checkpoint.dir={tmp_path / 'ckpt'}", "training.resume=true"), 3, "checkpoint error",
              "no restorable checkpoint")


def test_resume_with_another_model_size_is_a_config_error(tmp_path):
    ckpt = f"checkpoint.dir={tmp_path / 'ckpt'}"
    first = _cli(tmp_path, ckpt, "checkpoint.save_every=2", "training.sample_tokens=0", "training.eval_every=0")
    assert first.returncode == 0, first.stderr[-3000:]
    _one_line(_cli(tmp_path, ckpt, "training.resume=true", "training.max_steps=4", "model.intermediate_size=96"),
              2, "config error", "model.intermediate_size: saved 128, now 96")


@pytest.mark.parametrize("key, under, why", [
    ("checkpoint.dir", "a.jsonl/ck", "a.jsonl is a file"),
    ("logging.run_dir", "a.jsonl/run", "a.jsonl is a file"),
    ("checkpoint.dir", "/proc/nope", "nothing can be created in /proc"),
])
def test_output_folder_that_cannot_be_created_is_a_config_error(tmp_path, key, under, why):
    # issue 45 item 7: a traceback (exit 1), or for /proc a data error naming no key after compiling
    (tmp_path / "a.jsonl").write_text("{}\n")
    path = under if os.path.isabs(under) else str(tmp_path / under)
    if os.path.isabs(under) and not os.path.isdir(os.path.dirname(under)):
        pytest.skip(f"{os.path.dirname(under)} does not exist here")
    _one_line(_cli(tmp_path, f"{key}={path}"), 2, "config error",
              f"{key}={path!r}: cannot create it: " + (f"{tmp_path}/{why}" if not os.path.isabs(under) else why))
