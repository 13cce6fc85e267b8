"""The main job across 2 real processes x 4 CPU devices against 1 process x 8 devices.

* launcher: ``python -m jaxcolossal.run --nproc 2 scripts/train.py ...`` builds one 8-device
  job (the per-process count of 4 wins over train.py's default of 8) and streams rank 0;
* equivalence: the same losses, to fp32 tolerance, for ZeRO-3 over 8 and for dp4 x tp2 (on
  this CPU they come out bit for bit equal);
* resume across layouts: a checkpoint saved by 2 x 4 continues in 1 x 8 with the losses of the
  uninterrupted 1 x 8 run;
* written once: metrics.jsonl and train.log by process 0 only, the checkpoint through orbax's
  coordinated multi-process save (each process its own shards, one set of metadata).

The five runs are shared by the tests (module fixtures); together they take about 1.5 minutes
on 2 CPU cores.
"""
import shutil
import sys

import numpy as np
import pytest
from mh import TINY, TRAIN, clean_env, launcher, read_metrics, run, train_losses

ZERO3 = ["parallel.zero_stage=3", "parallel.tensor_parallel_size=1"]
DP_TP = ["parallel.zero_stage=0", "parallel.tensor_parallel_size=2"]
RTOL = 2e-5  # fp32: the cross-process (gloo) reductions add in another order than in-process ones


def _single(run_dir, *args):
    res = run([sys.executable, TRAIN, "--devices", "8", *TINY, f"logging.run_dir={run_dir}", *args],
              clean_env(), timeout=150)
    assert res.returncode == 0, res.describe()
    return res


def _two_procs(run_dir, log_dir, *args):
    res = run(launcher(2, TRAIN, *TINY, f"logging.run_dir={run_dir}", *args, timeout_s=60, log_dir=log_dir,
                       extra=("--platform", "cpu")), clean_env(), timeout=200)
    assert res.returncode == 0, res.describe()
    return res


@pytest.fixture(scope="module")
def zero3(tmp_path_factory):
    """ZeRO-3: 1x8 and 2x4 for 7 steps (2x4 saves at 3, 6 and 7); 1x8 resumed from 2x4's step 3.

    Every run has the same max_steps: the learning-rate schedule depends on it. (max_steps is
    not a multiple of save_every: the loop's final save of a step saved already fails.)
    """
    root = tmp_path_factory.mktemp("zero3")
    out = {"root": root}
    out["single"] = _single(root / "single", *ZERO3, "training.max_steps=7")
    out["multi"] = _two_procs(root / "multi", root / "logs", *ZERO3, "training.max_steps=7",
                              f"checkpoint.dir={root / 'ckpt'}", "checkpoint.save_every=3")
    # resume in the other layout from step 3 (drop the later steps from a copy)
    shutil.copytree(root / "ckpt", root / "ckpt_at3")
    for later in ("6", "7"):
        shutil.rmtree(root / "ckpt_at3" / later)
    out["resumed"] = _single(root / "resumed", *ZERO3, "training.max_steps=7", "training.resume=true",
                             f"checkpoint.dir={root / 'ckpt_at3'}")
    return out


@pytest.fixture(scope="module")
def dp_tp(tmp_path_factory):
    root = tmp_path_factory.mktemp("dptp")
    return {"root": root, "single": _single(root / "single", *DP_TP, "training.max_steps=5"),
            "multi": _two_procs(root / "multi", root / "logs", *DP_TP, "training.max_steps=5")}


def _compare(a: dict[int, float], b: dict[int, float], steps) -> float:
    x = np.array([a[s] for s in steps])
    y = np.array([b[s] for s in steps])
    np.testing.assert_allclose(y, x, rtol=RTOL, atol=0)
    diff = float(np.max(np.abs(x - y)))
    print(f"steps {list(steps)}: max |loss difference| = {diff:.3g}")
    return diff


@pytest.mark.timeout(400)
def test_launcher_runs_the_main_job_as_one_8_device_job(zero3):
    res = zero3["multi"]
    assert "[jaxcolossal.run] starting 2 process(es) (ranks 0..1 of 2; 4 CPU device(s) each)" in res.stderr
    # rank 0 is streamed: its mesh line, parameter table and memory report
    assert "mesh {'pp': 1, 'dp': 1, 'fsdp': 8, 'ep': 1, 'sp': 1, 'tp': 1} on 8 cpu device(s), 2 process(es)" in res.stderr
    assert "per-device model state (ZeRO-3" in res.stdout
    rank1 = (zero3["root"] / "logs" / "rank1.log").read_text()
    assert "Traceback" not in rank1


@pytest.mark.timeout(400)
def test_zero3_two_processes_match_one_process(zero3):
    single = train_losses(read_metrics(zero3["root"] / "single"))
    multi = train_losses(read_metrics(zero3["root"] / "multi"))
    assert sorted(multi) == [1, 2, 3, 4, 5, 6, 7]
    assert single[7] < single[1] - 0.5  # the model is learning, so the comparison means something
    _compare(single, multi, range(1, 8))
    grad = {r["step"]: r["grad_norm"] for r in read_metrics(zero3["root"] / "multi") if "grad_norm" in r}
    grad1 = {r["step"]: r["grad_norm"] for r in read_metrics(zero3["root"] / "single") if "grad_norm" in r}
    np.testing.assert_allclose([grad[s] for s in range(1, 8)], [grad1[s] for s in range(1, 8)], rtol=1e-4)


@pytest.mark.timeout(400)
def test_dp_tp_two_processes_match_one_process(dp_tp):
    assert "mesh {'pp': 1, 'dp': 4, 'fsdp': 1, 'ep': 1, 'sp': 1, 'tp': 2} on 8 cpu device(s), 2 process(es)" in dp_tp["multi"].stderr
    single = train_losses(read_metrics(dp_tp["root"] / "single"))
    multi = train_losses(read_metrics(dp_tp["root"] / "multi"))
    assert sorted(multi) == [1, 2, 3, 4, 5]
    _compare(single, multi, range(1, 6))


@pytest.mark.timeout(400)
def test_checkpoint_from_two_processes_resumes_in_one(zero3):
    records = read_metrics(zero3["root"] / "resumed")
    assert records[0]["event"] == "run_start" and records[0]["resumed_from_step"] == 3
    assert records[1]["step"] == 3 and "val_loss" in records[1]  # started from the 2x4 checkpoint
    assert "resumed from step 3" in zero3["resumed"].stderr
    resumed = train_losses(records)
    assert sorted(resumed) == [4, 5, 6, 7]
    _compare(train_losses(read_metrics(zero3["root"] / "single")), resumed, range(4, 8))


@pytest.mark.timeout(400)
def test_logs_metrics_and_checkpoints_are_written_once(zero3):
    root = zero3["root"]
    records = read_metrics(root / "multi")
    # metrics.jsonl: the run's start, 7 train steps, 2 validations and the goodput summary, each once
    # (train_losses asserts no repeats)
    assert len(records) == 11 and records[0]["event"] == "run_start" and [r["step"] for r in records if "val_loss" in r] == [0, 7]
    assert records[-1]["event"] == "goodput" and abs(records[-1]["goodput_accounted"] - 1) <= 0.02
    # every process's step time at each logged step (issue 44's straggler check)
    assert all(len(r["rank_step_time_s"]) == 2 for r in records if "loss" in r)
    assert sorted(train_losses(records)) == [1, 2, 3, 4, 5, 6, 7]
    # train.log: written by process 0 only, each line once
    log = (root / "multi" / "train.log").read_text().splitlines()
    assert log and all("[rank 0]" in line for line in log)
    assert sum("validation loss at step 0" in line for line in log) == 1
    # rank 1 printed neither the parameter table nor the memory report
    rank1 = (root / "logs" / "rank1.log").read_text()
    assert "per-device model state" not in rank1 and "logical axes" not in rank1
    # checkpoint: the steps once each, complete, no temporary folders; one set of metadata and
    # one shard folder per process (orbax's coordinated write: each process writes its shards)
    ckpt = root / "ckpt"
    assert sorted(p.name for p in ckpt.iterdir()) == ["3", "6", "7"]
    for step in ("3", "6", "7"):
        d = ckpt / step
        assert (d / "_CHECKPOINT_METADATA").is_file() and (d / "commit_success.txt").is_file()
        assert not [p for p in d.rglob("*") if "tmp" in p.name]
        assert len(list(d.rglob("_METADATA"))) == 1
        assert sorted(p.name for p in (d / "state").glob("ocdbt.process_*")) == ["ocdbt.process_0",
                                                                                   "ocdbt.process_1"]
