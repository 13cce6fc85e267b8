"""The multi-node templates of docs/fault_tolerance.md: the SLURM requeue script (bash syntax, and its
requeue decision run with stand-ins for srun and scontrol) and the Kubernetes JobSet manifest (valid YAML
that restarts the group and passes the restart count on, ends the set on a config error, mounts a
memory-backed /dev/shm and names the image the repository's Dockerfile builds)."""
import os
import re
import stat
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml

from jaxcolossal.runtime.faults import CONFIG_ERROR_EXIT_CODE, RESTART_COUNT_ENV

ROOT = Path(__file__).resolve().parents[2]
SBATCH = ROOT / "scripts" / "slurm" / "train_requeue.sbatch"
JOBSET = ROOT / "examples" / "kubernetes" / "jobset.yaml"
DOCKERFILE = ROOT / "Dockerfile"


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


def _jobset():
    (js,) = yaml.safe_load_all(JOBSET.read_text())
    job = js["spec"]["replicatedJobs"][0]["template"]["spec"]
    return js, job, job["template"]["spec"]


def test_the_jobset_ends_on_a_config_error_instead_of_restarting_it():
    # issue 54 item 17: the Job's podFailurePolicy fails the Job on status 2, but JobSet's default for a
    # failed Job is RestartJobSet: without a FailJobSet rule the config error was restarted maxRestarts times
    js, job, _ = _jobset()
    (fail_job,) = [r for r in job["podFailurePolicy"]["rules"] if r["action"] == "FailJob"]
    assert fail_job["onExitCodes"] == {"containerName": "trainer", "operator": "In",
                                       "values": [CONFIG_ERROR_EXIT_CODE]}
    rules = js["spec"]["failurePolicy"]["rules"]
    assert rules[0]["action"] == "FailJobSet" and rules[0]["onJobFailureReasons"] == ["PodFailurePolicy"]
    assert re.fullmatch(r"[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?", rules[0]["name"])  # JobSet's rule-name pattern
    assert not rules[0].get("targetReplicatedJobs")  # every replicated job
    # every other failure (backoffLimit 0: one failed pod) still restarts the group: no rule catches all reasons
    assert all(r.get("onJobFailureReasons") for r in rules)


def test_the_jobset_mounts_a_memory_backed_dev_shm_for_nccls_processes():
    _, _, pod = _jobset()
    (container,) = pod["containers"]
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == "/dev/shm"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    assert volume["emptyDir"]["medium"] == "Memory"
    assert re.fullmatch(r"\d+Gi", volume["emptyDir"]["sizeLimit"]) and int(volume["emptyDir"]["sizeLimit"][:-2]) >= 8
    assert "--nproc 8" in " ".join(container["args"]) and container["resources"]["limits"]["nvidia.com/gpu"] == 8


def test_the_jobset_image_is_the_one_the_repositorys_dockerfile_builds():
    _, _, pod = _jobset()
    (container,) = pod["containers"]
    text, docker = JOBSET.read_text(), DOCKERFILE.read_text()
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert container["image"].endswith(f"/jaxcolossal:{version}") and "example/" not in container["image"]
    assert f"docker build -t <your registry>/jaxcolossal:{version} ." in text  # the manifest says how to build it
    # the image holds the repository where the pod runs it, jax's CUDA wheels and the project installed
    assert re.search(r"^WORKDIR " + re.escape(container["workingDir"]) + "$", docker, re.M)
    assert re.search(r"^FROM ", docker, re.M) and 'jax[cuda12]' in docker and "pip install" in docker
    assert re.search(r"^COPY \. \.$", docker, re.M) and (ROOT / ".dockerignore").exists()
    for path in ("scripts/train.py", "configs/bench/llama2_7b.yaml"):  # what the pod's command runs
        assert (ROOT / path).exists() and path in " ".join(container["args"])
    assert "Dockerfile" in (ROOT / "docs" / "fault_tolerance.md").read_text()
