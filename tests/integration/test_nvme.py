"""The NVMe tier (issue 11, ZeRO-Infinity): the offloaded optimizer state lives in files.

Equivalence is bit for bit: the files hold the same fp32 bytes that host memory would, and the
update is the same streamed one. Crash safety: a step that dies in the middle of its writes leaves
the previous step's generation whole and committed."""

import collections
import json
import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
from tiny import run_steps, tiny_config

import jaxcolossal.train.nvme as nvme
from jaxcolossal.config import ConfigError, load_config, validate
from jaxcolossal.parallel.mesh import make_mesh
from jaxcolossal.train.loop import train
from jaxcolossal.train.nvme import nvme_tier
from jaxcolossal.train.optimizer import build_optimizer
from jaxcolossal.train.state import make_plan

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _cfg(parallel, precision, **offload):
    cfg = tiny_config(parallel, precision, training={"max_grad_norm": 1.0})
    for k, v in offload.items():
        setattr(cfg.offload, k, v)
    return cfg


def _same(a, b):
    for x, y in zip(jax.tree.leaves(jax.device_get(a)), jax.tree.leaves(jax.device_get(b))):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# Equivalence (bit for bit against the run without offload) is in tests/integration/test_offload.py:
# ZeRO-3 bf16 with offload_optim_frac=1 (and the bytes per device against the formula), and tp 2
# ZeRO-2 fp32. By hand, 5 steps: those two, ZeRO-3 bf16 at 0.5, and pp 2 ZeRO-1 bf16 (docs/offload.md).


CRASH_WORKER = """
import os, signal, sys
sys.path.insert(0, {tests!r})
import conftest  # noqa: F401  (8 simulated devices)
import jax, numpy as np
from tiny import random_batches, setup, tiny_config
from jaxcolossal.train.nvme import NvmeTier, nvme_tier
cfg = tiny_config({{"data_parallel_size": 8, "zero_stage": 2}}, None, training={{"max_grad_norm": 1.0}})
cfg.offload.offload_optim_frac, cfg.offload.nvme_path = 1.0, {path!r}
plan, tx, state, step = setup(cfg)
xs = random_batches(cfg, 3)
batch = lambda x: {{"inputs": jax.device_put(x[:, :-1], plan.batch_sharding),
                    "targets": jax.device_put(x[:, 1:], plan.batch_sharding)}}
for x in xs[:2]:
    state, _ = step(state, batch(x))
flat = jax.tree.leaves(jax.device_get(nvme_tier(plan, tx).fill(state)))  # step 2, committed
np.savez({want!r}, *[np.asarray(a) for a in flat])
calls, write = [0], NvmeTier._write
def killed_after_five(self, *args):
    calls[0] += 1
    if calls[0] > 5:
        os.kill(os.getpid(), signal.SIGKILL)  # the power goes out in the middle of step 3's writes
    write(self, *args)
NvmeTier._write = killed_after_five
jax.block_until_ready(step(state, batch(xs[2])))
print("step 3 finished: the crash did not happen")
"""


def test_a_crash_in_the_middle_of_the_writes_leaves_the_previous_step_whole(tmp_path):
    """A process killed (SIGKILL) after five of step 3's shard files are written: step 2's
    generation is untouched, still the committed one, and reads back as the state at step 2."""
    nvme, want = tmp_path / "nvme", tmp_path / "step2.npz"
    code = CRASH_WORKER.format(tests=os.path.join(ROOT, "tests"), path=str(nvme), want=str(want))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == -9, (r.returncode, r.stdout, r.stderr[-2000:])
    cfg = _cfg({"data_parallel_size": 8, "zero_stage": 2}, None, offload_optim_frac=1.0, nvme_path=str(nvme))
    plan = make_plan(cfg, make_mesh(cfg.parallel))  # the killed run's plan (nothing compiled here)
    tier = nvme_tier(plan, build_optimizer(plan.cfg.training, plan))
    assert {tier.committed_step(d) for d in range(8)} == {2}
    saved = np.load(want)
    flat = [saved[f"arr_{i}"] for i in range(len(saved.files))]
    for i, arr in tier.load(2).items():
        np.testing.assert_array_equal(np.asarray(jax.device_get(arr)), flat[i])


def test_damaged_file_and_wrong_step_are_named(tmp_path):
    state, _, plan = run_steps(_cfg({"data_parallel_size": 8, "zero_stage": 2}, None, offload_optim_frac=1.0,
                                    nvme_path=str(tmp_path)), steps=1)
    tier = nvme_tier(plan, build_optimizer(plan.cfg.training, plan))
    tier.commit(state)
    with pytest.raises(Exception, match="manifest holds step 1, the train state is at step 0"):
        tier.load(0)
    victim = tier.file(1, next(iter(tier.slots)), 0)
    with open(victim, "r+b") as f:
        f.truncate(12)
    with pytest.raises(Exception, match="holds 3 values, expected"):
        tier.load(1)


def test_nvme_settings_are_checked_before_compiling(tmp_path):
    with pytest.raises(ConfigError, match="optimizer_device=device"):
        validate(_cfg({"data_parallel_size": 8}, None, offload_optim_frac=1.0, optimizer_device="host",
                      nvme_path=str(tmp_path)))
    with pytest.raises(ConfigError, match="offload_optim_frac is 0"):
        validate(_cfg({"data_parallel_size": 8}, None, nvme_path=str(tmp_path)))
    # a disk too small for both generations: refused with the bytes, before anything compiles
    cfg = _cfg({"data_parallel_size": 8, "zero_stage": 3}, "bf16", offload_optim_frac=1.0, nvme_path=str(tmp_path / "n"))
    plan = make_plan(cfg, make_mesh(cfg.parallel))
    Usage = collections.namedtuple("Usage", "total used free")
    orig = nvme.shutil.disk_usage
    nvme.shutil.disk_usage = lambda p: Usage(10**6, 10**6 - 1000, 1000)
    try:
        with pytest.raises(ConfigError, match=r"needs 2,563,584 bytes on that disk \(2 generations × 160,224 bytes × 8"):
            nvme_tier(plan, build_optimizer(cfg.training, plan))
    finally:
        nvme.shutil.disk_usage = orig
    (tmp_path / "f").write_text("x")
    with pytest.raises(ConfigError, match="is a file, not a folder"):
        validate(_cfg({"data_parallel_size": 8}, None, offload_optim_frac=1.0, nvme_path=str(tmp_path / "f")))


def test_main_job_on_nvme_saves_whole_checkpoints_and_resumes_bit_exact_without_it(tmp_path):
    """The main job with the NVMe tier saves the whole state; resuming its step-3 checkpoint without
    NVMe trains steps 4-6 exactly as the NVMe run did."""
    common = ["model.num_layers=2", "model.hidden_size=64", "model.intermediate_size=128", "training.seq_len=32",
              "training.batch_size=16", "training.eval_batches=1", "training.sample_tokens=0",
              "data.max_corpus_bytes=100000", "logging.progress_bar=false", "training.eval_every=0",
              "training.max_steps=6", "logging.log_every=1", "checkpoint.save_every=3",
              f"checkpoint.dir={tmp_path}/ckpt", "training.resume=auto"]
    yaml = os.path.join(ROOT, "configs/llama_tiny.yaml")
    out = train(load_config(yaml, common + [f"logging.run_dir={tmp_path}/a", "offload.offload_optim_frac=1",
                                            f"offload.nvme_path={tmp_path}/nvme"]))
    assert out["val_loss_end"] < out["val_loss_start"]
    shutil.rmtree(tmp_path / "ckpt" / "6")
    train(load_config(yaml, common + [f"logging.run_dir={tmp_path}/b"]))

    def losses(run):
        with open(tmp_path / run / "metrics.jsonl") as f:
            return {r["step"]: r["loss"] for r in map(json.loads, f) if "loss" in r}

    a, b = losses("a"), losses("b")
    assert sorted(b) == [4, 5, 6] and all(a[s] == b[s] for s in b)
