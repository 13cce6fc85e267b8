"""GPU targets as data, and the compile-only devices XLA's GPU compiler builds for them.

Each target is a ``stream_executor.GpuTargetConfigProto`` in text form under ``specs/``, written
from the vendor's public specifications (SM count, HBM size and bandwidth, clocks, compute
capability, the CUDA runtime and cuDNN versions; each file names its sources). Handed to
``jax.experimental.topologies.get_topology_desc(platform="cuda", target_config=...)`` it gives
*compile-only* devices: a ``Mesh`` over them lowers and compiles like a real fleet's (XLA's SPMD
partitioner, latency-hiding scheduler, async collectives, cuDNN and Triton custom calls,
``memory_analysis()``), on a machine with no GPU. Nothing runs on them.

The GPU compiler needs ``jax-cuda12-plugin`` and ``jax-cuda12-pjrt`` at the installed jax's version
(``pip install "jax[cuda12-local]" nvidia-cudnn-cu12``, or the project's ``gpu-compile`` extra),
and, on a machine without a GPU, ``JAX_PLATFORMS=cpu JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1`` in the
environment before jax starts (:func:`prepare_environment`).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import jax
from jax.experimental import topologies

from jaxcolossal.errors import ConfigError, DependencyError
from jaxcolossal.runtime.platforms import nvidia_device_present

SPECS = Path(__file__).with_name("specs")
"""The folder of the target files (``<name>.txtpb``)."""


@dataclass(frozen=True)
class Target:
    """One GPU model. The hardware figures are read from its spec file; the links are not in XLA's
    proto, so they sit in :data:`TARGETS` beside the file name.

    Attributes:
        name: the short name (``h200``).
        file: the spec file's name under :data:`SPECS`.
        nvlink_bw: bytes/s per GPU per direction inside a host (NVLink).
        network_bw: bytes/s per GPU per direction between hosts (one NIC per GPU).
        devices_per_host: GPUs in one host of the usual server (HGX: 8).
    """

    name: str
    file: str
    nvlink_bw: float
    network_bw: float
    devices_per_host: int = 8

    @property
    def path(self) -> Path:
        return SPECS / self.file

    @property
    def text(self) -> str:
        """The ``GpuTargetConfigProto`` text handed to the compiler."""
        return _read(self.path)

    def _field(self, name: str) -> str:
        m = re.search(rf'^\s*{name}:\s*(?:"([^"]*)"|(\S+))', self.text, re.M)
        if not m:
            raise ValueError(f"{self.path}: no {name} field")
        return m.group(1) if m.group(1) is not None else m.group(2)

    @property
    def description(self) -> str:
        """The device's name as the driver reports it (``NVIDIA H200``)."""
        return self._field("device_description_str")

    @property
    def sm_count(self) -> int:
        return int(self._field("core_count"))

    @property
    def hbm_bytes(self) -> int:
        """Device memory in bytes (``device_memory_size``)."""
        return int(self._field("device_memory_size"))

    @property
    def hbm_bw(self) -> float:
        """HBM bandwidth in bytes/s (``memory_bandwidth``)."""
        return float(self._field("memory_bandwidth"))

    @property
    def clock_ghz(self) -> float:
        return float(self._field("clock_rate_ghz"))

    @property
    def compute_capability(self) -> str:
        """``major.minor`` (``9.0``)."""
        block = re.search(r"cuda_compute_capability\s*\{([^}]*)\}", self.text).group(1)
        major = re.search(r"major:\s*(\d+)", block).group(1)
        minor = re.search(r"minor:\s*(\d+)", block)
        return f"{major}.{minor.group(1) if minor else 0}"

    @property
    def cuda_runtime(self) -> str:
        return self._field("runtime_version")

    @property
    def cudnn(self) -> str:
        return self._field("dnn_version")

    @property
    def peak_bf16(self) -> float:
        """Dense bf16 FLOP/s: 2 × SMs × tensor cores per SM × clock × multiply-adds per clock
        (the file's BF16 ``matrix_unit_description`` rate, PrimitiveType 16)."""
        for m in re.finditer(r"rate_infos\s*\{\s*key:\s*(\d+)\s*value\s*\{([^}]*)\}", self.text):
            if m.group(1) == "16":
                v = dict(re.findall(r"(\w+):\s*([\d.]+)", m.group(2)))
                return 2 * self.sm_count * float(v["units_per_core"]) * float(v["clock_rate_ghz"]) * 1e9 \
                    * float(v["ops_per_clock"])
        raise ValueError(f"{self.path}: no BF16 matrix unit rate")


TARGETS: dict[str, Target] = {
    # NVLink per direction: H100/H200 900 GB/s, B200 1.8 TB/s, A100 600 GB/s bidirectional (datasheets);
    # between hosts one 400 Gb/s NIC per GPU (DGX H100/H200/B200), 200 Gb/s on DGX A100
    "h100": Target("h100", "h100_sxm.txtpb", nvlink_bw=450e9, network_bw=50e9),
    "h200": Target("h200", "h200.txtpb", nvlink_bw=450e9, network_bw=50e9),
    "b200": Target("b200", "b200.txtpb", nvlink_bw=900e9, network_bw=50e9),
    "a100": Target("a100", "a100_80gb.txtpb", nvlink_bw=300e9, network_bw=25e9),
}
"""The shipped targets by name (:func:`get_target` also takes the file stems, ``h100_sxm``, ``a100_80gb``)."""

ALIASES = {"h100_sxm": "h100", "h100-sxm": "h100", "a100_80gb": "a100", "a100-80": "a100", "a100-80gb": "a100"}


@cache
def _read(path: Path) -> str:
    return path.read_text()


def get_target(name: str) -> Target:
    """The :class:`Target` called ``name`` (case-insensitive; :data:`ALIASES` too).

    Raises:
        ConfigError: an unknown name, listing the known ones.
    """
    key = ALIASES.get(name.lower(), name.lower())
    if key not in TARGETS:
        raise ConfigError(f"unknown GPU target {name!r}; known: {', '.join(sorted(TARGETS))}")
    return TARGETS[key]


def parse_fleet(fleet: str) -> tuple[Target, int]:
    """``"h200x16"`` -> (the H200 target, 16). A bare name means one host's worth of devices.

    Raises:
        ConfigError: not ``NAMExCOUNT`` with a known name and a positive count.
    """
    m = re.fullmatch(r"([A-Za-z0-9_\-]+?)(?:[x×](\d+))?", fleet.strip())
    if not m:
        raise ConfigError(f"--compile-for {fleet!r}: expected NAMExCOUNT, e.g. h200x16; targets: "
                         f"{', '.join(sorted(TARGETS))}")
    target = get_target(m.group(1))
    count = int(m.group(2)) if m.group(2) else target.devices_per_host
    if count < 1:
        raise ConfigError(f"--compile-for {fleet!r}: the device count must be at least 1")
    return target, count


def topology(num_devices: int, devices_per_host: int) -> str:
    """XLA's topology string ``"1x<hosts>x<devices per host>"`` (one slice).

    Raises:
        ValueError: ``devices_per_host`` does not divide ``num_devices``.
    """
    per = min(devices_per_host, num_devices)
    if per < 1 or num_devices % per:
        raise ValueError(f"{num_devices} devices do not split into hosts of {devices_per_host}")
    return f"1x{num_devices // per}x{per}"


def prepare_environment() -> None:
    """Set what the GPU compiler needs on a machine without a GPU; call it before jax's backends
    start (before the first ``jax.devices()``): ``JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1`` (else the CUDA
    plugin's version check calls ``cuInit`` and its import fails), and the CPU as jax's platform
    when no NVIDIA device node exists and none was chosen (so that jax does not try to start a GPU
    backend). Values already set are kept."""
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
    if not nvidia_device_present() and not jax.config.jax_platforms:
        jax.config.update("jax_platforms", "cpu")


def compile_only_devices(target: Target | str, num_devices: int, devices_per_host: int | None = None) -> list:
    """``num_devices`` compile-only CUDA devices of ``target``, ``devices_per_host`` per host
    (default: the target's, 8), in process-major order: a ``Mesh`` over them
    (:func:`jaxcolossal.parallel.mesh.make_mesh` takes ``devices=``) compiles for that fleet.

    Raises:
        ValueError: an unknown target, or a device count that does not split into hosts.
        DependencyError: the GPU compiler is not installed (the message says what to install).
        RuntimeError: the installed jaxlib cannot parse the target file.
    """
    if isinstance(target, str):
        target = get_target(target)
    topo = topology(num_devices, devices_per_host or target.devices_per_host)
    try:
        desc = topologies.get_topology_desc(platform="cuda", target_config=target.text, topology=topo)
    except NotImplementedError as e:  # no CUDA plugin, or its import failed
        raise DependencyError(
            "the XLA GPU compiler is not available: install it with pip install -e \".[gpu-compile]\" "
            "(jax-cuda12-plugin and jax-cuda12-pjrt at jax's version, and cuDNN), and set "
            "JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 before jax starts on a machine without a GPU") from e
    except Exception as e:  # noqa: BLE001 - the plugin's parse error is a plain XlaRuntimeError
        raise RuntimeError(f"the GPU compiler refused {target.path.name}: {e}") from e
    return sorted(desc.devices, key=lambda d: (d.process_index, d.id))


def gpu_compiler_available() -> bool:
    """Whether the CUDA plugin can make compile-only devices here (tests skip without it)."""
    try:
        compile_only_devices("h200", 1)
    except (DependencyError, RuntimeError):
        return False
    return True
