"""The accelerators the planner knows: memory, dense bf16 peak, link bandwidths, the fixed cost of a
collective (``--device`` names)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Device:
    """One accelerator kind: memory (bytes), dense bf16 peak (FLOP/s), the bandwidths (bytes/s,
    per device, one direction) inside a node (NVLink) and between nodes (InfiniBand), and the
    fixed cost of one collective (seconds: the α of Hockney's α–β model; 10 µs, the order of
    NCCL's small-message latency over NVLink, an assumption no GPU here has measured).

    Two fields describe devices that are not GPUs, and are off for every entry of :data:`DEVICES`:

    * ``shared_host``: the devices are simulated, threads of one host that share its cores
      (``--xla_force_host_platform_device_count``). A stage idle in the pipeline's bubble leaves
      its cores to the others, so the bubble costs only the work idle ticks do: GPipe's, which
      compute on a placeholder (docs/pipeline.md); 1F1B and interleaved skip them.
    * ``memory_cost``: seconds per byte of the memory the step touches per device, as
      :func:`cost_terms` counts it (``memory``: the predicted need, state, gradients and
      activations, plus the fp32 gradients once per microbatch). On a CPU a step's time grows
      with it, beyond the FLOPs: the optimizer update reads and writes the whole state, each
      microbatch writes its weight gradients and adds them up, what the forward saves for the
      backward leaves the caches, and XLA:CPU allocates the temporaries anew each run. A GPU's
      HBM moves these bytes in a time negligible next to its matmuls (0).
      ``scripts/plan_vs_time.py`` measures it for the CPU (docs/planner.md: the cost of the
      activations alone, its first form, ranked the CPU's layouts worse).
    """

    name: str
    memory: float
    peak: float
    intra_bw: float
    inter_bw: float
    per_node: int = 8
    latency: float = 10e-6
    shared_host: bool = False
    memory_cost: float = 0.0
    fp8_peak: float = 0.0
    """Dense FP8 peak (FLOP/s) where the tensor cores have one (Hopper, Blackwell: twice bf16); 0: none."""
    target: str = ""
    """The GPU compiler's target of this device (:mod:`jaxcolossal.aot.target`; ``--confirm``); "": none."""


DEVICES = {  # NVIDIA datasheets; inter-node: one 400 Gb/s NIC per GPU (200 Gb/s for A100)
    "a100-40": Device("A100 40GB", 42_949_672_960, 312e12, 300e9, 25e9),
    "a100-80": Device("A100 80GB", 85_100_068_864, 312e12, 300e9, 25e9, target="a100"),
    "h100": Device("H100 80GB", 84_942_979_072, 989e12, 450e9, 50e9, fp8_peak=1979e12, target="h100"),
    "h200": Device("H200 141GB", 151_397_597_184, 989e12, 450e9, 50e9, fp8_peak=1979e12, target="h200"),
    "b200": Device("B200 180GB", 191_514_411_008, 2250e12, 900e9, 50e9, fp8_peak=4500e12, target="b200"),
}
"""``--device`` names. Memory is the HBM the GPU reports, in bytes: the marketing "80GB", "141GB"
are close to GiB (the H200's is 141 GiB = 151.4e9 bytes), the same bytes as the GPU compiler's
targets (:mod:`jaxcolossal.aot.target`; a test keeps them equal). NVLink bandwidths are per
direction (H100/H200: 900 GB/s bidirectional)."""

ALIASES = {"a100": "a100-80", "a100_80gb": "a100-80", "a100-80gb": "a100-80", "a100_40gb": "a100-40",
           "a100-40gb": "a100-40", "h100_sxm": "h100", "h100-sxm": "h100"}
"""Other spellings of :data:`DEVICES` names: ``--compile-for``'s (``a100`` is the A100 80GB,
:data:`jaxcolossal.aot.target.ALIASES`) and the spec files' stems."""


def device_key(name: str) -> str:
    """The :data:`DEVICES` key of ``name`` (case-insensitive; :data:`ALIASES` too); unknown names
    are returned lower-cased, for the caller to refuse."""
    return ALIASES.get(name.lower(), name.lower())
