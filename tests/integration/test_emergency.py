"""Emergency (local) checkpoints in one process: bit-exact restore, preferred over an older
persistent step, a lost folder restored from the peer replica, a different layout ignored."""
import json
import os
import shutil

import jax
import numpy as np
from tiny import SMALL_MAIN_JOB

from jaxcolossal.config import load_config
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


def test_local_checkpoint_restores_bit_exact_and_is_preferred(tmp_path):
    full = train(_cfg(tmp_path, "a", "training.max_steps=5", "checkpoint.local_every=2"))
    # 3 steps, local steps 2 (the final step 3 is persistent only); then the persistent folder is lost
    train(_cfg(tmp_path, "b", "training.max_steps=3", "checkpoint.local_every=2"))
    local = tmp_path / "b" / "local"
    assert sorted(os.listdir(local / "rank0")) == ["replica_of_rank0", "step_2"]
    shutil.rmtree(tmp_path / "b" / "ckpt")
    resumed = train(_cfg(tmp_path, "b", "training.max_steps=5", "checkpoint.local_every=2", "training.resume=auto"))
    _same(resumed["state"], full["state"])
    assert resumed["goodput"]["restarts"] == [] and resumed["goodput"]["attempts"] == 1
    text = open(tmp_path / "b" / "run" / "train.log").read()
    assert "resumed from step 2 of the emergency (local) checkpoints" in text


def test_lost_local_folder_comes_back_from_the_replica(tmp_path):
    train(_cfg(tmp_path, "b", "training.max_steps=3", "checkpoint.local_every=1"))
    local = tmp_path / "b" / "local"
    shutil.rmtree(local / "rank0" / "step_2")  # the own copy is gone; the replica (rank (0+1)%1 = 0's) stays
    shutil.rmtree(tmp_path / "b" / "ckpt")
    out = train(_cfg(tmp_path, "b", "training.max_steps=4", "checkpoint.local_every=1", "training.resume=true"))
    text = open(tmp_path / "b" / "run" / "train.log").read()
    assert "resumed from step 2 of the emergency (local) checkpoints" in text and "replica_of_rank0" in text
    assert int(out["state"].step) == 4
    meta = json.load(open(local / "rank0" / "replica_of_rank0" / "step_3" / "meta.json"))
    assert meta["process_count"] == 1 and meta["step"] == 3
