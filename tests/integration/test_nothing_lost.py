"""Nothing lost, nothing silent: the training loop as a user meets it (issue 10).

One small training run (``trained``, 8 steps, a checkpoint every 2 steps, vocabulary 512 with the
256-id byte tokenizer, an evaluation made slow on purpose) serves several tests; each test that
changes its checkpoints works on a copy.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from jaxcolossal.checkpoint import CheckpointManager, CheckpointMismatchError, step_dirs
from jaxcolossal.config import ConfigError, load_config
from jaxcolossal.models.hf_io import load_hf
from jaxcolossal.parallel.mesh import make_mesh
from jaxcolossal.train import evaluate, loop
from jaxcolossal.train.guard import NonFiniteError
from jaxcolossal.train.optimizer import build_optimizer
from jaxcolossal.train.state import init_state, make_plan

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMALL = ["model.num_layers=2", "model.hidden_size=64", "model.intermediate_size=128", "training.seq_len=32",
         "training.batch_size=16", "training.eval_batches=2", "training.sample_tokens=0",
         "data.max_corpus_bytes=300000", "logging.progress_bar=false", "training.eval_every=0",
         "training.warmup_steps=2"]
EVAL_PAUSE_S = 1.0
EXIT_AT_ONCE_S = 1.0
"""The most seconds from a second Ctrl-C during the compile to the process's exit: 0.1-0.3 s here,
against 1.7-12 s (and sometimes a segmentation fault) when the interpreter's teardown waits for the
abandoned compile."""


def config(tmp, *extra):
    return load_config(os.path.join(ROOT, "configs/llama_tiny.yaml"),
                       SMALL + [f"logging.run_dir={tmp}/run", f"checkpoint.dir={tmp}/ckpt", *extra])


def records(tmp):
    with open(os.path.join(tmp, "run", "metrics.jsonl")) as f:
        return [json.loads(line, parse_constant=lambda c: pytest.fail(f"not JSON: {c}")) for line in f]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """8 steps, checkpoints at 2, 4, 6, 8 (eval at 4 is slowed by EVAL_PAUSE_S), vocab 512, a sample."""
    tmp = tmp_path_factory.mktemp("trained")
    slow = evaluate.held_out

    def slow_evaluate(run, state):
        time.sleep(EVAL_PAUSE_S)
        return slow(run, state)

    evaluate.held_out = slow_evaluate
    try:
        out = loop.train(config(tmp, "training.max_steps=8", "checkpoint.save_every=2", "checkpoint.max_to_keep=10",
                                "training.eval_every=4", "logging.log_every=2", "model.vocab_size=512",
                                "training.sample_tokens=40"))
    finally:
        evaluate.held_out = slow
    return tmp, out


def test_sample_uses_only_the_tokenizers_ids(trained):
    _, out = trained  # vocab 512 > 256 byte ids: sampling an id >= 256 used to crash the byte decoder
    assert out["sample"].startswith("def ") and len(out["sample"].encode("utf-8", "replace")) >= 4


def test_throughput_excludes_evaluation_time(trained):
    tmp, _ = trained
    rate = {r["step"]: r["tokens_per_s"] for r in records(tmp) if "tokens_per_s" in r}
    # the window (4, 6] follows the 1 s evaluation at step 4; (6, 8] has none (the eval at 8 is after its log)
    assert rate[6] / rate[8] > 0.33, rate  # charging the evaluation to the steps made it ~20x lower


def test_warmup_starts_above_zero(trained):
    tmp, _ = trained
    lr = {r["step"]: r["lr"] for r in records(tmp) if "lr" in r}  # warmup 2: step 1 at lr/2, step 2 at lr
    assert lr[2] == pytest.approx(3e-3) and 0 < lr[2]


def test_damaged_newest_and_stray_steps_never_block_new_saves(trained, tmp_path, capfd):
    src, _ = trained
    shutil.copytree(src / "ckpt", tmp_path / "ckpt")
    for dirpath, _, files in os.walk(tmp_path / "ckpt" / "8"):  # a crash mid-copy or a bad disk
        for f in files:
            if not f.startswith("_") and not f.endswith(".txt"):
                with open(os.path.join(dirpath, f), "r+b") as fh:
                    fh.truncate(3)
    os.makedirs(tmp_path / "ckpt" / "99")  # a stray empty folder with a higher step number
    out = loop.train(config(tmp_path, "training.max_steps=10", "checkpoint.save_every=2",
                            "checkpoint.max_to_keep=10", "training.resume=true", "model.vocab_size=512",
                            "logging.log_every=1"))
    assert out["exit_code"] == 0
    steps = step_dirs(str(tmp_path / "ckpt"))
    assert steps == [2, 4, 6, 8, 10]  # 8 and 10 were written again by the resumed run
    moved = sorted(n.split("-")[0] for n in os.listdir(tmp_path / "ckpt" / "damaged"))
    assert moved == ["8", "99"]
    trained_steps = [r["step"] for r in records(tmp_path) if "loss" in r]
    assert trained_steps[0] == 7  # resumed from 6, the newest step that restored
    err = capfd.readouterr().err
    assert "schedule differs from the saved run's" in err  # max_steps 8 -> 10
    skipped = [line for line in err.splitlines() if "is skipped:" in line]  # one line each, no warnings' echo
    assert [line.split("] ", 1)[1].split(";")[0] for line in skipped] == [
        "checkpoint step 99 is skipped: files are missing (an incomplete or foreign folder)",
        "checkpoint step 8 is skipped: its data files are truncated or corrupt"], skipped
    assert "RuntimeWarning" not in err and "warnings.warn" not in err


def test_resume_with_nothing_left_to_train_is_an_error(trained, tmp_path):
    src, _ = trained
    shutil.copytree(src / "ckpt", tmp_path / "ckpt")
    with pytest.raises(ConfigError, match=r"training.max_steps=8: the checkpoint is already at step 8, so there is "
                                          r"nothing to train.*training.max_steps=16"):
        loop.train(config(tmp_path, "training.max_steps=8", "training.resume=true", "model.vocab_size=512"))


def test_resume_with_another_model_names_the_keys(trained):
    tmp, _ = trained
    cfg = config(tmp, "model.hidden_size=32", "model.vocab_size=512", "training.resume=true")
    plan = make_plan(cfg, make_mesh(cfg.parallel))
    target = init_state(plan, build_optimizer(cfg.training, plan), key=jax.random.key(0))
    cm = CheckpointManager(cfg.checkpoint.dir, config=cfg.to_dict())
    with pytest.raises(CheckpointMismatchError, match=r"Config keys that differ: model.hidden_size: saved 64, now 32\. ") as e:
        cm.restore(target)
    assert "params.embed_tokens: saved (512, 64), now (512, 32)" in str(e.value)
    assert step_dirs(cfg.checkpoint.dir) == [2, 4, 6, 8]  # a mismatch is not damage: nothing moved


def test_convert_a_checkpoint_dir_to_hugging_face(trained, tmp_path):
    tmp, _ = trained
    r = subprocess.run([sys.executable, "scripts/convert_hf.py", "--to-hf", str(tmp / "ckpt"), str(tmp_path / "hf"),
                        "--step", "6"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    cfg, params = load_hf(tmp_path / "hf")
    assert (cfg.hidden_size, cfg.vocab_size, cfg.num_layers) == (64, 512, 2)
    saved, step = CheckpointManager(str(tmp / "ckpt")).restore_params(6)
    assert step == 6
    np.testing.assert_array_equal(params["layers"]["wq"], saved["layers"]["wq"])
    np.testing.assert_array_equal(params["embed_tokens"], saved["embed_tokens"][:512])
    r = subprocess.run([sys.executable, "scripts/convert_hf.py", "--to-hf", str(tmp / "ckpt" / "6"), str(tmp_path / "x")],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and f"pass '{tmp / 'ckpt'}' with --step 6" in r.stderr, r.stderr


def test_nan_stops_the_run_and_no_checkpoint_holds_it(tmp_path):
    cfg = config(tmp_path, "training.learning_rate=1e30", "checkpoint.save_every=1", "checkpoint.max_to_keep=1",
                 "training.eval_every=1", "training.max_steps=12", "logging.log_every=5")
    with pytest.raises(NonFiniteError, match=r"step \d+: loss \S+, grad_norm \S+ is not finite; the update was "
                                             r"not applied and training stopped") as e:
        loop.train(cfg)
    assert e.value.step < 12
    recs = records(tmp_path)  # every line is strict JSON (records() fails on NaN/Infinity)
    bad = [r for r in recs if r.get("nonfinite")]  # logged although not a log_every step: its values matter
    assert bad and bad[0]["nonfinite_values"], bad  # the NaN values are spelt out, their keys are null
    assert all(bad[0][k] is None and v in ("nan", "inf", "-inf") for k, v in bad[0]["nonfinite_values"].items())
    cm = CheckpointManager(str(tmp_path / "ckpt"))
    assert cm.all_steps(), "the last finite state is saved"
    for s in cm.all_steps():
        params, _ = cm.restore_params(s)
        assert all(np.isfinite(x).all() for x in jax.tree.leaves(params)), s


@pytest.mark.timeout(300)
def test_ctrl_c_saves_and_exits(tmp_path, sig=signal.SIGINT, code=130):
    """Ctrl-C takes SIGTERM's path (StopSignals maps both; tests/unit/test_guard.py checks SIGTERM's
    flag and exit code) through a real process: save the step, exit 128 + 2."""
    args = [sys.executable, "scripts/train.py", *SMALL, "training.max_steps=100000", "logging.log_every=1",
            f"logging.run_dir={tmp_path}/run", f"checkpoint.dir={tmp_path}/ckpt"]
    proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.time() + 240
    try:
        while time.time() < deadline:
            if metrics.exists() and sum(1 for line in open(metrics) if '"loss"' in line) >= 3:
                break
            if proc.poll() is not None:
                pytest.fail(f"training exited early: {proc.stderr.read()[-2000:]}")
            time.sleep(0.5)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == code, err[-2000:]
    assert f"{signal.Signals(sig).name} received: saving step" in err
    assert err.count("validation loss at step 0") == 1, err[-3000:]  # each log line once, above the bar
    steps = [r["step"] for r in records(tmp_path) if "loss" in r]
    cm = CheckpointManager(str(tmp_path / "ckpt"))
    assert cm.latest_step() is not None and cm.latest_step() >= steps[-1] >= 3


def _training_process(tmp_path, *extra, env=None):
    """scripts/train.py on the small model for 4 steps, stderr merged into stdout (one ordered stream)."""
    args = [sys.executable, "scripts/train.py", *SMALL, "training.max_steps=4", "logging.log_every=1",
            f"logging.run_dir={tmp_path}/run", f"checkpoint.dir={tmp_path}/ckpt", *extra]
    return subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=None if env is None else {**os.environ, **env})


def _read_until(proc, marker: str) -> str:
    """The process's output up to and including the first line that holds ``marker``."""
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if marker in line:
            return "".join(seen)
    pytest.fail(f"exited ({proc.wait()}) before printing {marker!r}: {''.join(seen)[-3000:]}")


def _nothing_written(tmp_path) -> None:
    """No checkpoint (not even an unfinished save) and no record of a step in metrics.jsonl."""
    ckpt = tmp_path / "ckpt"
    assert not ckpt.exists() or not os.listdir(ckpt), os.listdir(ckpt)
    if (tmp_path / "run" / "metrics.jsonl").exists():
        assert not [r for r in records(tmp_path) if "step" in r], records(tmp_path)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["ctrl_c", "sigterm"])
def test_ctrl_c_during_start_up_stops_before_the_first_step(tmp_path, sig, code):
    """Issue 45 item 5: a Ctrl-C (or SIGTERM) while the run starts (here just after the mesh and plan
    are made) stops at the next start-up phase: nothing compiles, no step runs, nothing is saved, exit
    130 (143) with one line that says so."""
    proc = _training_process(tmp_path)
    try:
        out = _read_until(proc, "jaxcolossal INFO: [rank 0] mesh {")
        t0 = time.monotonic()
        proc.send_signal(sig)
        out += proc.communicate(timeout=90)[0]
        stopped_s = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == code, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    assert "train step compiled" not in out and "validation loss" not in out, out[-3000:]  # well before a step
    said = [line for line in out.splitlines() if "stopped before training started" in line]
    assert len(said) == 1 and f"{sig.name} received" in said[0] and "nothing was saved" in said[0], out[-3000:]
    assert stopped_s < 30, stopped_s  # a normal run's first step comes after the compile and the evaluation
    _nothing_written(tmp_path)


@pytest.mark.timeout(120)
def test_second_ctrl_c_during_start_up_exits_130_without_a_crash(tmp_path):
    """Issue 45 item 4: a second Ctrl-C 1 s after the first, while the train step compiles, exits
    130 at once: not after the abandoned compile ends, with a segmentation fault (139 / -11) from an
    interpreter that tears XLA's client down under it; no traceback."""
    proc = _training_process(tmp_path, env={"JAX_COMPILATION_CACHE_DIR": ""})  # a real compile, not a cache hit
    try:
        out = _read_until(proc, "compiling the train step")
        proc.send_signal(signal.SIGINT)
        time.sleep(1.0)
        proc.send_signal(signal.SIGINT)
        t0 = time.monotonic()
        out += proc.communicate(timeout=90)[0]
        exit_s = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    if "train step compiled" in out:  # a machine that compiles this step in under a second
        pytest.skip("the train step compiled before the second Ctrl-C")
    assert proc.returncode == 130, out[-3000:]
    assert exit_s < EXIT_AT_ONCE_S, exit_s
    assert "Traceback" not in out and "Fatal Python error" not in out, out[-3000:]
    assert "nothing saved" in out or "nothing was saved" in out, out[-3000:]
    _nothing_written(tmp_path)


# ----------------------------------------------------------------------------- before anything compiles


def _cli(*overrides):
    return subprocess.run([sys.executable, "scripts/train.py", *overrides], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


def test_fresh_run_into_a_folder_with_checkpoints_is_refused(tmp_path):
    for s in (200, 350, 400):
        os.makedirs(tmp_path / "ckpt" / str(s))
    with pytest.raises(ConfigError, match=r"checkpoint.dir=.*already holds the checkpoints of steps 200, 350, 400.*"
                                          r"training.resume=true.*checkpoint.overwrite=true"):
        loop.preflight(config(tmp_path, "training.max_steps=20"))
    loop.preflight(config(tmp_path, "checkpoint.overwrite=true"))  # the user said so
    loop.preflight(config(tmp_path, "training.resume=auto"))


def test_resume_true_with_an_empty_folder_is_an_error_auto_is_not(tmp_path):
    with pytest.raises(ConfigError, match=r"training.resume=true, but checkpoint.dir=.* holds no checkpoint"):
        loop.preflight(config(tmp_path, "training.resume=true"))
    loop.preflight(config(tmp_path, "training.resume=auto"))


def test_vocab_smaller_than_the_tokenizer_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"model.vocab_size=128 is smaller than the 256 ids of data.tokenizer=byte"):
        loop.preflight(config(tmp_path, "model.vocab_size=128"))


@pytest.mark.parametrize("overrides,message", [
    (["training.resume=true", "checkpoint.dir="], "training.resume=true needs checkpoint.dir"),
    (["model.init_from=/nonexistent/hf"], "model.init_from='/nonexistent/hf': '/nonexistent/hf/config.json' does not exist"),
    (["logging.log_every=0"], "logging.log_every=0: must be >= 1"),
], ids=["resume_without_dir", "missing_init_from", "log_every_zero"])
def test_cli_errors_are_one_line_before_compiling(overrides, message):
    r = _cli(*overrides)
    assert r.returncode == 2, r.stderr[-2000:]
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert lines == [f"config error: {lines[0][len('config error: '):]}"] and message in lines[0], r.stderr
    assert "compiled" not in r.stderr


def test_the_documented_resume_recipe_continues():
    """docs/training.md's resume commands: the second continues the first's folder past its steps."""
    guide = open(os.path.join(ROOT, "docs", "training.md")).read()
    block = guide.split("## Checkpoints and resume", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    first, second = [line for line in block.splitlines() if line.startswith("python ")][:2]
    default_steps = load_config(os.path.join(ROOT, "configs/llama_tiny.yaml")).training.max_steps
    more = [int(a.split("=")[1]) for a in second.split() if a.startswith("training.max_steps=")]
    assert "training.resume=true" in second and more and more[0] > default_steps, block
    assert first.split("checkpoint.dir=")[1].split()[0] == second.split("checkpoint.dir=")[1].split()[0]