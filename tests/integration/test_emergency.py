"""Emergency (local) checkpoints in one process: bit-exact restore, preferred over an older
persistent step, a lost folder restored from the peer replica, a different layout ignored."""
import json
import os
import shutil

import jax
import numpy as np
import pytest
from tiny import SMALL_MAIN_JOB

from jaxcolossal.config import load_config
from jaxcolossal.runtime import goodput
from jaxcolossal.train.emergency import LocalCheckpoints, agree_step
from jaxcolossal.train.loop import train

MAIN_JOB = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "configs",
                        "llama_tiny.yaml")


def _cfg(tmp_path, where, *extra):
    return load_config(MAIN_JOB, SMALL_MAIN_JOB + [
        f"logging.run_dir={tmp_path / where}/run", f"checkpoint.dir={tmp_path / where}/ckpt",
        f"checkpoint.local_dir={tmp_path / where}/local", f"data.cache_dir={tmp_path}/cache",
        "training.eval_batches=1", *extra])


def _same(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


class Crash(RuntimeError):
    pass


def _crash_after(monkeypatch, step):
    """The next run raises right after its step ``step`` (as if the process died there)."""
    original = goodput.GoodputRecorder.step_done

    def step_done(self, done):
        original(self, done)
        if done == step:
            raise Crash(f"crash after step {done}")
    monkeypatch.setattr(goodput.GoodputRecorder, "step_done", step_done)


def test_local_checkpoint_restores_bit_exact_and_is_preferred(tmp_path, monkeypatch):
    full = train(_cfg(tmp_path, "a", "training.max_steps=5", "checkpoint.local_every=2"))
    assert os.listdir(tmp_path / "a" / "local" / "rank0" / "replica_of_rank0") == []  # a finished run clears them
    with monkeypatch.context() as m:  # dies after step 3: emergency step 2, no persistent step
        _crash_after(m, 3)
        with pytest.raises(Crash):
            train(_cfg(tmp_path, "b", "training.max_steps=5", "checkpoint.save_every=3", "checkpoint.local_every=2"))
    local = tmp_path / "b" / "local"
    assert sorted(os.listdir(local / "rank0")) == ["replica_of_rank0", "step_2"]
    resumed = train(_cfg(tmp_path, "b", "training.max_steps=5", "checkpoint.local_every=2", "training.resume=auto"))
    _same(resumed["state"], full["state"])
    g = resumed["goodput"]
    assert g["attempts"] == 1  # the restart count was not set: a new job in goodput.jsonl
    text = open(tmp_path / "b" / "run" / "train.log").read()
    assert "resumed from step 2 of the emergency (local) checkpoints" in text


def test_lost_local_folder_comes_back_from_the_replica(tmp_path, monkeypatch):
    with monkeypatch.context() as m:
        _crash_after(m, 3)
        with pytest.raises(Crash):
            train(_cfg(tmp_path, "b", "training.max_steps=4", "checkpoint.local_every=1"))
    local = tmp_path / "b" / "local"
    shutil.rmtree(local / "rank0" / "step_2")  # the own copy is gone; the replica (rank (0+1)%1 = 0's) stays
    meta = json.load(open(local / "rank0" / "replica_of_rank0" / "step_2" / "meta.json"))
    assert meta["process_count"] == 1 and meta["step"] == 2
    monkeypatch.setenv("JAXCOLOSSAL_RESTART_COUNT", "1")
    out = train(_cfg(tmp_path, "b", "training.max_steps=4", "checkpoint.local_every=1", "training.resume=true"))
    text = open(tmp_path / "b" / "run" / "train.log").read()
    assert "resumed from step 2 of the emergency (local) checkpoints" in text and "replica_of_rank0" in text
    assert int(out["state"].step) == 4
    g = out["goodput"]  # one restart: step 3 was computed, then lost
    assert g["attempts"] == 2 and g["steps_lost"] == 1 and abs(g["accounted"] - 1) <= 0.02


def _sharded_state(mesh_shape=(4, 2)):
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(mesh_shape), ("fsdp", "tp"))
    P, NS = jax.sharding.PartitionSpec, jax.sharding.NamedSharding
    rng = np.random.default_rng(0)
    return {"step": jax.device_put(np.int32(7), NS(mesh, P())),
            "w": jax.device_put(rng.normal(size=(8, 8)).astype(np.float32), NS(mesh, P("fsdp", "tp"))),
            "b": jax.device_put(rng.normal(size=(8,)).astype(jax.numpy.bfloat16), NS(mesh, P("tp"))),
            "m": jax.device_put(rng.normal(size=(8, 4)).astype(np.float32), NS(mesh, P(None, "fsdp")))}


def test_save_and_restore_bit_exact_from_own_copy_or_replica(tmp_path):
    state = _sharded_state()
    local = LocalCheckpoints(str(tmp_path), 1, {"fsdp": 4, "tp": 2}, {})
    for step in (1, 2, 3):
        local.save(step, state)
    local.close()
    assert sorted(os.listdir(tmp_path / "rank0")) == ["replica_of_rank0", "step_2", "step_3"]  # the newest 2
    target = jax.tree.map(lambda x: jax.numpy.zeros_like(x), state)
    assert local.available(target) == [3, 2] and agree_step([3, 2]) == 3
    got, path = local.restore(3, target)
    _same(got, state)
    assert all(g.sharding == s.sharding for g, s in zip(jax.tree.leaves(got), jax.tree.leaves(state)))
    shutil.rmtree(tmp_path / "rank0" / "step_3")  # the own copy lost: the replica restores it
    got, path = local.restore(3, target)
    assert "replica_of_rank0" in path
    _same(got, state)
    # another layout (mesh 2 x 4) does not fit: nothing to restore from here
    other = LocalCheckpoints(str(tmp_path), 1, {"fsdp": 2, "tp": 4}, {})
    assert other.available(_sharded_state((2, 4))) == []
    other.close()
