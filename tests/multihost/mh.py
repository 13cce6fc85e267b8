"""Helpers of the multi-process tests: clean environments, bounded subprocess runs, metrics.

Every subprocess runs under a timeout. A launcher that overruns gets SIGTERM (it then stops its
own processes) and SIGKILL after 15 s, and the test fails: nothing may hang.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TRAIN = str(REPO / "scripts" / "train.py")

# Launcher variables that must not leak from the test's own environment into the children.
_STRIP_PREFIXES = ("SLURM_", "OMPI_", "PMI_", "PMIX_", "JAX_COORDINATOR", "JAX_LOCAL_DEVICE_IDS",
                   "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")
_STRIP = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE",
          "NODE_RANK", "JAXCOLOSSAL_COLLECTIVE_TIMEOUT", "XLA_FLAGS"}

# The tiny main job of the multi-process tests (CPU heavy: keep it small).
TINY = [
    "model.num_layers=2", "model.hidden_size=64", "model.intermediate_size=128",
    "training.seq_len=32", "training.batch_size=16", "data.max_corpus_bytes=2000000",
    "training.learning_rate=3e-3", "training.warmup_steps=1", "logging.log_every=1",
    "training.eval_every=0", "training.eval_batches=1", "training.sample_tokens=0",
    "logging.progress_bar=false",
]


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without launcher variables, plus ``extra``."""
    env = {k: v for k, v in os.environ.items()
           if k not in _STRIP and not k.startswith(_STRIP_PREFIXES)}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env["JAX_PLATFORMS"] = "cpu"
    env.update(extra)
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str
    seconds: float

    def describe(self) -> str:
        return (f"status {self.returncode} after {self.seconds:.1f} s\n--- stdout (end):\n{self.stdout[-4000:]}"
                f"\n--- stderr (end):\n{self.stderr[-6000:]}")


def _stop(p: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 10)):
        if p.poll() is not None:
            return
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            return
        try:
            p.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            pass


def run(cmd: list[str], env: dict[str, str], timeout: float, cwd: Path = REPO) -> Result:
    """Run ``cmd`` to completion within ``timeout`` seconds, else stop it and fail the test."""
    t0 = time.monotonic()
    p = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _stop(p)
        out, err = p.communicate()
        pytest.fail(f"{cmd[:6]}... did not finish within {timeout} s\n{err[-6000:]}")
    finally:
        if p.poll() is None:
            _stop(p)
    return Result(p.returncode, out, err, time.monotonic() - t0)


def launcher(nproc: int, program: str, *args: str, timeout_s: int = 60, extra: tuple[str, ...] = (),
             log_dir: Path | None = None) -> list[str]:
    """Command line of ``python -m jaxcolossal.run`` with our defaults."""
    cmd = [sys.executable, "-m", "jaxcolossal.run", "--nproc", str(nproc), "--timeout", str(timeout_s),
           "--kill-grace", "2", *extra]
    if log_dir is not None:
        cmd += ["--log-dir", str(log_dir)]
    return cmd + [program, *args]


def tagged_json(text: str, tag: str = "RESULT ") -> list:
    """Every JSON value printed after ``tag`` in ``text``, in order.

    Native libraries in the child (gloo's "Rank 0 is connected to 1 peer ranks") write to the same
    stdout from C++, without Python's line buffering, so their text can land on the same line right
    after ours. The value is decoded up to its own end and what follows it is ignored.
    """
    dec = json.JSONDecoder()
    out = []
    for line in text.splitlines():
        at = line.find(tag)
        if at >= 0:
            out.append(dec.raw_decode(line, at + len(tag))[0])
    return out


def read_metrics(run_dir: Path) -> list[dict]:
    with open(run_dir / "metrics.jsonl") as f:
        return [json.loads(line) for line in f if line.strip()]


def train_losses(records: list[dict]) -> dict[int, float]:
    """``{step: loss}`` of the training records (each step must appear once)."""
    out: dict[int, float] = {}
    for r in records:
        if "loss" in r:
            assert r["step"] not in out, f"step {r['step']} written twice"
            out[r["step"]] = r["loss"]
    return out
