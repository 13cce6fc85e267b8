"""``python -m jaxcolossal.run``: environments, output, and stopping every process when one fails.

The programs here do not import JAX, so these tests take seconds. The real training job under
the launcher is in test_train_multiprocess.py, the JAX failure cases in test_failures.py.
"""
import io
import os
import signal
import subprocess
import textwrap
import time

import pytest
from mh import clean_env, launcher, run, tagged_json

from jaxcolossal.runtime import processes
from jaxcolossal.runtime import run as R

ENV_DUMP = textwrap.dedent("""
    import json, os, sys
    keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "MASTER_ADDR",
            "MASTER_PORT", "XLA_FLAGS", "JAX_PLATFORMS", "JAXCOLOSSAL_COLLECTIVE_TIMEOUT", "PYTHONUNBUFFERED"]
    # one write per line: with PYTHONUNBUFFERED=1, print() writes the newline separately and
    # the stderr line could land in the middle of it in the shared log file
    sys.stdout.write("ENV " + json.dumps({k: os.environ.get(k) for k in keys} | {"argv": sys.argv[1:]}) + "\\n")
    sys.stderr.write("to-stderr rank " + os.environ["RANK"] + "\\n")
""")


def _script(tmp_path, name, body):
    path = tmp_path / name
    path.write_text(body)
    return str(path)


@pytest.mark.timeout(60)
def test_launcher_environment_and_logs(tmp_path):
    prog = _script(tmp_path, "env_dump.py", ENV_DUMP)
    logs = tmp_path / "logs"
    env = clean_env(XLA_FLAGS="--xla_dump_to=/nowhere --xla_force_host_platform_device_count=8")
    res = run(launcher(4, prog, "a", "--flag", "b=c", timeout_s=42, log_dir=logs, extra=("--platform", "cpu")),
              env, timeout=40)
    assert res.returncode == 0, res.describe()

    # Rank 0 is streamed to the launcher's stdout/stderr; every rank has its own log file.
    streamed = tagged_json(res.stdout, "ENV ")
    assert [e["RANK"] for e in streamed] == ["0"]
    assert "to-stderr rank 0" in res.stderr and "to-stderr rank 1" not in res.stderr
    per_rank = {}
    for r in range(4):
        text = (logs / f"rank{r}.log").read_text()
        assert f"to-stderr rank {r}" in text
        per_rank[r] = tagged_json(text, "ENV ")[0]

    ports = {e["MASTER_PORT"] for e in per_rank.values()}
    assert len(ports) == 1 and 0 < int(ports.pop()) < 65536
    for r, e in per_rank.items():
        assert (e["RANK"], e["LOCAL_RANK"], e["WORLD_SIZE"], e["LOCAL_WORLD_SIZE"], e["NODE_RANK"]) == \
            (str(r), str(r), "4", "4", "0")
        assert e["MASTER_ADDR"] == "127.0.0.1"
        assert e["JAX_PLATFORMS"] == "cpu"
        # 8 / nproc devices each; the other XLA flags are kept
        assert e["XLA_FLAGS"] == "--xla_dump_to=/nowhere --xla_force_host_platform_device_count=2"
        assert e["JAXCOLOSSAL_COLLECTIVE_TIMEOUT"] == "42"
        assert e["PYTHONUNBUFFERED"] == "1"
        assert e["argv"] == ["a", "--flag", "b=c"]
    assert f"logs in {logs}" in res.stderr


@pytest.mark.timeout(60)
def test_launcher_stops_everyone_when_one_process_dies(tmp_path):
    # Rank 1 fails at once; rank 0 would sleep for 10 minutes and even ignores SIGTERM, so the
    # launcher must SIGKILL it after --kill-grace (1 s).
    prog = _script(tmp_path, "die.py", textwrap.dedent("""
        import os, signal, sys, time
        if os.environ["RANK"] == "1":
            print("rank 1 giving up", flush=True)
            sys.exit(7)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print("rank 0 working", flush=True)
        time.sleep(600)
    """))
    res = run(launcher(2, prog, timeout_s=300, log_dir=tmp_path / "logs",
                       extra=("--platform", "cpu", "--kill-grace", "1")), clean_env(), timeout=45)
    assert res.returncode == 7, res.describe()
    assert res.seconds < 20, res.describe()
    assert "rank 1 exited with status 7" in res.stderr
    assert "rank 1 giving up" in res.stderr  # the end of the failing rank's log is shown


@pytest.mark.timeout(60)
def test_launcher_bounds_the_wait_after_a_clean_exit(tmp_path):
    # Rank 1 ends with 0 while rank 0 never ends (as a process stuck in a collective would):
    # after --timeout (1 s) + --kill-grace (1 s) the launcher stops it and reports failure.
    prog = _script(tmp_path, "leave.py", textwrap.dedent("""
        import os, time
        if os.environ["RANK"] != "1":
            time.sleep(600)
    """))
    res = run(launcher(2, prog, timeout_s=1, extra=("--platform", "cpu", "--kill-grace", "1")), clean_env(),
              timeout=45)
    assert res.returncode == 1, res.describe()
    assert res.seconds < 20, res.describe()
    assert "rank(s) 0 still running" in res.stderr


@pytest.mark.timeout(60)
def test_launcher_two_nodes_on_one_machine(tmp_path):
    # torchrun-style --nnodes/--node-rank: two launchers, 2 processes each, one coordinator port.
    prog = _script(tmp_path, "env_dump.py", ENV_DUMP)
    port = R.free_port()
    procs = []
    for node in range(2):
        cmd = launcher(2, prog, log_dir=tmp_path / f"node{node}",
                       extra=("--platform", "cpu", "--nnodes", "2", "--node-rank", str(node),
                              "--master-port", str(port), "--devices-per-proc", "3"))
        procs.append(subprocess.Popen(cmd, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    for p in procs:
        p.communicate(timeout=40)
        assert p.returncode == 0
    seen = {}
    for node in range(2):
        for rank in (2 * node, 2 * node + 1):
            text = (tmp_path / f"node{node}" / f"rank{rank}.log").read_text()
            e = tagged_json(text, "ENV ")[0]
            seen[rank] = (e["LOCAL_RANK"], e["NODE_RANK"], e["WORLD_SIZE"], e["MASTER_PORT"], e["XLA_FLAGS"])
    flags = "--xla_force_host_platform_device_count=3"
    assert seen == {0: ("0", "0", "4", str(port), flags), 1: ("1", "0", "4", str(port), flags),
                    2: ("0", "1", "4", str(port), flags), 3: ("1", "1", "4", str(port), flags)}


def test_build_env_is_pure_and_gpu_leaves_devices_alone():
    base = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8 --xla_foo", "KEEP": "1"}
    cpu = R.build_env(base, rank=3, local_rank=1, world_size=4, local_world_size=2, node_rank=1,
                      master_port=1234, platform="cpu", devices_per_proc=2)
    assert base["XLA_FLAGS"] == "--xla_force_host_platform_device_count=8 --xla_foo"
    assert cpu["XLA_FLAGS"] == "--xla_foo --xla_force_host_platform_device_count=2"
    assert (cpu["RANK"], cpu["LOCAL_RANK"], cpu["WORLD_SIZE"], cpu["KEEP"]) == ("3", "1", "4", "1")
    assert "JAXCOLOSSAL_COLLECTIVE_TIMEOUT" not in cpu
    gpu = R.build_env(base, rank=0, local_rank=0, world_size=8, local_world_size=8, master_port=1,
                      platform="gpu", timeout=120)
    assert gpu["XLA_FLAGS"] == base["XLA_FLAGS"] and "JAX_PLATFORMS" not in gpu
    assert gpu["JAXCOLOSSAL_COLLECTIVE_TIMEOUT"] == "120"
    with pytest.raises(ValueError, match="devices_per_proc must be >= 1"):
        R.build_env(base, rank=0, local_rank=0, world_size=1, local_world_size=1, master_port=1,
                    platform="cpu", devices_per_proc=0)


@pytest.mark.parametrize("argv, message", [
    (["--nproc", "3", "x.py"], "--nproc 3 does not divide 8 devices; give --devices-per-proc (e.g. --nproc 3 "
                               "--devices-per-proc 2), or --nproc one of [1, 2, 4, 8]"),
    (["--nproc", "0", "x.py"], "--nproc must be >= 1"),
    (["--nproc", "2", "--nnodes", "2", "x.py"], "--master-port is required with --nnodes > 1"),
    (["--nproc", "2", "--timeout", "0", "x.py"], "--timeout must be >= 1 second"),
    (["--nproc", "2", "--platform", "gpu", "--devices-per-proc", "2", "x.py"], "applies to --platform cpu only"),
])
def test_launcher_argument_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        R.main(["--platform", "cpu", *argv] if "--platform" not in argv else argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert message in err
    # issue 45 item 15d: the error alone, one line, without argparse's usage before it
    assert err.splitlines() == [err.strip()] and err.startswith("jaxcolossal.run: error: "), err


@pytest.mark.timeout(60)
def test_ctrl_c_to_the_launcher_stops_every_process(tmp_path):
    prog = _script(tmp_path, "sleep.py", textwrap.dedent("""
        import os, time
        open(os.path.join(os.environ["OUT"], "pid" + os.environ["RANK"]), "w").write(str(os.getpid()))
        time.sleep(600)
    """))
    p = subprocess.Popen(launcher(2, prog, extra=("--platform", "cpu", "--kill-grace", "1")),
                         env=clean_env(OUT=str(tmp_path)), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while not all((tmp_path / f"pid{r}").exists() for r in range(2)) and time.monotonic() < deadline:
            time.sleep(0.1)
        pids = [int((tmp_path / f"pid{r}").read_text()) for r in range(2)]
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=20)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 128 + signal.SIGINT, err
    assert "received signal 2; stopping 2 process(es)" in err
    for pid in pids:  # reaped by the launcher: gone
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


class _Chunks:
    """A pipe that hands out the given chunks, one per read (as a process writes them)."""

    def __init__(self, chunks):
        self.chunks = list(chunks)

    def read1(self, n):
        return self.chunks.pop(0) if self.chunks else b""

    def close(self):
        pass


def test_terminal_gets_whole_lines_without_gloos_connection_lines():
    gloo = b"[Gloo] Rank 1 is connected to 3 peer ranks. Expected number of connected peer ranks is : 3\n"
    chunks = [b"step 1: lo", gloo, b"ss 5.2\n", b"train:  50%\r", b"train: 100%\r", gloo + b"done"]
    log, term = io.BytesIO(), io.BytesIO()
    processes._pump(_Chunks(chunks), [log], term)
    assert log.getvalue() == b"".join(chunks)  # the log keeps everything, as it came
    shown = term.getvalue()
    assert b"Gloo" not in shown
    assert shown == b"step 1: loss 5.2\ntrain:  50%\rtrain: 100%\rdone"  # the line split by Gloo's is whole
