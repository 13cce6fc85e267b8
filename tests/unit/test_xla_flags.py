"""``parallel.overlap`` / ``bucket_size_mb`` -> XLA's GPU flags (jaxcolossal.runtime.xla_flags): which
flags, only the spellings this jaxlib accepts, the user's own XLA_FLAGS kept, nothing set off GPUs."""

import os

import pytest
from tiny import tiny_config

from jaxcolossal.config import ConfigError, double_buffers_loops, validate
from jaxcolossal.runtime import xla_flags


def test_groups_per_setting():
    assert xla_flags.groups_for(False, 0) == []
    assert xla_flags.groups_for(True, 0) == list(xla_flags.OVERLAP_GROUPS)
    bucket = xla_flags.groups_for(False, 25)
    assert bucket == [(f"{name}={25 * 2**20}",) for name in xla_flags.BUCKET_FLAGS]
    no_db = xla_flags.groups_for(True, 0, double_buffer=False)
    assert xla_flags.DOUBLE_BUFFERING not in no_db and len(no_db) == len(xla_flags.OVERLAP_GROUPS) - 1


def test_double_buffering_only_under_zero3():
    assert [double_buffers_loops(tiny_config({"zero_stage": z})) for z in range(4)] == [False, False, False, True]
    assert not double_buffers_loops(tiny_config({"zero_stage": 3, "overlap": False}))


def test_first_accepted_spelling_wins_and_answers_are_cached(tmp_path):
    asked = []

    def accepts(flags):
        asked.append(flags.split()[-1])
        return "old" not in flags.split()[-1] and "bogus" not in flags.split()[-1]

    groups = [("--xla_old_name=1", "--xla_new_name=1"), ("--xla_bogus=1",), ("--xla_fine=true",)]
    cache = tmp_path / "flags.json"
    kept, rejected = xla_flags.resolve(groups, accepts, cache)
    assert kept == ["--xla_new_name=1", "--xla_fine=true"]
    assert rejected == ["--xla_old_name=1", "--xla_bogus=1"]
    assert len(asked) == 4
    again = xla_flags.resolve(groups, lambda f: pytest.fail("probed again"), cache)
    assert again == (kept, rejected)


def test_this_jaxlib_accepts_the_overlap_flags_and_refuses_an_unknown_one():
    """A real probe process each (XLA parses GPU flag names on the CPU too)."""
    kept, rejected = xla_flags.resolve(xla_flags.groups_for(True, 32) + [("--xla_gpu_no_such_flag=1",)],
                                       cache=None)
    assert "--xla_gpu_enable_latency_hiding_scheduler=true" in kept
    assert "--xla_gpu_all_reduce_combine_threshold_bytes=33554432" in kept
    assert rejected[-1] == "--xla_gpu_no_such_flag=1"
    assert len(kept) == len(xla_flags.OVERLAP_GROUPS) + 3  # one spelling of every group


def test_the_users_flags_win_and_cpu_runs_get_none(monkeypatch):
    assert xla_flags.merge("--xla_gpu_enable_latency_hiding_scheduler=false --a=1",
                           ["--xla_gpu_enable_latency_hiding_scheduler=true", "--b=2"]) == \
        "--xla_gpu_enable_latency_hiding_scheduler=false --a=1 --b=2"
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    assert not xla_flags.gpu_expected()
    assert xla_flags.apply(True, 64) == []
    assert os.environ["XLA_FLAGS"] == "--xla_force_host_platform_device_count=8"


def test_bad_values_are_refused():
    with pytest.raises(ConfigError, match="bucket_size_mb"):
        validate(tiny_config({"data_parallel_size": 1, "bucket_size_mb": -1}))
