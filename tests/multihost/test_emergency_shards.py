"""Issue 54 item 2 with real processes over gloo and ``kill -9``: a damaged emergency checkpoint is
never restored. Rank 1 of a 2-process job kills itself with SIGKILL after step 9 of 10 (emergency
steps every 2, so steps 6 and 8 are in each process's folder and its replica; persistent every 5).
Copies of that job's folders are then damaged, one way per case, and restarted; each restart must
read the copy the case names (the peer replica, an older step or the persistent checkpoint), say so
in one line per process, and end with the uninterrupted run's params bit for bit.
"""
import os
import shutil
from pathlib import Path

import pytest
from mh import REPO, TINY, TRAIN, clean_env, launcher, run
from test_restarts import FAST_CPU, assert_bit_identical, final_params

WRAPPER = str(REPO / "tests" / "multihost" / "fault_wrapper.py")
MAX_STEPS, KILL_AFTER = 10, 9
COMMON = [*TINY, f"training.max_steps={MAX_STEPS}", "checkpoint.save_every=5", "checkpoint.local_every=2",
          "training.resume=auto", "parallel.zero_stage=2"]

CASES = {
    # case: ([(step folder under local/, damage)], step restored, {rank: the step folder it reads}); None: persistent
    "corrupted_size_kept": ([("rank1/step_8", "flip")], 8, {0: "rank0/step_8", 1: "rank0/replica_of_rank1/step_8"}),
    "truncated": ([("rank0/step_8", "truncate")], 8, {0: "rank1/replica_of_rank0/step_8", 1: "rank1/step_8"}),
    "missing": ([("rank1/step_8", "remove")], 8, {0: "rank0/step_8", 1: "rank0/replica_of_rank1/step_8"}),
    "both_copies_bad_older_step": ([("rank1/step_8", "flip"), ("rank0/replica_of_rank1/step_8", "flip")], 6,
                                   {0: "rank0/step_6", 1: "rank1/step_6"}),
    "every_copy_bad_persistent": ([(f, "flip") for f in ("rank1/step_6", "rank1/step_8", "rank0/replica_of_rank1/step_6",
                                                        "rank0/replica_of_rank1/step_8")], 5, None),
}
WARNING = {"flip": "fails its checksum", "truncate": "is truncated", "remove": "lacks shards.bin"}


def _args(where: Path) -> list[str]:
    return [*COMMON, f"checkpoint.dir={where / 'ckpt'}", f"checkpoint.local_dir={where / 'local'}",
            f"logging.run_dir={where / 'run'}"]


def _damage(path: Path, how: str) -> None:
    """``flip``: one byte in the middle changed, the size kept; ``truncate``: cut to half; ``remove``."""
    size = path.stat().st_size
    if how == "remove":
        path.unlink()
    elif how == "truncate":
        os.truncate(path, size // 2)
    else:
        with open(path, "r+b") as f:
            f.seek(size // 2)
            byte = f.read(1)[0]
            f.seek(size // 2)
            f.write(bytes([byte ^ 0xFF]))
        assert path.stat().st_size == size


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """``(folder, params)``: the folder of a job whose rank 1 was killed by SIGKILL after step 9, and the
    final params of the same job uninterrupted."""
    from jaxcolossal.checkpoint import step_dirs  # heavy: JAX in this process only for the checks

    base = tmp_path_factory.mktemp("emergency_shards")
    ref = run(launcher(2, TRAIN, *_args(base / "ref"), timeout_s=60, log_dir=base / "ref_logs"),
              clean_env(XLA_FLAGS=FAST_CPU), timeout=300)
    assert ref.returncode == 0, ref.describe()
    first = run(launcher(2, WRAPPER, *_args(base / "killed"), timeout_s=60, log_dir=base / "killed_logs"),
                clean_env(XLA_FLAGS=FAST_CPU, JAXCOLOSSAL_TEST_KILL9=f"1:{KILL_AFTER}"), timeout=300)
    assert first.returncode != 0 and "killed by signal 9" in first.stderr, first.describe()
    local = base / "killed" / "local"
    for r in range(2):
        assert sorted(os.listdir(local / f"rank{r}")) == [f"replica_of_rank{1 - r}", "step_6", "step_8"]
        assert sorted(os.listdir(local / f"rank{r}" / f"replica_of_rank{1 - r}")) == ["step_6", "step_8"]
    assert 5 in step_dirs(str(base / "killed" / "ckpt")) and max(step_dirs(str(base / "killed" / "ckpt"))) < 6
    return base / "killed", final_params(base / "ref" / "ckpt", MAX_STEPS)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("case", list(CASES))
def test_a_damaged_emergency_shard_is_passed_over_and_the_run_ends_bit_exact(killed, tmp_path, case):
    folder, want = killed
    job = tmp_path / "job"
    shutil.copytree(folder, job, symlinks=True)
    damage, step, reads = CASES[case]
    for where, how in damage:
        _damage(job / "local" / where / "shards.bin", how)
    res = run(launcher(2, TRAIN, *_args(job), timeout_s=60, log_dir=tmp_path / "logs"),
              clean_env(XLA_FLAGS=FAST_CPU, JAXCOLOSSAL_RESTART_COUNT="1"), timeout=300)
    assert res.returncode == 0, res.describe()
    logs = [(tmp_path / "logs" / f"rank{r}.log").read_text() for r in range(2)]
    if reads is None:
        assert f"resumed from step {step} in {job / 'ckpt'} (persistent; no newer emergency step is whole" in logs[0]
    else:
        assert f"resumed from step {step} of the emergency (local) checkpoints" in logs[0], logs[0][-3000:]
        for r in range(2):  # one line per process naming the copy it restored
            said = f"process {r}: restored emergency step {step} from {job / 'local' / reads[r]} ("
            assert logs[r].count(said) == 1, logs[r][-3000:]
    for where, how in damage:  # the process that met the damaged copy named it
        reader = int(where.split("_of_rank")[1][0]) if "replica_of_rank" in where else int(where[4])
        assert f"{job / 'local' / where} {WARNING[how]}" in logs[reader], logs[reader][-3000:]
    assert_bit_identical(want, final_params(job / "ckpt", MAX_STEPS))
