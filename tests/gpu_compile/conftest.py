"""The ``gpu_compile`` tests: XLA's GPU compiler, run on this machine without a GPU.

Every test here compiles for compile-only H200s (:mod:`jaxcolossal.aot`) and asserts on what the
compiler emitted. They need the ``gpu-compile`` extra (part of ``test``); without it they fail
with the install line, rather than skip, so that CI cannot pass without running them.
"""

import functools
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from tiny import tiny_config  # noqa: E402

from jaxcolossal.aot import fleet, target  # noqa: E402


def pytest_collection_modifyitems(items):
    here = os.path.dirname(__file__)
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(pytest.mark.gpu_compile)


def _items(d: dict | None) -> tuple | None:
    return None if d is None else tuple(sorted(d.items()))


@functools.lru_cache(maxsize=None)
def _compiled(parallel: tuple, precision: str | None, model: tuple | None, training: tuple | None,
              offload: tuple | None, devices: int, fp8: bool = False):
    as_dict = lambda t: None if t is None else dict(t)  # noqa: E731
    cfg = tiny_config(as_dict(parallel), precision, as_dict(model), as_dict(training))
    cfg.precision.fp8 = fp8
    for key, value in (as_dict(offload) or {}).items():
        setattr(cfg.offload, key, value)
    return fleet.compile_for(cfg, target.get_target("h200"), devices)


@pytest.fixture(scope="session")
def compile_tiny():
    """``compile_tiny(parallel, precision=None, model=None, training=None, offload=None, devices=8, fp8=False)``:
    the tiny test model's train step compiled for that many H200s (cached per configuration for the
    session)."""
    if not target.gpu_compiler_available():
        pytest.fail("XLA's GPU compiler is not installed: pip install -e \".[gpu-compile]\"", pytrace=False)

    def get(parallel, precision=None, model=None, training=None, offload=None, devices=8, fp8=False):
        return _compiled(_items(parallel), precision, _items(model), _items(training), _items(offload), devices, fp8)
    return get
