"""The multi-node templates of docs/fault_tolerance.md: the SLURM requeue script (bash syntax, and its
requeue decision run with stand-ins for srun and scontrol) and the Kubernetes JobSet manifest (valid YAML
that restarts the group and passes the restart count on)."""
import os
import stat
import subprocess
from pathlib import Path

import pytest
import yaml

from jaxcolossal.runtime.faults import CONFIG_ERROR_EXIT_CODE, RESTART_COUNT_ENV

ROOT = Path(__file__).resolve().parents[2]
SBATCH = ROOT / "scripts" / "slurm" / "train_requeue.sbatch"
JOBSET = ROOT / "examples" / "kubernetes" / "jobset.yaml"


def test_the_sbatch_template_is_bash_and_requeues():
    subprocess.run(["bash", "-n", str(SBATCH)], check=True)
    text = SBATCH.read_text()
    for needed in ("#SBATCH --requeue", "#SBATCH --open-mode=append", "srun --kill-on-bad-exit=1",
                   "training.resume=auto", "SLURM_RESTART_COUNT", 'scontrol requeue "$SLURM_JOB_ID"',
                   "RANK=$SLURM_PROCID LOCAL_RANK=$SLURM_LOCALID WORLD_SIZE=$SLURM_NTASKS"):
        assert needed in text, needed


def _fake(bin_dir: Path, name: str, body: str) -> None:
    path = bin_dir / name
    path.write_text("#!/bin/bash\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


@pytest.mark.parametrize("status, restarts, requeued", [(1, 0, True), (137, 2, True), (1, 3, False),
                                                         (CONFIG_ERROR_EXIT_CODE, 0, False), (0, 0, False)])
def test_the_sbatch_template_requeues_a_failed_step_up_to_max_restarts(tmp_path, status, restarts, requeued):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _fake(bin_dir, "srun", f'echo "srun $*" >> "{tmp_path}/calls"; exit {status}\n')
    _fake(bin_dir, "scontrol", f'[ "$1" = show ] && echo node1 && exit 0; echo "scontrol $*" >> "{tmp_path}/calls"\n')
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "node[1-2]",
           "SLURM_RESTART_COUNT": str(restarts), "MAX_RESTARTS": "3", "CKPT": str(tmp_path / "ckpt")}
    res = subprocess.run(["bash", str(SBATCH), "training.max_steps=10"], env=env, capture_output=True, text=True,
                         timeout=30)
    assert res.returncode == status, res.stdout + res.stderr
    calls = (tmp_path / "calls").read_text()
    assert "srun --kill-on-bad-exit=1 bash -c" in calls and "training.max_steps=10" in calls
    assert ("scontrol requeue 4242" in calls) == requeued, calls
    if status not in (0, CONFIG_ERROR_EXIT_CODE) and not requeued:
        assert "giving up (MAX_RESTARTS=3)" in res.stdout


def test_the_jobset_manifest_restarts_the_group_and_passes_the_restart_count():
    docs = list(yaml.safe_load_all(JOBSET.read_text()))
    assert len(docs) == 1
    js = docs[0]
    assert (js["apiVersion"], js["kind"]) == ("jobset.x-k8s.io/v1alpha2", "JobSet")
    assert js["spec"]["failurePolicy"]["maxRestarts"] >= 1
    job = js["spec"]["replicatedJobs"][0]["template"]["spec"]
    assert job["completionMode"] == "Indexed" and job["backoffLimit"] == 0
    assert job["podFailurePolicy"]["rules"][0]["onExitCodes"]["values"] == [CONFIG_ERROR_EXIT_CODE]
    pod = job["template"]["spec"]
    assert pod["restartPolicy"] == "Never"
    (container,) = pod["containers"]
    env = {e["name"]: e for e in container["env"]}
    assert env[RESTART_COUNT_ENV]["valueFrom"]["fieldRef"]["fieldPath"] == \
        "metadata.annotations['jobset.sigs.k8s.io/restart-attempt']"
    assert {"MASTER_ADDR", "MASTER_PORT", "JOB_COMPLETION_INDEX"} <= set(env)
    name, rjob = js["metadata"]["name"], js["spec"]["replicatedJobs"][0]["name"]
    assert env["MASTER_ADDR"]["value"] == f"{name}-{rjob}-0-0.{name}"  # node 0 through the headless service
    cmd = " ".join(container["args"])
    for needed in ("python -m jaxcolossal.run", '--node-rank "$JOB_COMPLETION_INDEX"', "scripts/train.py",
                   "training.resume=auto", "checkpoint.dir="):
        assert needed in cmd, needed
