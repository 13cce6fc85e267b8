"""Issue 44's pure functions: the restart count, ``--nproc MIN:MAX``, the shrink size, the exit causes,
and the config of a restarted run (resume, keep the global batch)."""
import re

import pytest

from jaxcolossal.config import ConfigError, config_from_dict, keep_global_batch, resume_on_restart
from jaxcolossal.runtime import faults as F
from jaxcolossal.runtime import run as R
from jaxcolossal.runtime.launch import coordinator_port


@pytest.mark.parametrize("env, want", [
    ({}, 0),
    ({"JAXCOLOSSAL_RESTART_COUNT": "2"}, 2),
    ({"TORCHELASTIC_RESTART_COUNT": "1"}, 1),
    ({"SLURM_RESTART_COUNT": "3"}, 3),
    ({"JAXCOLOSSAL_RESTART_COUNT": " ", "SLURM_RESTART_COUNT": "4"}, 4),  # empty counts as unset
    ({"JAXCOLOSSAL_RESTART_COUNT": "0", "TORCHELASTIC_RESTART_COUNT": "5"}, 0),  # ours first
])
def test_restart_count(env, want):
    assert F.restart_count(env) == want


@pytest.mark.parametrize("env, message", [
    ({"TORCHELASTIC_RESTART_COUNT": "x"}, "TORCHELASTIC_RESTART_COUNT must be a non-negative integer, got 'x'"),
    ({"SLURM_RESTART_COUNT": "-1"}, "SLURM_RESTART_COUNT must be a non-negative integer"),
])
def test_restart_count_refuses_non_numbers(env, message):
    with pytest.raises(ValueError, match=message):
        F.restart_count(env)


def test_planned_devices():
    assert F.planned_devices({}) is None and F.planned_devices({"JAXCOLOSSAL_PLANNED_DEVICES": ""}) is None
    assert F.planned_devices({"JAXCOLOSSAL_PLANNED_DEVICES": "8"}) == 8
    with pytest.raises(ValueError, match="JAXCOLOSSAL_PLANNED_DEVICES must be >= 1"):
        F.planned_devices({"JAXCOLOSSAL_PLANNED_DEVICES": "0"})


@pytest.mark.parametrize("text, want", [("4", (4, 4)), ("2:4", (2, 4)), (" 1:8 ", (1, 8)), ("3:3", (3, 3))])
def test_parse_nproc(text, want):
    assert F.parse_nproc(text) == want


@pytest.mark.parametrize("text, message", [
    ("x", "--nproc must be N or MIN:MAX (integers), got 'x'"),
    ("1:2:3", "--nproc must be N or MIN:MAX"),
    ("2:", "--nproc must be N or MIN:MAX"),
    ("0:4", "--nproc must be >= 1"),
    ("4:2", "--nproc MIN:MAX needs MIN <= MAX, got '4:2'"),
])
def test_parse_nproc_refuses(text, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        F.parse_nproc(text)


@pytest.mark.parametrize("low, high, healthy, want", [
    (2, 4, 4, 4), (2, 4, 3, 2), (2, 4, 2, 2), (2, 4, 1, None), (3, 4, 3, None),
    (1, 8, 7, 4), (1, 8, 3, 2), (1, 6, 5, 3), (1, 1, 0, None),
])
def test_shrink_size_is_the_largest_divisor_of_max_within_the_healthy_slots(low, high, healthy, want):
    assert F.shrink_size(low, high, healthy) == want


def test_describe_exit():
    assert F.describe_exit(-9) == "killed by SIGKILL"
    assert F.describe_exit(75) == "hung (exit 75)"
    assert F.describe_exit(124) == "made no progress (exit 124)"
    assert F.describe_exit(1) == "exited with status 1"


@pytest.mark.parametrize("argv, message", [
    (["--nproc", "4:2", "x.py"], "--nproc MIN:MAX needs MIN <= MAX, got '4:2'"),
    (["--nproc", "a:b", "x.py"], "--nproc must be N or MIN:MAX (integers), got 'a:b'"),
    (["--nproc", "2:4", "x.py"], "--nproc 2:4 shrinks the group at a restart: give --max-restarts >= 1"),
    (["--nproc", "2", "--max-restarts", "-1", "x.py"], "--max-restarts must be >= 0, got -1"),
    (["--nproc", "2", "--nnodes", "2", "--master-port", "29500", "--max-restarts", "1", "x.py"],
     "--max-restarts and --nproc MIN:MAX are for one machine (--nnodes 1)"),
    # issue 54 item 10: a negative or non-finite grace was accepted (and SIGKILL came at once)
    (["--nproc", "2", "--kill-grace", "-1", "x.py"],
     "--kill-grace must be a number of seconds >= 0 (e.g. --kill-grace 5), got -1"),
    (["--nproc", "2", "--kill-grace", "nan", "x.py"],
     "--kill-grace must be a number of seconds >= 0 (e.g. --kill-grace 5), got nan"),
])
def test_launcher_refuses_bad_restart_arguments_in_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        R.main(["--platform", "cpu", *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert message in err and err.splitlines() == [err.strip()] and err.startswith("jaxcolossal.run: error: ")


# ------------------------------------------------------------------ the config of a restarted run
def _cfg(**sections):
    return config_from_dict({"model": {"num_layers": 2, "hidden_size": 64, "intermediate_size": 128},
                             "training": {"batch_size": 16, "seq_len": 32}, **sections})


def test_resume_on_restart():
    cfg = _cfg(checkpoint={"dir": "/tmp/x"})
    assert resume_on_restart(cfg, 0) == (cfg, "")
    out, line = resume_on_restart(cfg, 2)
    assert out.training.resume == "auto" and cfg.training.resume is False  # a copy
    assert line == "restart 2: training.resume=false taken as auto (resuming from the newest checkpoint)"
    explicit = _cfg(checkpoint={"dir": "/tmp/x"}, training={"batch_size": 16, "resume": True})
    assert resume_on_restart(explicit, 1) == (explicit, "")
    nodir = _cfg()
    out, line = resume_on_restart(nodir, 1)
    assert out is nodir and "no checkpoint.dir, so the restarted run starts again from step 0" in line


def test_keep_global_batch_raises_the_accumulation_by_the_dp_factor():
    cfg = _cfg(parallel={"zero_stage": 2})
    assert keep_global_batch(cfg, 8, 8) == (cfg, "")
    out, line = keep_global_batch(cfg, 4, 8)
    assert out.training.gradient_accumulation_steps == 2 and out.training.batch_size == 16
    assert cfg.training.gradient_accumulation_steps == 1  # a copy
    assert line == ("the job was configured for 8 devices and runs on 4: data-parallel size 8 -> 4; "
                    "training.gradient_accumulation_steps 1 -> 2 keeps the global batch of 16 sequences")
    # tp stays: dp 4 -> 2 on 4 devices
    out, line = keep_global_batch(_cfg(parallel={"tensor_parallel_size": 2}, training={"batch_size": 16,
                                       "gradient_accumulation_steps": 2}), 4, 8)
    assert out.training.gradient_accumulation_steps == 4 and "data-parallel size 4 -> 2" in line


def test_keep_global_batch_with_micro_batch_size_keeps_micro_times_accumulation_times_dp():
    cfg = _cfg(training={"micro_batch_size": 2, "gradient_accumulation_steps": 1})
    out, line = keep_global_batch(cfg, 2, 8)
    assert out.training.gradient_accumulation_steps == 4 and "global batch of 16 sequences" in line


def test_keep_global_batch_when_the_accumulation_does_not_divide_the_batch():
    cfg = _cfg(training={"batch_size": 24, "seq_len": 32})  # dp 8: 3 per device; dp 2 needs 4 x 6 = 24 -> ok
    out, _ = keep_global_batch(cfg, 2, 8)
    assert out.training.gradient_accumulation_steps == 4
    odd = _cfg(training={"batch_size": 12, "seq_len": 32})  # dp 4 -> 3 per device... on 4 of 12? use 6 -> 2
    out, line = keep_global_batch(odd, 4, 12)  # dp 12 -> 4: accumulation 3; 12 % (3 x 4) == 0
    assert out.training.gradient_accumulation_steps == 3 and "1 -> 3" in line


def test_keep_global_batch_with_a_pipeline_scales_the_microbatches():
    cfg = _cfg(parallel={"pipeline_parallel_size": 2, "num_microbatches": 2}, training={"batch_size": 16})
    out, line = keep_global_batch(cfg, 4, 8)  # dp 4 -> 2
    assert out.parallel.num_microbatches == 4 and out.training.gradient_accumulation_steps == 1
    assert "parallel.num_microbatches 2 -> 4" in line


def test_keep_global_batch_scales_an_explicit_data_parallel_size():
    cfg = _cfg(parallel={"data_parallel_size": 4, "tensor_parallel_size": 2})
    out, _ = keep_global_batch(cfg, 4, 8)
    assert out.parallel.data_parallel_size == 2 and out.training.gradient_accumulation_steps == 2


def test_keep_global_batch_refuses_a_layout_not_valid_on_fewer_devices():
    cfg = _cfg(parallel={"tensor_parallel_size": 4}, model={"num_layers": 2, "hidden_size": 64,
                                                             "intermediate_size": 128, "num_attention_heads": 4,
                                                             "num_key_value_heads": 4})
    with pytest.raises(ConfigError, match=re.escape("the job was configured for 8 devices and runs on 2, and its "
                                                    "layout is not valid there: parallel.data_parallel_size=-1")):
        keep_global_batch(cfg, 2, 8)


# ------------------------------------------------------------------ the coordinator's port under torchrun
def test_coordinator_port_avoids_torchruns_agent_store():
    assert coordinator_port({"MASTER_PORT": "29500"}) == 29500
    assert coordinator_port({"MASTER_PORT": "29500", "TORCHELASTIC_USE_AGENT_STORE": "False"}) == 29500
    # the elastic agent's TCPStore listens on MASTER_PORT: jax's coordinator takes the next port
    assert coordinator_port({"MASTER_PORT": "29500", "TORCHELASTIC_USE_AGENT_STORE": "True"}) == 29501
    assert coordinator_port({"MASTER_PORT": "29500", "TORCHELASTIC_USE_AGENT_STORE": "True",
                             "JAXCOLOSSAL_COORDINATOR_PORT": "40000"}) == 40000
    with pytest.raises(ValueError, match="set JAXCOLOSSAL_COORDINATOR_PORT"):
        coordinator_port({"MASTER_PORT": "65535", "TORCHELASTIC_USE_AGENT_STORE": "True"})
    with pytest.raises(ValueError, match="JAXCOLOSSAL_COORDINATOR_PORT must be an integer"):
        coordinator_port({"JAXCOLOSSAL_COORDINATOR_PORT": "x"})
