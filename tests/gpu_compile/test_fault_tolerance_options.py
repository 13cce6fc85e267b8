"""``parallel.nccl_abort_on_error``: XLA's GPU compiler (compile-only H200s, no GPU) accepts the NCCL abort
options as the train step's compile options, and they are given on GPU meshes only."""

import pytest
from tiny import tiny_config

from jaxcolossal.aot import fleet, target
from jaxcolossal.runtime import xla_flags


def test_the_nccl_abort_options_compile_for_gpus_and_only_for_gpus():
    assert xla_flags.compiler_options(False, 0, "cpu", nccl_abort=True) == {}
    assert xla_flags.compiler_options(False, 0, "gpu", nccl_abort=True) == xla_flags.NCCL_ABORT_OPTIONS
    assert xla_flags.compiler_options(False, 0, "gpu") == {}
    cfg = tiny_config({"data_parallel_size": 2, "zero_stage": 2}, model={"num_layers": 1})
    cfg.parallel.nccl_abort_on_error = True
    cfg.parallel.overlap = False
    result = fleet.compile_for(cfg, target.get_target("h200"), 2)  # XLA refuses an unknown option by name
    assert result.compile_s > 0


def test_the_gpu_compiler_refuses_an_unknown_option_so_the_test_above_means_something(monkeypatch):
    monkeypatch.setitem(xla_flags.NCCL_ABORT_OPTIONS, "xla_gpu_nccl_no_such_option", True)
    cfg = tiny_config({"data_parallel_size": 2, "zero_stage": 2}, model={"num_layers": 1})
    cfg.parallel.nccl_abort_on_error = True
    cfg.parallel.overlap = False
    with pytest.raises(Exception, match="xla_gpu_nccl_no_such_option"):
        fleet.compile_for(cfg, target.get_target("h200"), 2)
