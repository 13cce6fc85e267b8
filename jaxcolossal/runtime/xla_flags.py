"""XLA's GPU flags for communication: overlap (``parallel.overlap``) and collective buckets
(``parallel.bucket_size_mb``), set in ``XLA_FLAGS`` before the backend starts, and only the
ones this jaxlib accepts.

Colossal-AI exposes ``overlap_communication`` and ``reduce_bucket_size_in_m``; in JAX the
collectives are XLA's, so these map to its flags:

* ``overlap=true``: the latency-hiding scheduler (collectives issued early, on their own
  stream, so they run under independent compute), while-loop double buffering, and the
  collective pipeliner (the all-gather of a scanned layer's ZeRO-3 shards moved into the
  previous iteration, the reduce-scatter of its gradient into the next) — the flags MaxText
  sets for the same purpose.
* ``bucket_size_mb=B`` (> 0): XLA combines small all-reduces, all-gathers and reduce-scatters
  into one up to ``B`` MiB (``--xla_gpu_*_combine_threshold_bytes``), as Colossal-AI's buckets
  do. 0 keeps XLA's defaults.

A flag name XLA does not know makes the process abort when the backend starts, and the names
change across jaxlib versions, so each group lists alternative spellings and the first one that
a probe process accepts is kept (:func:`resolve`); the answers are cached per jaxlib version in
``~/.cache/jaxcolossal/xla_flags.json``. Flags already in ``XLA_FLAGS`` are never replaced.
The flags only matter on GPUs: :func:`apply` does nothing where no CUDA plugin is installed or
``JAX_PLATFORMS`` excludes it (the CPU runs of the tests).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path
from typing import Callable

from jaxcolossal.runtime.platforms import cuda_plugin_installed

OVERLAP_GROUPS: tuple[tuple[str, ...], ...] = (
    ("--xla_gpu_enable_latency_hiding_scheduler=true",),
    ("--xla_gpu_enable_while_loop_double_buffering=true",),
    ("--xla_gpu_enable_pipelined_all_gather=true", "--xla_gpu_pipeline_all_gather=on"),
    ("--xla_gpu_enable_pipelined_reduce_scatter=true", "--xla_gpu_pipeline_reduce_scatter=on"),
    ("--xla_gpu_enable_pipelined_all_reduce=true", "--xla_gpu_pipeline_all_reduce=on"),
)
"""``parallel.overlap``: each tuple lists alternative spellings of one setting, newest first."""

BUCKET_FLAGS = ("--xla_gpu_all_reduce_combine_threshold_bytes", "--xla_gpu_all_gather_combine_threshold_bytes",
                "--xla_gpu_reduce_scatter_combine_threshold_bytes")
"""``parallel.bucket_size_mb``: XLA's combine thresholds, in bytes."""

NCCL_ABORT_OPTIONS: dict[str, bool] = {
    "xla_gpu_nccl_terminate_on_error": False,
    "xla_gpu_nccl_async_execution": True,
    "xla_gpu_nccl_blocking_communicators": False,
}
"""``parallel.nccl_abort_on_error``: a failed NCCL collective returns an error to the program instead of
killing the process from inside NCCL (``terminate_on_error=false``), and the communicators run
asynchronously and non-blocking, so that a collective whose peer is gone can be aborted instead of
waiting for ever. The names are those of jaxlib 0.10 (``strings`` on its ``_jax.so``, which also lists
``xla_gpu_nccl_termination_timeout_seconds``); a deviceless compile for GPUs accepts them
(tests/gpu_compile/test_fault_tolerance_options.py)."""

CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "jaxcolossal" / "xla_flags.json"


DOUBLE_BUFFERING = OVERLAP_GROUPS[1]
"""While-loop double buffering: asked for only where it pays (``double_buffer``,
:func:`jaxcolossal.config.double_buffers_loops`)."""


def groups_for(overlap: bool, bucket_size_mb: float, double_buffer: bool = True) -> list[tuple[str, ...]]:
    """The flag groups a ``parallel`` section asks for (each: alternatives, first accepted wins);
    ``double_buffer=False`` leaves :data:`DOUBLE_BUFFERING` out of the overlap groups."""
    groups = [g for g in OVERLAP_GROUPS if double_buffer or g != DOUBLE_BUFFERING] if overlap else []
    if bucket_size_mb > 0:
        groups += [(f"{name}={int(bucket_size_mb * 2**20)}",) for name in BUCKET_FLAGS]
    return groups


def probe(flags: str, timeout_s: float = 120.0) -> bool:
    """Whether a fresh Python process starts JAX's (CPU) backend with ``XLA_FLAGS=flags``: XLA
    parses every flag name on every platform, and an unknown name aborts the process."""
    env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}
    try:
        return subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], env=env, timeout=timeout_s,
                              capture_output=True).returncode == 0
    except subprocess.TimeoutExpired:
        return False


def _jaxlib_version() -> str:
    try:
        return version("jaxlib")
    except Exception:  # noqa: BLE001 - an unknown version only disables the cache's reuse
        return "unknown"


def resolve(groups: list[tuple[str, ...]], accepts: Callable[[str], bool] = probe,
            cache: Path | None = CACHE) -> tuple[list[str], list[str]]:
    """Pick, per group, the first spelling this jaxlib accepts.

    Returns ``(kept, rejected)``: the accepted flags, and every spelling tried and refused (a
    group with none accepted is left out, not fatal). ``accepts`` probes one flag on top of the
    ones kept so far; its answers are cached in ``cache`` per jaxlib version (``None``: no cache).
    """
    version = _jaxlib_version()
    known: dict = {}
    if cache is not None and cache.exists():
        try:
            known = json.loads(cache.read_text()).get(version, {})
        except (OSError, ValueError):
            known = {}
    kept, rejected = [], []
    for group in groups:
        for flag in group:
            name = flag.split("=", 1)[0]
            ok = known.get(name)
            if ok is None:
                ok = known[name] = accepts(" ".join(kept + [flag]))
            if ok:
                kept.append(flag)
                break
            rejected.append(flag)
    if cache is not None:
        try:
            cache.parent.mkdir(parents=True, exist_ok=True)
            data = json.loads(cache.read_text()) if cache.exists() else {}
            data[version] = known
            tmp = cache.with_suffix(".tmp")
            tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
            tmp.replace(cache)
        except (OSError, ValueError):
            pass  # a read-only home: probe again next time
    return kept, rejected


def gpu_expected() -> bool:
    """Whether JAX will run on a CUDA GPU, decided without starting a backend: a CUDA plugin is
    installed and ``JAX_PLATFORMS`` is unset or names ``cuda``/``gpu``."""
    platforms = os.environ.get("JAX_PLATFORMS", "").lower()
    if platforms and not any(p in platforms for p in ("cuda", "gpu")):
        return False
    return cuda_plugin_installed()


def merge(xla_flags: str, flags: list[str]) -> str:
    """``xla_flags`` plus each of ``flags`` whose name it does not already set (the user's wins)."""
    have = {tok.split("=", 1)[0] for tok in xla_flags.split()}
    return " ".join(xla_flags.split() + [f for f in flags if f.split("=", 1)[0] not in have])


def apply(overlap: bool, bucket_size_mb: float, force: bool = False, double_buffer: bool = True) -> list[str]:
    """Add the communication flags for ``parallel.overlap`` / ``bucket_size_mb`` to
    ``os.environ["XLA_FLAGS"]``; call before JAX's backend starts (as :func:`jaxcolossal.runtime.launch.simulate_devices`).

    Args:
        overlap, bucket_size_mb: the config's values.
        force: set them even where no GPU is expected (they are inert on the CPU).

    Returns:
        The flags added (empty off GPUs, or when nothing is asked or accepted).
    """
    groups = groups_for(overlap, bucket_size_mb, double_buffer)
    if not groups or not (force or gpu_expected()):
        return []
    kept, _ = resolve(groups)
    before = os.environ.get("XLA_FLAGS", "")
    os.environ["XLA_FLAGS"] = merge(before, kept)
    return [f for f in kept if f.split("=", 1)[0] not in {t.split("=", 1)[0] for t in before.split()}]


def compiler_options(overlap: bool, bucket_size_mb: float, platform: str,
                     double_buffer: bool = True, nccl_abort: bool = False) -> dict[str, bool | int | str]:
    """The same flags as ``compile(compiler_options=...)`` entries, for a mesh on ``platform``
    (``"gpu"``/``"cuda"``; ``{}`` for any other): how they reach a deviceless compile for a GPU
    fleet, where no GPU backend starts to read ``XLA_FLAGS``
    (``--compile-for``, :func:`jaxcolossal.aot.fleet.compile_for`), and how the training loop
    passes them to its train step on GPUs. ``nccl_abort`` adds :data:`NCCL_ABORT_OPTIONS`
    (``parallel.nccl_abort_on_error``). A flag the user already set in ``XLA_FLAGS`` is left
    out (theirs wins). XLA rejects a name it does not know (``No such compile option``); the
    spellings are those :func:`resolve` found this jaxlib to accept."""
    if platform not in ("gpu", "cuda"):
        return {}
    groups = groups_for(overlap, bucket_size_mb, double_buffer)
    kept = resolve(groups)[0] if groups else []
    users = {tok.split("=", 1)[0] for tok in os.environ.get("XLA_FLAGS", "").split()}  # the user's win
    out = {name: _option_value(value) for name, value in (f.lstrip("-").split("=", 1) for f in kept)
           if f"--{name}" not in users}
    if nccl_abort:
        out.update({k: v for k, v in NCCL_ABORT_OPTIONS.items() if f"--{k}" not in users})
    return out


def _option_value(text: str) -> bool | int | str:
    """A flag's value as a compile option takes it: booleans and integers typed, the rest as text."""
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    return int(text) if text.lstrip("-").isdigit() else text
