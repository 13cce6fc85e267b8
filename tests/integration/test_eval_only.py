"""``scripts/train.py --eval-only`` (issue 45, item 14): a finished run's checkpoint gives back the
validation loss logged at its step, without training or saving; nothing to evaluate is refused."""

import json
import math
import os
import re
import subprocess
import sys

from jaxcolossal.checkpoint import step_dirs
from jaxcolossal.config import load_config
from jaxcolossal.train.loop import train

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMALL = ["model.num_layers=2", "model.hidden_size=64", "model.intermediate_size=128", "training.seq_len=32",
         "training.batch_size=16", "training.eval_batches=2", "training.sample_tokens=0",
         "data.max_corpus_bytes=400000", "logging.progress_bar=false", "logging.log_every=1"]
LINE = re.compile(r"^validation loss (\d+\.\d{4}) nats/token, perplexity (\d+\.\d+) at step (\d+) \((.*)\)$", re.M)


def _records(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def _train_py(*args):
    return subprocess.run([sys.executable, "scripts/train.py", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "PYTHONPATH": ROOT})


def test_eval_only_gives_the_logged_val_loss_of_a_finished_run(tmp_path):
    ckpt, run_dir = tmp_path / "ckpt", tmp_path / "run"
    keys = SMALL + [f"checkpoint.dir={ckpt}", f"logging.run_dir={run_dir}"]
    train(load_config(os.path.join(ROOT, "configs/llama_tiny.yaml"), keys + ["training.max_steps=4",
                                                                             "training.eval_every=2"]))
    before = _records(run_dir / "metrics.jsonl")
    logged = {r["step"]: r["val_loss"] for r in before if "val_loss" in r}
    assert sorted(logged) == [0, 2, 4]
    steps = step_dirs(str(ckpt))
    assert steps[-1] == 4

    # the finished run, rerun as it was, has nothing to train; --eval-only evaluates its last step
    r = _train_py("--eval-only", *keys, "training.max_steps=4", "training.eval_every=2")
    assert r.returncode == 0, r.stderr[-3000:]
    m = LINE.search(r.stdout)
    assert m, r.stdout[-2000:]
    printed, ppl, step, source = float(m[1]), float(m[2]), int(m[3]), m[4]
    assert step == 4 and source == f"checkpoint step 4 in {ckpt}"
    assert printed == round(logged[4], 4) and abs(ppl - math.exp(logged[4])) < 0.01
    new = _records(run_dir / "metrics.jsonl")[len(before):]
    assert len(new) == 1 and new[0]["eval_only"] is True and new[0]["step"] == 4, new  # one record, no step trained
    # the same evaluation function, batches, mesh and sharding on the same weights: bit for bit
    assert new[0]["val_loss"] == logged[4], (new[0]["val_loss"], logged[4])
    assert step_dirs(str(ckpt)) == steps  # no checkpoint saved


def test_eval_only_with_nothing_to_evaluate_is_refused_in_one_line(tmp_path):
    r = _train_py("--eval-only", f"checkpoint.dir={tmp_path / 'empty'}", f"logging.run_dir={tmp_path / 'run'}")
    assert r.returncode == 2, r.stderr[-3000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "--eval-only: nothing to evaluate" in lines[0] and "model.init_from" in lines[0], lines
    assert not (tmp_path / "empty").exists() and not (tmp_path / "run").exists()  # refused before anything ran
