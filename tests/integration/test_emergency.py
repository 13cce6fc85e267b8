"""Emergency (local) checkpoints in one process: bit-exact restore, preferred over an older
persistent step, a lost folder restored from the peer replica, a different layout ignored; issue 54:
a damaged copy (its bytes changed with its size kept, truncated, missing) passed over for the replica,
then the next older step, then none (the persistent checkpoint); the files and folders fsync'ed
before the rename; an unwritable ``checkpoint.local_dir`` refused at preflight, and a write failing
during the run logged while the final persistent checkpoint is still written."""
import errno
import json
import logging
import os
import shutil

import jax
import numpy as np
import pytest
from tiny import SMALL_MAIN_JOB

from jaxcolossal import checkpoint
from jaxcolossal.config import load_config
from jaxcolossal.errors import ConfigError
from jaxcolossal.runtime import goodput
from jaxcolossal.runtime.dist_logger import get_dist_logger
from jaxcolossal.train import emergency
from jaxcolossal.train.emergency import CHECKSUM, LocalCheckpoints, agree_step
from jaxcolossal.train.loop import preflight, train

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
    # issue 54 item 12: what is on and where it goes, said at start; each save; the resume line's persistent step
    assert f"(no persistent step in {tmp_path / 'b' / 'ckpt'}; process 0 read" in text, text[-3000:]
    assert f"emergency checkpoints on: every 2 steps in {local} (checkpoint.local_every)" in text
    assert "hang watchdog on: a process with no finished step for max(180 s, 10 x the median step time)" in text
    assert f"run folder {tmp_path / 'b' / 'run'}: metrics in {tmp_path / 'b' / 'run' / 'metrics.jsonl'}" in text
    assert f"checkpoint of step 5: saving to {tmp_path / 'b' / 'ckpt' / '5'}" in text


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


# ------------------------------------------------------------------ issue 54: damaged copies, fsync, failures


@pytest.fixture
def logged():
    """The messages our logger emits during the test (its handlers do not propagate to caplog)."""
    lines = []

    class Keep(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())
    handler = Keep()
    get_dist_logger().logger.addHandler(handler)
    yield lines
    get_dist_logger().logger.removeHandler(handler)


def _state_at(step):
    """The sharded test state, its values shifted by ``step``: each step's copy is told apart."""
    return jax.tree.map(lambda x: x + step if x.ndim else jax.numpy.asarray(step, x.dtype), _sharded_state())


def _saved(tmp_path, steps=(1, 2, 3)):
    local = LocalCheckpoints(str(tmp_path), 1, {"fsdp": 4, "tp": 2}, {})
    for step in steps:
        local.save(step, _state_at(step))
    local.wait()
    return local, jax.tree.map(lambda x: jax.numpy.zeros_like(x), _sharded_state())


def _corrupt(path):
    """Change bytes in the middle of the file ``path``; its size is kept."""
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.seek(size // 2)
        byte = f.read(1)
        f.seek(size // 2)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert os.path.getsize(path) == size


def test_corrupted_own_copy_with_its_size_kept_is_restored_from_the_replica(tmp_path, logged):
    # issue 54 item 2: such a copy was restored silently (only the size was checked)
    local, target = _saved(tmp_path)
    _corrupt(tmp_path / "rank0" / "step_3" / "shards.bin")
    got, path = local.restore(3, target)
    assert path == str(tmp_path / "rank0" / "replica_of_rank0" / "step_3")
    _same(got, _state_at(3))
    meta = json.load(open(tmp_path / "rank0" / "step_3" / "meta.json"))  # the checksum beside the shards
    assert meta["checksum"][0] == CHECKSUM and len(meta["checksum"][1]) == 16
    assert any(f"its own copy {tmp_path}/rank0/step_3 fails its checksum" in m and "trying its replica" in m
               for m in logged), logged
    local.close()


def test_damaged_copies_fall_back_to_the_replica_then_an_older_step_then_none(tmp_path, logged):
    local, target = _saved(tmp_path)
    own, replica = tmp_path / "rank0", tmp_path / "rank0" / "replica_of_rank0"
    os.truncate(own / "step_3" / "shards.bin", 100)  # truncated: the replica of the same step
    state, copy = local.restore_newest(target)
    assert (copy.step, copy.path, copy.which) == (3, str(replica / "step_3"), "its replica in process 0's folder")
    _same(state, _state_at(3))
    said = f"process 0: restored emergency step 3 from {replica / 'step_3'} (its replica in process 0's folder)"
    assert any(m.endswith(said) for m in logged), logged
    _corrupt(replica / "step_3" / "shards.bin")  # both copies of step 3 damaged: the next older step
    state, copy = local.restore_newest(target)
    assert (copy.step, copy.path, copy.which) == (2, str(own / "step_2"), "its own copy")
    _same(state, _state_at(2))
    assert any("emergency step 3 is not whole on every process" in m for m in logged)
    assert local.restore_newest(target, newer_than=2) is None  # not newer than the persistent step
    (own / "step_2" / "shards.bin").unlink()  # missing: the replica
    assert local.restore_newest(target)[1].path == str(replica / "step_2")
    _corrupt(replica / "step_2" / "shards.bin")
    assert local.restore_newest(target) is None  # nothing whole: the caller restores the persistent one
    assert any("lacks shards.bin" in m for m in logged) and any("is truncated" in m for m in logged)
    local.close()


def test_write_fsyncs_the_files_and_the_folder_before_the_rename_then_the_parent(tmp_path, monkeypatch):
    events = []
    fsync, replace = os.fsync, os.replace

    def recording_fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        fsync(fd)

    def recording_replace(a, b):
        events.append(("rename", str(a), str(b)))
        replace(a, b)
    monkeypatch.setattr(os, "fsync", recording_fsync)
    monkeypatch.setattr(os, "replace", recording_replace)
    local, _ = _saved(tmp_path, steps=(1,))
    local.close()
    for folder in (tmp_path / "rank0", tmp_path / "rank0" / "replica_of_rank0"):
        tmp = f"{folder}/.tmp-step_1-{os.getpid()}"
        want = [("fsync", f"{tmp}/shards.bin"), ("fsync", f"{tmp}/meta.json"), ("fsync", tmp),
                ("rename", tmp, f"{folder}/step_1"), ("fsync", str(folder))]
        at = events.index(want[0])
        assert events[at:at + 5] == want, events


def test_a_copy_that_cannot_be_written_is_logged_and_not_raised(tmp_path, logged):
    (tmp_path / "afile").write_text("")
    local = LocalCheckpoints(str(tmp_path / "afile" / "local"), 1, {"fsdp": 4, "tp": 2}, {})
    local.save(1, _sharded_state())
    local.save(2, _sharded_state())  # waits for the first write: nothing raised
    local.close()
    assert len(local.failures) == 4  # own and replica, two steps
    warned = [m for m in logged if "not written" in m or "could not be written" in m]
    assert len(warned) == 2 and "checkpoint.local_dir=" in warned[0] and "Training goes on" in warned[0], warned
    assert "4 emergency checkpoint copies could not be written" in warned[1]


@pytest.mark.parametrize("where", ["file", "proc"])
def test_a_local_dir_that_cannot_be_created_is_refused_at_preflight(tmp_path, where):
    # issue 54 item 3: found only after training, as "data error: [Errno 2] ..." naming no key
    (tmp_path / "afile").write_text("")
    bad = str(tmp_path / "afile" / "local") if where == "file" else "/proc/jaxcolossal-nope/local"
    if where == "proc" and not os.path.isdir("/proc/self"):
        pytest.skip("no /proc here")
    cfg = _cfg(tmp_path, "a", "checkpoint.local_every=2", f"checkpoint.local_dir={bad}")
    with pytest.raises(ConfigError) as e:
        preflight(cfg)
    message = str(e.value)
    assert message.startswith(f"checkpoint.local_dir={bad!r}: cannot create it") and "\n" not in message
    example = message.rsplit("checkpoint.local_dir=", 1)[1]
    assert example == emergency.default_local_dir(str(tmp_path / "a" / "ckpt"))  # a value that works
    preflight(_cfg(tmp_path, "a", "checkpoint.local_every=2", f"checkpoint.local_dir={example}"))


def test_emergency_writes_failing_mid_run_keep_the_final_persistent_checkpoint(tmp_path, monkeypatch):
    # issue 54 item 3: the error of a failed emergency write ended the run before its final save
    def full_disk(path, host):
        raise OSError(errno.ENOSPC, "No space left on device", path)
    monkeypatch.setattr(emergency, "_write_shards", full_disk)
    out = train(_cfg(tmp_path, "a", "training.max_steps=3", "checkpoint.local_every=1"))
    assert int(out["state"].step) == 3 and checkpoint.step_dirs(str(tmp_path / "a" / "ckpt")) == [3]
    text = open(tmp_path / "a" / "run" / "train.log").read()
    assert "emergency checkpoint of step 1 not written" in text and "No space left on device" in text
    assert "checkpoint.local_dir=" in text and "4 emergency checkpoint copies could not be written" in text
