"""Activation memory of the train step, read from the model's own autodiff.

The planner (:mod:`jaxcolossal.plan`), ``--dry-run`` and the OOM explanation need the bytes that
the backward pass keeps per device. Instead of a formula written for another code base
(Korthikanti et al., 2022, Table 2, which this module replaced), it asks JAX: the residuals of
``jax.vjp`` of the family's ``loss_sum``, traced abstractly (``jax.make_jaxpr``: no array is
allocated, nothing is compiled) at the per-device shapes of one microbatch, under the run's
``model.remat`` policy. That is exactly what partial evaluation saves for the backward pass of
the code that runs, so a new layer, a changed policy or another model family needs no new
formula.

Per device and microbatch (:func:`residuals`):

* ``saved``: what the policy keeps, every layer of the stage (the scan stacks it ``[L, ...]``),
  plus the embedding's and the LM head's (the loss chunks' logits, under ``model.loss_chunk_tokens``);
* ``layer``: one layer's residuals *without* checkpointing, the working set of the backward
  pass of one layer (under ``remat=full`` the layer is recomputed, so this is live at once too).

``attention_impl=cudnn`` is traced as ``flash`` (the same residuals; cuDNN traces only where it
is installed). Shapes are per device: dimensions mapped to ``tp`` by the rules table are divided by it (the
param specs of :func:`jaxcolossal.parallel.sharding.state_specs` without ZeRO's ``fsdp``, which the
forward gathers), and the sequence by ``sp``. A layer's residuals grow linearly with the
microbatch, so they are traced at one and two layers of one sequence and scaled; the rest
(embedding, head, loss) is traced with no layers at the microbatch itself. The traces are
cached, so that the planner traces each (tp, remat, dtype) once.

The buffers each layout adds to :func:`step_peak`'s phases:

* ZeRO-2/3 reduce each layer's gradient inside the scan (``reduces_layerwise``), so the
  compute-dtype gradients in flight are the data shard's ``1/N``; at the end of a layer's
  backward its whole weight gradient (fp32 under ZeRO-3's prefetch) is live beside the
  reduction's output (``1/N`` of it after a reduce-scatter; XLA:CPU computes it in fp32 and
  reduces it with an all-reduce, so twice the layer's fp32 gradient there), while most of
  the working set is dead: the larger of the two is counted;
* ZeRO-3's prefetching scan (``remat=full``) holds the current and the next layer gathered
  (on XLA:CPU in low precision the current one in fp32, with the CPU's copies below) and its
  residual copy of the sharded weights (on XLA:CPU in low precision, the shards converted
  to fp32);
* GPipe keeps every tick's residuals, one chunk's each (``m·v + p − 1`` ticks: the backward
  is autodiff of the tick scan), except those made from the shapes alone (the causal mask, the
  rotary tables), which the tick scan computes once; in the backward it copies the tick's
  layer residuals out of the stacks and carries the chunk's gradients (``tick``); the
  lock-step schedules (1F1B, interleaved) keep one chunk's (``layers / v``), its gradients in
  the compute dtype, and the stash of ``2·v·p − 1`` stage inputs ``[b, s/sp, h]``; GPipe's tick scan saves the head's
  residuals with each tick's;
* ``backend="cpu"``: XLA:CPU computes bf16/fp16 matmuls in fp32 and converts their operands
  once, outside the layer loop. So the stage's layer weights are also held in fp32: one layer
  under ZeRO-3's prefetching scan; under ZeRO-3 without it, the converted shards and one
  gathered layer. Each tick of the interleaved schedule slices its chunk out of the stage's
  bf16 and fp32 stacks and converts both: two more chunk-sized fp32 copies. The layers' saved
  16-bit residuals are held in fp32 at the backward's start, in place of the 16-bit ones
  (counted as one more copy of them). In fp32, ZeRO-1/2's update slices the layers' data
  shard at the step's start and holds it through the step. ``"gpu"`` holds no such copies.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Any, Mapping

import jax
import jax.numpy as jnp

from jaxcolossal.config import (
    COMPUTE_DTYPES,
    Config,
    ModelConfig,
    attention_kernel,
    gib,
    pipeline_microbatches,
    prefetches_weights,
    reduces_layerwise,
)
from jaxcolossal.models import get_family, param_layout
from jaxcolossal.models.layers.vocab import fused_pays
from jaxcolossal.models.score_head import SCORE, pooled_scores
from jaxcolossal.parallel.mesh import data_size, entry_axes
from jaxcolossal.parallel.sharding import Sharder, is_shape, rules_for, state_specs


def _compute_shapes(cfg: Config, mesh_shape: Mapping[str, int]) -> Any:
    """Per-device compute shapes of every param leaf with ``layers`` of 1: each dimension divided
    by the sizes of the mesh axes its spec names, except ``fsdp`` (ZeRO-3 gathers before the
    compute) and ``pp`` (the stage's layers are counted separately)."""
    _, shapes, axes = param_layout(cfg.model, mesh_shape["tp"])
    specs = state_specs(axes, shapes, 0, mesh_shape, rules_for(cfg.parallel, pipeline=True)).base

    def local(shape, spec):
        out = []
        for n, entry in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
            names = entry_axes(entry)
            div = math.prod(mesh_shape.get(a, 1) for a in names if a not in ("fsdp", "pp"))
            out.append(n // div if n % div == 0 else n)
        return tuple(out)
    return jax.tree.map(local, shapes, specs, is_leaf=is_shape)


@functools.lru_cache(maxsize=512)
def _traced(model_items: tuple, shapes_items: tuple, seq: int, remat: str, dtype: str,
            batch: int = 1, fp8: bool = False) -> tuple[int, int, int, int, int]:
    """Bytes of the distinct residuals of ``jax.vjp(loss_sum)`` for ``batch`` sequences, the
    part of them in a 16-bit float dtype, the largest layer residual's bytes per layer (the scan
    stacks them ``[num_layers, ...]``; 0 with one layer), the bytes per layer of the largest
    fp32 ``[..., t, t]`` one (XLA attention's probabilities; a reward model's score head in place of the
    LM loss when ``model.num_labels``), and the part of the residuals that
    depends on neither the params nor the tokens (:func:`_input_free`: the causal mask, the
    rotary tables) (cached). ``fp8``: the projections in FP8 (``precision.fp8``), which save
    their inputs in one byte per element."""
    model = ModelConfig(**dict(model_items))
    model.remat = remat
    shapes = jax.tree_util.tree_unflatten(shapes_items[0], list(shapes_items[1]))
    family = get_family(model)
    params = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, COMPUTE_DTYPES[dtype]), shapes, is_leaf=is_shape)
    tok = jax.ShapeDtypeStruct((batch, seq), jnp.int32)

    shard = Sharder(None).with_fp8(fp8)

    def loss(p, x, y):  # the LM loss, or a reward model's pooled scores (no LM head: model.num_labels)
        if model.num_labels:
            return jnp.sum(pooled_scores(family.hidden_states(p, x, model, shard), p[SCORE], x, 0))
        return family.loss_sum(p, x, y, model, shard)

    def res(p, x, y):
        return jax.tree.leaves(jax.vjp(lambda p: loss(p, x, y), p)[1])
    jaxpr = jax.make_jaxpr(res)(params, tok, tok).jaxpr
    inputs = {id(v) for v in jaxpr.invars}
    free = _input_free(jaxpr)
    seen, total, low, big, square, const = set(), 0, 0, 0, 0, 0
    for v in jaxpr.outvars:  # residuals; the params themselves (forwarded inputs) are the state's
        if type(v).__name__ == "Literal" or id(v) in inputs or id(v) in seen:
            continue
        seen.add(id(v))
        total += v.aval.size * v.aval.dtype.itemsize
        if id(v) in free:
            const += v.aval.size * v.aval.dtype.itemsize
        if v.aval.dtype in (jnp.bfloat16, jnp.float16):
            low += v.aval.size * v.aval.dtype.itemsize
        if model.num_layers > 1 and v.aval.ndim and v.aval.shape[0] == model.num_layers:
            big = max(big, v.aval.size // model.num_layers * v.aval.dtype.itemsize)
            if v.aval.ndim >= 3 and v.aval.shape[-1] == v.aval.shape[-2] == seq and v.aval.dtype == jnp.float32:
                square = max(square, v.aval.size // model.num_layers * 4)  # attention's fp32 probabilities
    return total, low, big, square, const


def _input_free(jaxpr: Any) -> set[int]:
    """The ids of the variables of ``jaxpr`` that depend on none of its inputs (an equation's
    outputs depend on an input when any of its operands does): arrays made from the shapes alone,
    such as the causal mask and the rotary tables, which a loop over microbatches (GPipe's tick
    scan) computes once, outside the loop."""
    dependent = {id(v) for v in jaxpr.invars}
    free: set[int] = set()
    for eqn in jaxpr.eqns:
        if any(type(v).__name__ != "Literal" and id(v) in dependent for v in eqn.invars):
            dependent.update(id(v) for v in eqn.outvars)
        else:
            free.update(id(v) for v in eqn.outvars)
    return free


def residuals(cfg: Config, mesh_shape: Mapping[str, int], batch: int, layers: int,
              remat: str | None = None, dtype: str | None = None, shapes: Any = None) -> dict:
    """Residual bytes per device for a microbatch of ``batch`` sequences through ``layers`` layers
    (the stage's), under ``remat`` (default ``cfg.model.remat``; ``offload`` counts as ``full`` on
    the device: what it saves lives in host memory) in ``dtype`` (default the compute dtype:
    ``precision.mode``); ``shapes``: :func:`_compute_shapes`'s, when the caller has them.
    Returns ``{"saved": bytes, "head": bytes, "layer": bytes, "largest": bytes,
    "saved_16bit_layers": bytes, "const": bytes, ...}`` (module doc; ``head``: the part of ``saved``
    outside the layers, the embedding's and the LM head's; ``largest``: a layer's largest single
    residual without checkpointing, for the microbatch; ``saved_16bit_layers``: the layers' part of
    ``saved`` in bf16/fp16; ``const``: the part of ``head`` made from the shapes alone, the causal
    mask and the rotary tables; ``probs``: a layer's fp32 ``[.., t, t]`` attention probabilities
    for the microbatch, 0 where the attention keeps none: the flash kernels, cuDNN).

    Raises:
        ConfigError: from the family (e.g. GPT-2 with grouped-query attention).
    """
    m = cfg.model
    remat = remat or m.remat
    if remat == "offload":  # the saved projections go to pinned host memory: the device keeps the layer inputs
        remat = "full"
    dtype = dtype or cfg.precision.mode
    sp = mesh_shape.get("sp", 1)
    seq = max(1, cfg.training.seq_len // sp)
    shapes = _compute_shapes(cfg, mesh_shape) if shapes is None else shapes
    # cuDNN's fused attention traces only where cuDNN is; it keeps what the flash kernels keep
    # (q, k, v, the output and the softmax statistics), so those stand in for it
    impl = attention_kernel(cfg, mesh_shape)
    impl = "flash" if impl == "cudnn" else impl

    def at(n_layers: int, policy: str, b: int = 1, part: int = 0) -> int:
        one = {**shapes, "layers": jax.tree.map(lambda s: (n_layers,) + s[1:], shapes["layers"], is_leaf=is_shape)}
        flat, tree = jax.tree_util.tree_flatten(one, is_leaf=is_shape)
        items = tuple(sorted((f.name, impl if f.name == "attention_impl" else getattr(m, f.name))
                             for f in dataclasses.fields(m) if f.name not in ("num_layers", "remat", "init_from", "lora")))
        items = items + (("num_layers", n_layers),)
        return _traced(items, (tree, tuple(flat)), seq, policy, dtype, b, cfg.precision.fp8)[part]

    # a layer's residuals grow linearly with the microbatch (traced at one sequence); the rest
    # (embedding, final norm, the LM head's loss, whose fused chunked path depends on the tokens
    # per device) is traced with no layers at the microbatch itself
    per_layer = at(2, remat) - at(1, remat)
    none_layer = at(2, "none") - at(1, "none") if remat != "none" else per_layer
    head = _rest(lambda b: at(0, remat, b), batch, seq, m)
    low_layer = at(2, remat, part=1) - at(1, remat, part=1)
    low_none = at(2, "none", part=1) - at(1, "none", part=1)
    return {"saved": head + layers * per_layer * batch, "head": head, "layer": none_layer * batch,
            "layer_16bit": low_none * batch,
            "largest": at(2, "none", part=2) * batch, "saved_16bit_layers": layers * low_layer * batch,
            "probs_saved": layers * at(2, remat, part=3) * batch, "probs": at(2, "none", part=3) * batch,
            "const": at(0, remat, part=4)}


def _rest(traced, batch: int, seq: int, m: ModelConfig) -> int:
    """The non-layer residuals for ``batch`` sequences, linear in the batch within each of the LM
    head's two paths (:func:`jaxcolossal.models.layers.vocab.fused_pays`): traced at the smallest batch
    of the path and the next, then extrapolated, so that the planner traces a few batches only."""
    b0 = 1  # the full logits' path: from one sequence; the fused one from its first batch
    if fused_pays(batch * seq, m.hidden_size, m.loss_chunk_tokens):
        b0 = min(batch, (m.hidden_size + 3 * m.loss_chunk_tokens) // (2 * seq) + 1)
    r0 = traced(b0)
    return r0 if batch == b0 else r0 + (batch - b0) * (traced(b0 + 1) - r0)


def _elements(tree: Any) -> int:
    return sum(math.prod(s) for s in jax.tree.leaves(tree, is_leaf=is_shape))


def step_peak(cfg: Config, mesh_shape: Mapping[str, int], state: float, grads: float,
              backend: str = "gpu") -> dict:
    """The train step's predicted per-device peak (bytes) above the persistent state and the fp32
    gradient buffer, as the largest of its three phases, each the sum of the buffers live in it
    (read from XLA's buffer assignments: docs/planner.md):

    * the layers' backward, inside the layer scan's transpose: the state; the gradient buffers in
      flight; the layers' saved residuals (:func:`residuals`: ``saved`` less ``head``); one layer's
      backward working set (:func:`_layer_working_set`);
    * the LM head's backward, which runs before the layers' (without a pipeline, before the layer
      scan's transpose; with 1F1B or interleaved, before the chunk's pullback in the backward
      slot): every saved residual, the head's among them, and what lives through the whole
      backward (the CPU's copies, ZeRO-3's buffers, the accumulators, the stash), but no layer's
      working set yet;
    * the update: the state, the fp32 gradients, and the compute-dtype gradients they were cast from.

    Layouts add their own buffers (:func:`_cpu_copies`, :func:`_prefetch_buffers`,
    :func:`_schedule_buffers`; the module doc lists them). What it leaves out: Megatron-SP's
    sequence split of the norms' activations (counted whole), and the allocator's packing waste
    (on XLA:CPU under 4% in ``scripts/plan_vs_compiler.py``'s sweep).

    Args:
        cfg: the run's config (model, training batch/seq/accumulation, parallel, precision).
        mesh_shape: ``{"pp", "dp", "fsdp", "ep", "sp", "tp"}`` sizes.
        state: persistent device bytes per device (params, master, optimizer state, ...).
        grads: the fp32 gradient buffer's bytes per device.
        backend: ``"gpu"`` or ``"cpu"`` (the compiler whose buffers are predicted).

    Returns:
        ``{"activations": bytes above state + grads, "phase": "backward" | "head" | "update",
        "head": the head's residuals, "fp32_grads_live": whether the fp32 gradient buffer is
        live in the backward (not in a low-precision step without accumulation or pipeline, which
        makes it afterwards; then the phase's parts add up to activations + grads), and the
        parts: "residuals", "layer", "experts", "grads_compute", "accumulator", "zero3", "stash",
        "cpu_fp32", "tick"}`` (:data:`HEAD_PARTS`: the parts of the head's phase).
    """
    s = _peak_shape(cfg, mesh_shape, backend)
    r = residuals(cfg, mesh_shape, s.b, max(1, s.stage // s.v), shapes=s.shapes)  # a tick runs one chunk
    parts = {"residuals": _kept_residuals(s, r),
             "layer": _layer_working_set(s, r), "experts": _gpu_experts(cfg, s, mesh_shape),
             "cpu_fp32": _cpu_copies(cfg, s, r), "zero3": _prefetch_buffers(s),
             **_schedule_buffers(cfg, s, r, grads, mesh_shape)}
    # the fp32 buffer is live in the backward pass except in a low-precision step without
    # accumulation or pipeline, where it is made from the compute-dtype gradients afterwards
    fp32_live = 0.0 if s.lowp and s.pp == 1 and s.micro == 1 else grads
    backward = sum(parts.values()) + fp32_live
    # the LM head's backward: every saved residual, the head's among them, and what lives through
    # the whole backward pass; not yet a layer's working set or the layers' gradients
    head = (sum(parts[k] for k in HEAD_PARTS if k in parts) + r["head"] + fp32_live + _relayout(s, r)
            if s.split_head else 0.0)
    update = grads + _update_compute_grads(s)
    phase = max((backward, "backward"), (head, "head"), (update, "update"))[1]
    return {"activations": int(max(backward, head, update) - grads), "phase": phase, "head": int(r["head"]),
            "fp32_grads_live": bool(fp32_live), **{k: int(x) for k, x in parts.items()}}


@dataclass(frozen=True)
class _PeakShape:
    """The per-device quantities :func:`step_peak`'s parts are written in."""

    backend: str
    shapes: Any       # per-device compute shapes (:func:`_compute_shapes`)
    pp: int
    n: int            # the data group
    lowp: bool        # a 16-bit compute dtype
    item: int         # bytes of a compute-dtype element
    micro: int        # microbatches (pipeline microbatches, or accumulation steps)
    b: int            # sequences per microbatch per data shard
    stage: int        # layers per stage
    v: int            # chunks per device
    lockstep: bool    # 1F1B or interleaved
    kept: int         # ticks whose residuals are kept (GPipe: every tick's)
    layer_el: float   # one layer's parameters, tp-local
    layerwise: bool   # ZeRO-2/3 reduce each layer's gradient inside the scan
    prefetch: bool    # ZeRO-3's prefetching scan
    split_head: bool  # the LM head's backward is a phase of its own
    overlap: bool = False   # parallel.overlap: XLA:GPU's collective pipeliner
    zero3: bool = False     # ZeRO-3 over a data group > 1: the layers' weights gathered in the scan
    expert_el: float = 0.0  # the part of layer_el in the experts' weights (split over ep, reduced over n / ep)
    ep: int = 1

    @property
    def cpu_lowp(self) -> bool:
        return self.backend == "cpu" and self.lowp

    @property
    def chunk_el(self) -> float:
        return self.layer_el * self.stage / self.v

    @property
    def grads_compute(self) -> float:
        """The microbatch's (chunk's) gradients in the compute dtype (when layerwise, the data shard's 1/N;
        the experts' ``1/(N/ep)``: each ``ep`` rank reduces its own experts over the rest of the data group)."""
        if not self.layerwise:
            return self.chunk_el * self.item
        experts = self.expert_el * self.stage / self.v
        return ((self.chunk_el - experts) / self.n + experts / max(1, self.n // self.ep)) * self.item


def _peak_shape(cfg: Config, mesh_shape: Mapping[str, int], backend: str) -> _PeakShape:
    m, t, p = cfg.model, cfg.training, cfg.parallel
    pp, n = mesh_shape["pp"], data_size(mesh_shape)
    lowp = cfg.precision.mode != "fp32"
    micro = pipeline_microbatches(cfg, pp) if pp > 1 else t.gradient_accumulation_steps
    v = max(1, p.num_model_chunks) if pp > 1 else 1  # chunks per device (GPipe's v > 1: the circular pipeline)
    lockstep = pp > 1 and p.pipeline_schedule != "gpipe"
    shapes = _compute_shapes(cfg, mesh_shape)
    # GPipe's tick scan saves the head's residuals with each tick's, for its transpose; elsewhere
    # the head's backward runs before the layers', so its residuals are dead by then
    return _PeakShape(backend=backend, shapes=shapes, pp=pp, n=n, lowp=lowp, item=2 if lowp else 4, micro=micro,
                      b=max(1, t.batch_size // (micro * n)), stage=max(1, m.num_layers // pp), v=v,
                      lockstep=lockstep, kept=micro * v + pp - 1 if pp > 1 and not lockstep else 1,
                      layer_el=_elements(shapes["layers"]) / m.num_layers, layerwise=reduces_layerwise(cfg),
                      prefetch=prefetches_weights(cfg), split_head=pp == 1 or lockstep,
                      overlap=cfg.parallel.overlap, zero3=p.zero_stage == 3 and n > 1,
                      expert_el=_expert_elements(cfg, mesh_shape, shapes) / m.num_layers, ep=mesh_shape.get("ep", 1))


def _expert_elements(cfg: Config, mesh_shape: Mapping[str, int], shapes: Any) -> float:
    """The elements of the stacked layers' expert weights (logical axis ``expert``) in ``shapes``
    (:func:`_compute_shapes`'s, per device), whose whole 16-bit gradients the backward holds; 0 without
    experts, and with a capacity factor in one microbatch, whose compiled steps have not shown them
    (Mixtral's shape, 2 layers, capacity 1.25: counting them puts the plan 22% over XLA:GPU's peak,
    against 15%); with accumulation they are held (DeepSeek-V3's GRPO step, 8 microbatches: 4.8 GiB)."""
    if not cfg.model.moe or (cfg.model.capacity_factor > 0 and cfg.training.gradient_accumulation_steps == 1):
        return 0.0
    _, _, axes = param_layout(cfg.model, mesh_shape["tp"])
    leaves = jax.tree.leaves(shapes["layers"], is_leaf=is_shape)
    names = jax.tree.leaves(axes["layers"], is_leaf=lambda x: isinstance(x, tuple))
    return float(sum(math.prod(sh) for sh, ax in zip(leaves, names) if "expert" in ax))


def _kept_residuals(s: _PeakShape, r: dict) -> float:
    """The saved residuals live in the layers' backward: the layers' (the head's backward has run)
    or, under GPipe, every tick's, the head's among them, except the input-free ones (the causal
    mask, the rotary tables: ``const``), which the tick scan computes once."""
    if s.split_head:
        return (r["saved"] - r["head"]) * s.kept
    return (r["saved"] - r["const"]) * s.kept + r["const"]


def _relayout(s: _PeakShape, r: dict) -> float:
    """XLA:GPU: at the start of the backward the stage's stacked attention probabilities, when the
    remat policy saves them (XLA's attention: fp32 ``[L, b, heads, s, s]``), are copied into the
    layout the reverse scan reads, beside the original (an ``input_transpose_fusion`` of the whole
    stack). 0 elsewhere."""
    if s.backend != "gpu":
        return 0.0
    return r["probs_saved"] * s.kept


def _update_compute_grads(s: _PeakShape) -> float:
    """The compute-dtype gradients live beside the fp32 ones in the update phase: in low precision
    the microbatch's (the data shard's 1/N when layer-wise). XLA:GPU converts a step's whole
    compute-dtype gradient to fp32 leaf by leaf for the one reduction of ZeRO-0/1 (each leaf's
    16-bit buffer dies as its fp32 one is made), so none counts there."""
    if not s.lowp:
        return 0.0
    if s.backend == "gpu" and not s.layerwise and s.pp == 1 and s.micro == 1:
        return 0.0
    # the experts' whole 16-bit gradients (held through the backward, :attr:`_PeakShape.grads_compute`)
    # are converted leaf by leaf as well: their 1/N share stands for what is left of them
    return s.chunk_el * s.item / (s.n if s.layerwise else 1)


def _layer_working_set(s: _PeakShape, r: dict) -> float:
    """One layer's backward working set: its residuals without checkpointing (recomputed under
    ``remat=full``) and buffers of its largest activation, the cotangents of the op whose backward
    runs: two on XLA:CPU (attention's dP and dS beside P); one on XLA:GPU, where in low precision only
    the 16-bit residuals count (the fp32 upcasts of the norms are fused into their consumers), and
    with XLA's attention one more fp32 ``[b, h, t, t]`` (``probs``): the recomputed scores' matmul
    output beside the probabilities and their 16-bit copies (read from the buffers of the GRPO steps
    of Llama-3.1-8B, two fp32 and one bf16 such buffers at the peak, and Phi-4-mini, three and two). Under ZeRO-2/3's layer-wise reduction the end of a layer's
    backward also holds its whole weight gradient: on XLA:CPU beside the reduction's result while
    most of the working set is dead, so the larger of the two counts (twice the fp32 gradient, an
    all-reduce); on XLA:GPU see :func:`_gpu_layerwise`."""
    if s.backend == "gpu":
        working = (r["layer_16bit"] if s.lowp else r["layer"]) + r["largest"] + r["probs"]
    else:
        working = r["layer"] + 2 * r["largest"]
    if not s.layerwise:
        return working
    if s.backend == "gpu":
        return working + _gpu_layerwise(s)
    grad_item = 4 if s.prefetch else s.item
    transient = 2 * 4 * s.layer_el if s.backend == "cpu" else grad_item * s.layer_el * (1 + 1 / s.n)
    return max(working, transient)


GPU_EXPERT_COPIES = (3, 2)
"""How many ``[E/ep, M, K]`` buffers XLA:GPU holds at a dropless MoE layer's backward peak: ``K`` the wider of
the hidden size and the tp-local expert size for the first, the narrower for the second. Read from buffer
assignments: GPT-OSS-20B's step on 8 H100s (ep 8, both sizes 2880) holds five ``bf16[4, 131072, 2880]``;
Mixtral-8x7B's GRPO step on 8 H200s (ep 8, hidden 4096, experts of 14336) three ``bf16[196608, 14336]``
beside its hidden-wide ones. The assignment does not say how many of those are live at the peak: two
makes the compiled peaks of Mixtral's shape agree (+2.5% to +8.1% over GRPO batches, layer counts and
expert sizes: docs/posttraining.md)."""


def _gpu_experts(cfg: Config, s: _PeakShape, mesh_shape: Mapping[str, int]) -> float:
    """XLA:GPU's buffers of a dropless mixture of experts beside a layer's backward working set. XLA
    lowers ``jax.lax.ragged_dot`` densely: each operand is masked once per local expert, ``[E/ep, M,
    K]``, and ``M`` is every row the device may receive, ``ep·T·k`` with the exchange's room for all
    of them (``T·k`` with ep 1; ``T`` the microbatch's tokens on the device, ``k`` the experts per
    token). :data:`GPU_EXPERT_COPIES` of them, as wide as the wider and the narrower of the hidden and
    the tp-local expert size. 0 on XLA:CPU (blocked grouped matmuls, counted by the trace), without
    experts, and with a capacity factor (batched matmuls over ``[E, C, d]``, counted by the trace)."""
    m = cfg.model
    if s.backend != "gpu" or not m.moe or m.capacity_factor > 0:
        return 0.0
    ep, tp, sp = (mesh_shape.get(a, 1) for a in ("ep", "tp", "sp"))
    rows = ep * s.b * max(1, cfg.training.seq_len // sp) * m.num_experts_per_tok
    sizes = sorted((m.hidden_size, m.expert_size // tp), reverse=True)
    width = GPU_EXPERT_COPIES[0] * sizes[0] + GPU_EXPERT_COPIES[1] * sizes[1]
    return (m.num_experts // ep) * rows * width * s.item


def _gpu_layerwise(s: _PeakShape) -> float:
    """XLA:GPU's buffers of ZeRO-2/3's layer-wise reduction beside a layer's backward working set:
    the layer's weight gradient in fp32 (the weight-gradient matmuls output fp32,
    :mod:`jaxcolossal.models.layers.linear`); with ``parallel.overlap`` the collective pipeliner moves each
    layer's reduce-scatter into the next iteration, so the previous layer's gradient is held too
    (else the reduce-scatter's 1/N output); under ZeRO-3 without the prefetching scan, the gathered
    weights of the layer, and with the pipeliner's all-gather the next layer's as well."""
    held = 2 if s.overlap else 1 + 1 / s.n
    gathered = (2 if s.overlap else 1) * s.layer_el * s.item if s.zero3 and not s.prefetch else 0.0
    return 4 * s.layer_el * held + gathered


def _cpu_copies(cfg: Config, s: _PeakShape, r: dict) -> float:
    """XLA:CPU's fp32 copies: in low precision the stage's layer weights converted (one layer under
    the prefetching scan; under ZeRO-3 the shards and one gathered layer), the interleaved ticks'
    chunk slices of both stacks, and the saved 16-bit residuals in fp32; in fp32, ZeRO-1/2's data
    shard of the layers sliced at the step's start. 0 on the GPU."""
    p = cfg.parallel
    if s.cpu_lowp:
        if s.prefetch:
            copies = 4 * s.layer_el
        elif p.zero_stage == 3 and s.n > 1:  # the shards are converted, then gathered one layer at a time
            copies = 4 * s.layer_el * s.stage / s.n + 4 * s.layer_el
        else:
            copies = 4 * s.layer_el * s.stage
        if s.lockstep and s.v > 1:  # each interleaved tick slices its chunk out of both stacks and converts it
            copies += 2 * 4 * s.layer_el * s.stage / s.v
        return copies + r["saved_16bit_layers"] * s.kept
    if s.backend == "cpu" and p.zero_stage in (1, 2) and s.n > 1:
        return 4 * s.layer_el * s.stage / s.n  # held through the step (buffer dumps)
    return 0.0


def _prefetch_buffers(s: _PeakShape) -> float:
    """ZeRO-3's prefetching scan: the current and the next layer gathered (on XLA:CPU in low
    precision only the next, the current one being in ``cpu_fp32``) and its copy of the stage's
    shards (the fp32 conversion there)."""
    if not s.prefetch:
        return 0.0
    gathered = 1 if s.cpu_lowp else 2
    shard_item = 4 if s.cpu_lowp else s.item
    return s.layer_el * s.stage * shard_item / s.n + gathered * s.layer_el * s.item


def _schedule_buffers(cfg: Config, s: _PeakShape, r: dict, grads: float, mesh_shape: Mapping[str, int]) -> dict:
    """The buffers the schedule adds: GPipe's backward copy of the tick's layer residuals and the
    chunk's gradients (``tick``); the lock-step schedules' chunk gradients in the compute dtype and
    their stash of ``2·v·p − 1`` stage inputs; without a pipeline, the compute-dtype gradients in
    low precision, or in fp32 with accumulation the microbatch's gradients beside the accumulator."""
    out = {"tick": 0.0, "grads_compute": 0.0, "stash": 0.0, "accumulator": 0.0, "hoisted": 0.0}
    if s.backend == "gpu" and s.pp == 1 and s.micro > 1 and (
            cfg.model.remat == "full" or (s.overlap and s.layerwise)):
        # the zero-initialised stacks of the layers' saved residuals are hoisted out of the microbatch
        # loop, a second copy: under remat=full at any stage (DeepSeek-V3's GRPO step, ZeRO-1, 8
        # microbatches: 9.5 GiB), and where the collective pipeliner peels the loop of ZeRO-2/3's
        # per-microbatch reduction
        out["hoisted"] = r["saved"] - r["head"]
    if s.pp > 1 and not s.lockstep:
        out["tick"] = r["saved"] - r["head"] + (r["saved_16bit_layers"] if s.cpu_lowp else 0.0) \
            + s.chunk_el * (4 if s.backend == "cpu" else s.item)
    if s.lockstep:
        # XLA:GPU adds each tick's chunk gradient into the stage's fp32 accumulator out of place: the
        # add's output, a second copy of the accumulator, is live beside the carried one
        out["grads_compute"] = grads if s.backend == "gpu" else s.grads_compute
        t = cfg.training
        out["stash"] = (2 * s.v * s.pp - 1) * s.b * (t.seq_len // mesh_shape.get("sp", 1)) * cfg.model.hidden_size * s.item
    elif s.pp == 1 and s.lowp:
        out["grads_compute"] = s.grads_compute
    elif s.pp == 1 and s.micro > 1:
        out["accumulator"] = grads
    return out


PART_NAMES = {"residuals": "saved residuals", "head": "the LM head's residuals", "layer": "one layer's backward",
              "experts": "XLA:GPU's dense grouped matmuls of the experts",
              "grads_compute": "compute-dtype gradients in flight", "accumulator": "the microbatch's fp32 gradients",
              "zero3": "ZeRO-3 prefetch buffers", "stash": "pipeline stash",
              "cpu_fp32": "XLA:CPU's fp32 copies of weights and residuals", "tick": "GPipe's tick copy and chunk gradients",
              "hoisted": "a second copy of the saved residuals' stacks (XLA:GPU, accumulation under remat=full or ZeRO-2/3)"}


HEAD_PARTS = ("residuals", "head", "cpu_fp32", "zero3", "accumulator", "stash")  # what :func:`step_peak` sums in the head's phase


def describe(peak: dict) -> str:
    """One line naming :func:`step_peak`'s non-zero parts (MiB/GiB) and its phase."""
    keys = HEAD_PARTS if peak["phase"] == "head" else [k for k in PART_NAMES if k != "head"]
    parts = ", ".join(f"{PART_NAMES[k]} {gib(peak[k])}" for k in keys if peak.get(k))
    where = {"backward": "backward pass", "head": "LM head's backward", "update": "optimizer update"}[peak["phase"]]
    text = f"peak in the {where}; activations and temporaries: {parts}"
    if peak["phase"] != "update" and not peak.get("fp32_grads_live", True):
        text += (" (the fp32 gradients are made after this phase, so these parts add up to the activations"
                 " and the fp32 gradients' bytes together)")
    return text
