"""The main job end to end on a small slice of the default corpus: metrics, checkpoints, resume."""

import datetime
import fcntl
import json
import os
import pty
import re
import struct
import subprocess
import sys
import termios

import jax
import numpy as np
import pytest

from jaxcolossal.config import load_config
from jaxcolossal.train.loop import train

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMALL = ["model.num_layers=2", "model.hidden_size=64", "model.intermediate_size=128", "training.seq_len=32",
         "training.batch_size=16", "training.eval_batches=2", "training.sample_tokens=8",
         "data.max_corpus_bytes=400000", "logging.progress_bar=false", "logging.log_every=1",
         "training.eval_every=0"]


def _cfg(tmp_path, *extra):
    return load_config(os.path.join(ROOT, "configs/llama_tiny.yaml"),
                       SMALL + [f"logging.run_dir={tmp_path}/run", f"checkpoint.dir={tmp_path}/ckpt", *extra])


def _records(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_main_job_writes_metrics_and_sample(tmp_path, capsys):
    out = train(_cfg(tmp_path, "training.max_steps=12", "logging.tensorboard=true"))
    recs = _records(tmp_path / "run" / "metrics.jsonl")
    steps = [r for r in recs if "loss" in r]
    vals = [r for r in recs if "val_loss" in r]
    assert [r["step"] for r in steps] == list(range(1, 13))
    assert {"loss", "grad_norm", "lr", "tokens_per_s", "samples_per_s", "tflops_6n", "tflops_colossal"} <= set(steps[0])
    assert len(vals) == 2 and vals[-1]["val_loss"] < vals[0]["val_loss"]
    assert abs(vals[0]["val_loss"] - np.log(256)) < 0.3  # starts near uniform over bytes
    assert out["sample"].startswith("def ") and len(out["sample"]) > 4
    printed = capsys.readouterr().out
    assert "['layers']['wq']" in printed and "per-device model state" in printed and "----- sample -----" in printed

    # TensorBoard: the same scalars, read back by tensorboard's own reader
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # optional: tensorboard
    (tb_run,) = (tmp_path / "run" / "tensorboard").iterdir()  # one folder per run, named by its id
    assert tb_run.name == recs[0]["run"]
    acc = EventAccumulator(str(tb_run))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    want = {"train/loss", "train/grad_norm", "train/lr", "train/tokens_per_s", "train/tflops_6n",
            "train/peak_memory_bytes", "eval/val_loss"}
    assert want <= tags, want - tags
    assert [e.step for e in acc.Scalars("train/loss")] == list(range(1, 13))
    np.testing.assert_allclose([e.value for e in acc.Scalars("train/loss")], [r["loss"] for r in steps], rtol=1e-6)
    assert [e.value for e in acc.Scalars("eval/val_loss")] == pytest.approx([r["val_loss"] for r in vals], rel=1e-6)


def test_runs_sharing_a_run_dir_are_told_apart(tmp_path):
    """Issue 45 item 6: each run into a ``run_dir`` starts with a ``run_start`` record (a unique id,
    the UTC time, the step it resumed from, the config file), a ``train.log`` line naming the same
    id, and TensorBoard events in a folder of its own."""
    extra = ["training.sample_tokens=0", "logging.tensorboard=true"]
    train(_cfg(tmp_path, "training.max_steps=2", *extra))
    train(_cfg(tmp_path, "training.max_steps=4", "training.resume=true", *extra))
    recs = _records(tmp_path / "run" / "metrics.jsonl")
    starts = [i for i, r in enumerate(recs) if r.get("event") == "run_start"]
    assert len(starts) == 2 and starts[0] == 0, recs
    first, second = recs[starts[0]], recs[starts[1]]
    assert first["run"] != second["run"]
    assert (first["resumed_from_step"], second["resumed_from_step"]) == (None, 2)
    assert first["config"] == second["config"] == os.path.join(ROOT, "configs", "llama_tiny.yaml")
    for r in (first, second):
        assert datetime.datetime.fromisoformat(r["time"]).utcoffset() == datetime.timedelta(0)
    # each run's records follow its own start: the first run's steps 1-2, then the second's 3-4
    assert [r["step"] for r in recs[: starts[1]] if "loss" in r] == [1, 2]
    assert [r["step"] for r in recs[starts[1]:] if "loss" in r] == [3, 4]
    log = (tmp_path / "run" / "train.log").read_text()
    assert [m for m in re.findall(r"========== run (\S+) ", log)] == [first["run"], second["run"]]
    assert sorted(p.name for p in (tmp_path / "run" / "tensorboard").iterdir()) == sorted([first["run"], second["run"]])


def _chat_corpus(path):
    with open(path, "w") as f:
        for i in range(64):
            f.write(json.dumps({"prompt": f"double {i}", "response": f"{2 * i}"}) + "\n")
    return path


@pytest.mark.parametrize("fmt", ["text", "chat"])
def test_resume_is_bit_exact(tmp_path, fmt):
    """Both loaders resume bit for bit; ``text`` reads the token stream from the pre-tokenization
    cache that the first run wrote (the resumed run is a cache hit). (``packed`` is the text loader
    with segment ids and positions computed from the same ``(seed, step)``; its own resume case
    was dropped for the suite's time: tests/integration/test_packing.py trains it.)"""
    extra = {"text": [f"data.cache_dir={tmp_path}/cache"],
             "packed": [f"data.cache_dir={tmp_path}/cache", "data.packing_mask=true"],
             "chat": ["data.format=chat", f"data.corpus={_chat_corpus(tmp_path / 'chat.jsonl')}"]}[fmt]
    extra += ["training.sample_tokens=0"]
    full = train(_cfg(tmp_path / "a", "training.max_steps=8", *extra))
    train(_cfg(tmp_path / "b", "training.max_steps=4", *extra))
    resumed = train(_cfg(tmp_path / "b", "training.max_steps=8", "training.resume=true", *extra))
    a = _records(tmp_path / "a" / "run" / "metrics.jsonl")
    b = _records(tmp_path / "b" / "run" / "metrics.jsonl")
    loss_a = {r["step"]: r["loss"] for r in a if "loss" in r}
    loss_b = {r["step"]: r["loss"] for r in b if "loss" in r}
    assert loss_a == loss_b  # every step, bit for bit, including steps 5-8 after the restart
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(full["state"].params),
                 jax.device_get(resumed["state"].params))
    assert int(resumed["state"].step) == 8


def _cli_args(run_dir, steps):
    """``scripts/train.py`` for ``steps`` steps, a log line every 5, the progress bar asked for."""
    return [sys.executable, "scripts/train.py", *SMALL, f"training.max_steps={steps}", "logging.log_every=5",
            "training.sample_tokens=0", "logging.progress_bar=true", f"logging.run_dir={run_dir}"]


def _run_on_a_terminal(args) -> tuple[int, str]:
    """Run ``args`` with stderr on a pseudo-terminal; returns the exit status and what it showed."""
    main, child = pty.openpty()
    fcntl.ioctl(child, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))  # 120 columns for the bar
    proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=child)
    os.close(child)
    chunks = []
    try:
        while True:
            try:
                chunk = os.read(main, 65536)
            except OSError:  # EIO: the process closed its end, everything is read
                break
            if not chunk:
                break
            chunks.append(chunk)
        return proc.wait(timeout=300), b"".join(chunks).decode(errors="replace")
    finally:
        os.close(main)
        if proc.poll() is None:
            proc.kill()


def _step_lines(text):
    """The steps of the plain step lines (``[rank 0] step 5/20, loss ...``) in ``text``."""
    pattern = r"\[rank 0\] step (\d+)/\d+, loss \d+\.\d+, lr \S+, grad_norm \S+, [\d,]+ tok/s, \S+ [TGM]FLOPS"
    return [int(s) for s in re.findall(pattern, text)]


@pytest.mark.timeout(600)
def test_log_is_readable_without_a_terminal(tmp_path):
    """Issue 45 item 8: stderr to a pipe (SLURM, nohup, ``> log``) gets no progress bar (no ``\\r``
    rewrites) but one plain line per ``log_every`` steps; ``train.log`` holds the same lines. On a
    terminal the bar stays, and the step lines go to ``train.log`` only."""
    r = subprocess.run(_cli_args(tmp_path / "pipe", 20), cwd=ROOT, stdout=subprocess.DEVNULL,
                       stderr=subprocess.PIPE, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "\r" not in r.stderr, repr(r.stderr[-2000:])
    assert _step_lines(r.stderr) == [5, 10, 15, 20], r.stderr[-3000:]
    log = (tmp_path / "pipe" / "train.log").read_text()
    assert _step_lines(log) == [5, 10, 15, 20], log[-3000:]

    status, shown = _run_on_a_terminal(_cli_args(tmp_path / "tty", 10))
    assert status == 0, shown[-3000:]
    assert "train: 100%|" in shown and "\rtrain:" in shown  # tqdm's bar, rewritten in place
    assert _step_lines(shown) == [], shown[-3000:]
    assert _step_lines((tmp_path / "tty" / "train.log").read_text()) == [5, 10]


def test_cli_rejects_bad_config_before_compiling():
    r = subprocess.run([sys.executable, "scripts/train.py", "parallel.tensor_parallel_size=3"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "tensor_parallel_size=3 does not divide model.num_attention_heads=4" in r.stderr


def test_dry_run_cli():
    r = subprocess.run([sys.executable, "scripts/train.py", "--config", "configs/llama_80l_example.yaml", "--dry-run"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "parameters 111,518,035,968" in r.stdout and "mesh" in r.stdout


def test_fp16_stops_after_consecutive_overflows_at_min_scale(tmp_path):
    # a loss scale pinned at 1e38 overflows fp16 on every step and cannot back off
    cfg = _cfg(tmp_path, "precision.fp16=true", "precision.initial_scale=1e38", "precision.min_scale=1e38",
               "precision.max_scale=1e38", "precision.max_consecutive_skips=3", "training.max_steps=50",
               "checkpoint.dir=")
    with pytest.raises(FloatingPointError, match="3 consecutive steps overflowed with the loss scale at its minimum"):
        train(cfg)
    recs = _records(tmp_path / "run" / "metrics.jsonl")
    assert [r["skipped"] for r in recs if "loss" in r] == [1, 1, 1]  # steps 1-3 logged, then step 3 raised
