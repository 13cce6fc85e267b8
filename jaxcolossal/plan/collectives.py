"""The planner's communication model: the collectives of one train step by kind and mesh axis, with
the bytes each device sends (ring counts, as :attr:`jaxcolossal.aot.hlo.Collective.sent`), as XLA's GPU
(or, for simulated devices, CPU) pipeline emits them. Checked per kind against compiled steps
(``tests/unit/test_planner.py``)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import jax

from jaxcolossal.config import BYTES_PER_PARAM, WIRE_BYTES, Config, prefetches_weights, weight_gather_dtype
from jaxcolossal.memory.budget import layout
from jaxcolossal.memory.placement import local_elements
from jaxcolossal.metrics import param_count
from jaxcolossal.models import adapter_layout, get_family, param_layout
from jaxcolossal.parallel.compression import powersgd_views, powersgd_wire, wire_bytes
from jaxcolossal.parallel.pipeline_schedule import pipeline_schedule_for


def ring_factor(n: int) -> float:
    """Bytes each device sends per byte of a ring all-gather / reduce-scatter over ``n`` devices."""
    return (n - 1) / n if n > 1 else 0.0


def dp_gradient_bytes(cfg: Config, dp: int, tp: int = 1, pp: int = 1, k: int | None = None) -> float:
    """Bytes each device sends per step for the data-parallel gradient reduction (ring counts, as
    :attr:`jaxcolossal.aot.hlo.Collective.sent`), with the ``parallel`` section's communication
    settings (docs/communication.md):

    * fp32: ZeRO-0 an all-reduce ``2(N−1)/N·4Ψ``; ZeRO-1 a reduce-scatter ``(N−1)/N·4Ψ``, ZeRO-2/3
      one per microbatch (``k``);
    * ``communication_dtype`` bf16/fp8: the same with 2 / 1 bytes per element (an all-to-all, plus
      the all-gather under ZeRO-0; fp8's per-shard scales are left out);
    * ``powersgd``: all-reduces of the rank-r factors, plus the leaves sent whole;
    * ``topk``: all-gathers of ``N·k`` values and int32 indices per leaf.

    ``Ψ`` is per model-parallel shard (``/(tp·pp)``; under LoRA the adapters'); ``k`` defaults to the
    accumulation steps. A mixture of experts reduces inside the backward at every ZeRO stage (an
    all-reduce per microbatch for ZeRO 0–1), its routed experts (``1/ep`` of them per device) over
    the data group without ``ep``.
    """
    p = cfg.parallel
    k = cfg.training.gradient_accumulation_steps if k is None else k
    ring = ring_factor(dp)
    if p.gradient_compression != "none":  # the result bytes compression.py predicts, times the ring factor
        _, shapes, axes = param_layout(cfg.model, 1)
        if p.gradient_compression == "powersgd":
            return 2 * ring * powersgd_wire(powersgd_views(shapes, axes, p.powersgd_rank), shapes,
                                            p.powersgd_rank)["powersgd"]
        return ring * wire_bytes(shapes, p.compression_ratio, dp)["topk"]
    psi = param_count(cfg.model)["total"] / (tp * pp)
    if cfg.model.lora.enabled:  # only the adapters have gradients
        _, shapes, axes = param_layout(cfg.model, 1)
        psi = sum(math.prod(s) for s in jax.tree.leaves(adapter_layout(cfg.model, shapes, axes)[0],
                                                        is_leaf=lambda x: isinstance(x, tuple))) / (tp * pp)
    b = WIRE_BYTES[p.communication_dtype]
    if cfg.model.moe:  # reduced inside the backward at every stage; the experts over the data group without ep
        n, ep = param_count(cfg.model), p.expert_parallel_size
        times = k * (1 if p.zero_stage >= 2 else 2)  # a reduce-scatter, or an all-reduce, per microbatch
        return times * b * (ring * (n["total"] - n["routed"]) + ring_factor(dp // ep) * n["routed"] / ep) / (tp * pp)
    if p.zero_stage == 0:
        return 2 * ring * b * psi
    return ring * b * psi * (k if p.zero_stage >= 2 else 1)


BACKENDS = ("gpu", "cpu")


def collective_terms(cfg: Config, num_devices: int, backend: str = "gpu") -> list[tuple[str, str, float, str]]:
    """The collectives of one train step, as ``(kind, mesh axis, bytes each device sends, what)``
    terms (ring counts, as :attr:`jaxcolossal.aot.hlo.Collective.sent`; :func:`collective_bytes` sums
    them per kind). ``N`` the data group, ``k`` the microbatches, ``b·s`` the tokens of one
    microbatch per data shard, ``d`` the hidden size, ``Ψ_t`` the parameters per tp (and pp) shard,
    ``E`` the embedding table's share of it:

    * the gradient reduction: ZeRO-0 an all-reduce of ``4Ψ_t`` per step; ZeRO-1 a reduce-scatter;
      ZeRO-2/3 one per microbatch, of everything but the embedding, whose gradient comes from the
      microbatch's tokens (all-gathered, int32) and its ``b·s·d`` cotangent (an all-to-all)
      instead; with ``communication_dtype`` or compression, :func:`dp_gradient_bytes`;
    * the parameter all-gathers: ZeRO-1/2 ``Ψ_t`` once per step after the update; ZeRO-3 each
      layer's weights twice per microbatch (forward and backward; with the prefetch, ``k·L + 1``
      per pass: the first layer's gather is the same for every microbatch), in
      ``communication_dtype`` where narrower (qwZ), the head once per step, and the embedding
      lookup as its gradient (tokens and an all-to-all, per microbatch);
    * Megatron TP over ``t``, per microbatch: the vocab-parallel embedding's and the head's
      ``b·s·d`` all-reduces, the cross-entropy's three ``b·s`` ones, and per layer 2 in the
      forward, one per column-parallel projection's input gradient in the backward (2 where XLA
      reassociates them: its GPU pipeline), and 1 more with ``remat=full`` (the attention's; the
      MLP's output is not recomputed); under Megatron-SP each becomes an all-gather and a
      reduce-scatter, each gather done again in the backward for the weights' gradients (TP
      collective matmul: one ring of ``t − 1`` permutes per projection, 4 forward, 4 backward, 3
      redone under ``remat=full``; the embedding and head then 3 gathers and 2 all-reduces);
    * sp: Ulysses' four all-to-alls per layer (q, k, v to heads, the output back), forward and
      backward; ring attention's k/v hops, below;
    * pp: an activation forward and a gradient backward per schedule tick, idle or not
      (collective-permutes); with tp, Megatron's all-reduces in every tick (GPipe: 2 forward in
      its forward ticks and the backward's in its backward ticks; 1F1B and interleaved: the
      forward again in the backward); ZeRO 1–3 reduce once per step with the pipeline's own
      reduce-scatter (with tp an all-reduce and a slice) and gather once; the leaves every stage
      holds have their gradients all-reduced over pp; the interleaved schedule also moves the
      stage's layer weights into its chunks and their gradients back (all-to-alls over pp);
    * sp (ring attention): the k/v hops, ``sp − 1`` per layer forward and as many backward, and
      the gradient all-reduce over sp.

    ``backend``: ``gpu`` (default) or ``cpu``, what XLA's pipeline of that backend makes of the
    same program: the CPU's has no ReduceScatterCreator and no AllReduceReassociate (so every
    reduce-scatter is an all-reduce and a slice, and each projection's input gradient is
    all-reduced on its own), and it promotes bf16 collectives to fp32 (AllReducePromotion,
    FloatNormalization; ``xla/service/cpu/cpu_compiler.cc``). Checked per kind against the
    compiled CPU step's HLO (``tests/unit/test_planner.py``: 18 layouts, every kind within 5%).

    Raises:
        ValueError: an unknown ``backend``.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    st = _step(cfg, num_devices, backend == "cpu")
    if st.n > 1:
        _gradient_terms(st)
        _embedding_terms(st)
        _gather_terms(st)
    if st.tp > 1:
        _tp_terms(st)
    if st.pp > 1:
        _pp_terms(st)
    if st.sp > 1:
        _sp_terms(st)
    if st.ep > 1:
        _ep_terms(st)
    return st.terms


@dataclass
class _Step:
    """The quantities of one step that the collective terms are written in (per device)."""

    cfg: Config
    cpu: bool
    n: int            # the data group
    tp: int
    pp: int
    sp: int
    ep: int           # expert parallelism (a mixture of experts; 1 otherwise)
    k: int            # microbatches
    ticks: int        # pipeline ticks (0 without a pipeline)
    layers: int       # layers per stage
    a_bytes: int      # an activation element (fp32 on the CPU's promoted collectives)
    p_bytes: int      # a compute parameter
    psi: float        # parameters per tp (and pp) shard
    embed: float      # the embedding table's share of it
    per_layer: float
    shared: float     # embedding, head, final norm
    rows: int         # b: per data shard and microbatch
    tokens: int       # b·s/sp
    act: float        # one [b, s, d] activation, bytes
    terms: list = field(default_factory=list)

    def add(self, kind: str, axis: str, nbytes: float, what: str) -> None:
        """One term, kept where its axis has more than one device and it moves bytes."""
        if {"dp": self.n, "tp": self.tp, "sp": self.sp, "pp": self.pp, "ep": self.ep}[axis] > 1 and nbytes:
            self.terms.append((kind, axis, nbytes, what))


def _last_key(path) -> str:
    """The name of a tree path's last key."""
    return str(getattr(path[-1], "key", path[-1]))


def _in_layers(path) -> bool:
    """Whether a tree path runs through the stacked ``layers``."""
    return any(getattr(q, "key", None) == "layers" for q in path)


def _step(cfg: Config, num_devices: int, cpu: bool) -> _Step:
    p, m, t = cfg.parallel, cfg.model, cfg.training
    rp = p.resolve(num_devices)
    n, tp, pp, sp = rp.data_parallel_size, rp.tensor_parallel_size, rp.pipeline_parallel_size, rp.sequence_parallel_size
    shape, _, shapes, specs = layout(cfg, num_devices)
    k, ticks = t.gradient_accumulation_steps, 0
    if pp > 1:
        sched = pipeline_schedule_for(cfg, pp)
        k, ticks = sched.m, sched.num_ticks
    layers = m.num_layers // pp

    def wide(nbytes):  # the CPU's fp32 promotion
        return 4 if cpu and nbytes == 2 else nbytes

    a_bytes = wide(2 if cfg.precision.mode != "fp32" else 4)
    flat = jax.tree_util.tree_flatten_with_path(local_elements(shapes, specs.base, shape))[0]
    psi = sum(e for _, e in flat)
    per_layer = sum(e for path, e in flat if _in_layers(path)) / max(layers, 1)
    rows = t.batch_size // (n * k)
    tokens = rows * t.seq_len // sp
    return _Step(cfg=cfg, cpu=cpu, n=n, tp=tp, pp=pp, sp=sp, ep=shape["ep"] if m.moe else 1, k=k, ticks=ticks, layers=layers, a_bytes=a_bytes,
                 p_bytes=wide(BYTES_PER_PARAM[cfg.precision.mode]["p"]), psi=psi,
                 embed=sum(e for path, e in flat if _last_key(path) in ("embed_tokens", "wte", "wpe")),
                 per_layer=per_layer, shared=psi - per_layer * layers, rows=rows, tokens=tokens,
                 act=tokens * m.hidden_size * a_bytes)


def _gradient_terms(st: _Step) -> None:
    """The data group's gradient reduction: once per step (ZeRO 0/1, any pipeline) or per microbatch
    (ZeRO 2/3), or with ``communication_dtype`` / compression :func:`dp_gradient_bytes`."""
    p, ring, n = st.cfg.parallel, ring_factor, st.n
    zero = p.zero_stage
    if p.gradient_compression != "none" or p.communication_dtype != "fp32":
        kind = {"topk": "all-gather", "powersgd": "all-reduce"}.get(p.gradient_compression, "all-to-all")
        st.add(kind, "dp", dp_gradient_bytes(st.cfg, n, st.tp, st.pp, st.k), "gradient reduction")
    elif zero <= 1 or st.pp > 1:  # once per step (a pipeline reduces every ZeRO stage once per step)
        # the pipeline's ZeRO 1-3 is a psum_scatter of its own; with tp, an all-reduce and a slice
        summed = st.pp > 1 and (zero == 0 or st.tp > 1)
        rs = zero >= 1 and (not st.cpu or st.pp > 1) and not summed
        own = st.psi - (st.shared if summed else 0)  # the stages' shared leaves: summed over pp, below
        st.add("reduce-scatter" if rs else "all-reduce", "dp", (1 if rs else 2) * ring(n) * 4 * own,
               "gradient reduction")
    else:
        rest = st.psi - (st.embed if st.tp == 1 else 0)  # a vocab-parallel embedding's gradient is reduced too
        st.add("all-reduce" if st.cpu else "reduce-scatter", "dp", st.k * (2 if st.cpu else 1) * ring(n) * 4 * rest,
               "gradient reduction, per microbatch")


def _embedding_terms(st: _Step) -> None:
    """ZeRO-2/3's embedding gradient (and ZeRO-3's lookup): the microbatch's tokens and its rows."""
    p, ring, n = st.cfg.parallel, ring_factor, st.n
    zero = p.zero_stage
    lowp = p.communication_dtype != "fp32"  # the embedding's gradient is then in the gradient reduction
    if zero >= 2 and st.embed and st.tp == 1 and st.pp == 1 and (zero == 3 or not lowp):
        times = st.k * ((2 if zero == 3 else 1) - (1 if lowp else 0))
        st.add("all-gather", "dp", times * ring(n) * 4 * n * st.rows * st.cfg.training.seq_len, "embedding: the tokens")
        st.add("all-to-all", "dp", times * ring(n) * st.act, "embedding: the [b, s, d] rows")


def _gather_terms(st: _Step) -> None:
    """The parameter all-gathers: ZeRO-1/2 after the update, ZeRO-3 per layer and microbatch."""
    cfg, ring, n = st.cfg, ring_factor, st.n
    zero = cfg.parallel.zero_stage
    if zero in (1, 2) or (zero == 3 and st.pp > 1):  # (a pipeline's ZeRO-3: the stage's weights, once per step)
        st.add("all-gather", "dp", ring(n) * st.p_bytes * st.psi, "parameters after the update")
    if zero == 3 and st.pp == 1:
        lowp = weight_gather_dtype(cfg, n)
        w_bytes = WIRE_BYTES[lowp] if lowp else st.p_bytes
        gathers = 2 * (st.k * st.layers + 1) if prefetches_weights(cfg) else 2 * st.k * st.layers
        st.add("all-gather", "dp", gathers * ring(n) * w_bytes * st.per_layer, "ZeRO-3 layer weights")
        # the head and final norm: once per step (the gather is loop-invariant), but with a compute
        # dtype narrower than the params' and a remat policy, once more per microbatch (as compiled)
        heads = 1 + (st.k if cfg.precision.mode != "fp32" and cfg.model.remat != "none" else 0)
        st.add("all-gather", "dp", heads * ring(n) * st.p_bytes * (st.shared - st.embed), "ZeRO-3 head and norm")


def _tp_terms(st: _Step) -> None:
    """Megatron TP's activation all-reduces (Megatron-SP's gathers and reduce-scatters, or the TP
    collective matmul's rings) and the vocab-parallel cross-entropy's."""
    p, m, t, ring, tp, k = st.cfg.parallel, st.cfg.model, st.cfg.training, ring_factor, st.tp, st.k
    table = get_family(m).param_shapes_and_axes(m, m.vocab_size)["layers"]
    column = sum(1 for sh, ax in table.values() if len(ax) >= 3 and ax[1] == "embed")
    full = m.remat == "full"
    per = 2 + (column if st.cpu else 2) + (1 if full else 0)  # all-reduces per layer: forward, backward, redone
    count = k * (per * st.layers + 2)
    if st.pp > 1:
        # a pipeline tick runs its chunk's forward and backward under a cond (GPipe: the forward ticks,
        # then the backward ticks, from stashed activations; 1F1B and interleaved: both in every tick, the
        # forward again in the backward), on idle ticks too as far as the program says
        v = p.num_model_chunks if p.pipeline_schedule == "interleaved" else 1
        per += 0 if p.pipeline_schedule == "gpipe" else 2
        st.add("all-reduce", "tp", st.ticks * (per * st.layers / v + 2) * 2 * ring(tp) * st.act,
               "Megatron TP activations")
    elif p.sequence_parallelism_mode == "split_gather":
        if p.overlap and t.seq_len >= p.collective_matmul_min_seq:  # 4 rings forward, 4 backward, 3 redone
            st.add("collective-permute", "tp", k * st.layers * (8 + (3 if full else 0)) * ring(tp) * st.act,
                   "TP collective matmul")
            st.add("all-gather", "tp", k * 3 * ring(tp) * st.act, "Megatron-SP: embedding and head")
            st.add("all-reduce", "tp", k * 2 * 2 * ring(tp) * st.act, "Megatron-SP: embedding and head")
        else:  # each all-reduce a reduce-scatter; the gathers also again for the weights' gradients
            gathers = k * ((per + 1 + (1 if full else 0)) * st.layers + 3)
            st.add("all-gather", "tp", gathers * ring(tp) * st.act, "Megatron-SP")
            st.add("all-reduce" if st.cpu else "reduce-scatter", "tp", count * (2 if st.cpu else 1) * ring(tp) * st.act,
                   "Megatron-SP")
    else:
        st.add("all-reduce", "tp", count * 2 * ring(tp) * st.act, "Megatron TP activations")
    st.add("all-reduce", "tp", (st.ticks if st.pp > 1 else k) * 3 * 2 * ring(tp) * st.tokens * 4,
           "vocab-parallel cross-entropy")


def _pp_terms(st: _Step) -> None:
    """The pipeline's sends, the interleaved schedule's re-layout, the shared leaves' gradients."""
    p, ring, n, pp = st.cfg.parallel, ring_factor, st.n, st.pp
    zero = p.zero_stage
    st.add("collective-permute", "pp", 2 * st.ticks * st.act, "pipeline: an activation and a gradient per tick")
    if p.pipeline_schedule == "interleaved":  # the stage's layers re-laid out into chunks, and back
        stage = 4 * st.per_layer * st.layers
        st.add("all-to-all", "pp",
               ring(pp) * stage * (st.p_bytes / 4 / (n if zero == 3 else 1) + (1 / n if zero >= 1 else 1)),
               "interleaved: the layers into chunks and their gradients back")
    # the embedding, head and final norm, held by every stage: their gradients summed over pp (over
    # the data group too in the same all-reduce under ZeRO-0, and ZeRO-1 with tp)
    group = pp * (n if zero == 0 or st.tp > 1 else 1)
    st.add("all-reduce", "pp", 2 * ring(group) * 4 * st.shared, "pipeline: shared leaves' gradients")


def _sp_terms(st: _Step) -> None:
    """Ulysses' all-to-alls or ring attention's k/v hops, and the gradients' all-reduce over sp."""
    p, m, ring, sp, k = st.cfg.parallel, st.cfg.model, ring_factor, st.sp, st.k

    dq, dv = m.attention_dims  # head_dim both, but for multi-head latent attention

    def heads(h, d=m.head_dim):  # bytes of one [b, s/sp, h, d]
        return st.tokens * h * d * st.a_bytes / max(st.tp, 1)

    if p.sequence_parallelism_mode == "all_to_all":  # Ulysses: q, k, v to heads and the output back, per
        h, kv = m.num_attention_heads, m.num_key_value_heads  # layer, fwd + bwd
        st.add("all-to-all", "sp", 2 * st.layers * k * ring(sp) * (heads(h, dq) + heads(h, dv) + heads(kv, dq)
                                                                   + heads(kv, dv)), "Ulysses")
    else:
        st.add("collective-permute", "sp", 2 * st.layers * k * (sp - 1) * 2 * heads(m.num_key_value_heads),
               "ring attention k/v, forward and backward")
    st.add("all-reduce", "sp", 2 * ring(sp) * 4 * st.psi, "gradients over sp")


def expert_all_to_all_bytes(cfg: Config, tokens: int, ep: int, cpu: bool = False) -> float:
    """Bytes each device sends per MoE layer and microbatch in the experts' all-to-alls over ``ep``
    (:mod:`jaxcolossal.parallel.expert`), for ``tokens`` tokens on the device: dropless, the packed
    ``[ep, T·k, d]`` tokens out and the results back, forward and backward, and the ``[ep, T·k]``
    int32 expert ids out in the forward; with a capacity factor the ``[E, C, d]`` buffers the same
    four times. A remat policy recomputes the forward's in the backward. ``cpu``: XLA:CPU moves
    16-bit all-to-alls in fp32."""
    m = cfg.model
    slots = tokens * m.num_experts_per_tok
    a = 4 if cfg.precision.mode == "fp32" or cpu else 2
    passes = 2 if m.remat == "none" else 3  # forward, backward (and the forward again)
    if m.capacity_factor > 0:
        cap = max(1, math.ceil(m.capacity_factor * slots / m.num_experts))
        return ring_factor(ep) * 2 * (passes * m.num_experts * cap * m.hidden_size * a)
    data = 2 * passes * ep * slots * m.hidden_size * a
    ids = (passes - 1) * ep * slots * 4
    return ring_factor(ep) * (data + ids)


def _ep_terms(st: _Step) -> None:
    """A mixture of experts' token exchange over ep (:func:`expert_all_to_all_bytes`), per MoE layer and microbatch."""
    m = st.cfg.model
    st.add("all-to-all", "ep", st.k * m.moe_layers * expert_all_to_all_bytes(st.cfg, st.tokens, st.ep, st.cpu),
           "experts' dispatch and combine")


def collective_bytes(cfg: Config, num_devices: int, backend: str = "gpu") -> dict[str, float]:
    """Bytes each device sends per step, per collective kind (:func:`collective_terms` summed):
    ``{kind: bytes}``, the kinds of :data:`jaxcolossal.aot.hlo.COLLECTIVES` that occur."""
    out: dict[str, float] = {}
    for kind, _, b, _ in collective_terms(cfg, num_devices, backend):
        out[kind] = out.get(kind, 0.0) + b
    return out


def collective_count(cfg: Config, num_devices: int) -> int:
    """Collectives one device takes part in per step, each paying :attr:`Device.latency` once
    (the α term; the bytes are costed separately). ``L`` layers per stage, ``k`` microbatches,
    ``n`` parameter leaves:

    * data parallel: ZeRO-0/1 one reduction per leaf per step; ZeRO-2/3 one per layer (+ the
      embedding and the head) per microbatch, inside the backward scan; ZeRO-1/2 one parameter
      all-gather per leaf after the update; ZeRO-3 two gathers per layer per microbatch
      (forward and backward);
    * tp: Megatron's 2 all-reduces per layer forward and 2 backward per microbatch, 2 more with a
      remat policy that recomputes the forward; under Megatron-SP each is an all-gather and a
      reduce-scatter, and with the TP collective matmul each of those a ring of tp − 1 permutes;
    * pp: a send each way per schedule tick; sp (ring attention): ``sp − 1`` hops per layer,
      forward and twice backward.
    """
    rp = cfg.parallel.resolve(num_devices)
    dp, tp, pp, sp = (rp.data_parallel_size, rp.tensor_parallel_size, rp.pipeline_parallel_size,
                      rp.sequence_parallel_size)
    zero, m = cfg.parallel.zero_stage, cfg.model
    k = cfg.training.gradient_accumulation_steps
    ticks = 0
    if pp > 1:
        sched = pipeline_schedule_for(cfg, pp)
        k, ticks = sched.m, sched.num_ticks
    layers = m.num_layers // pp
    leaves = len(jax.tree.leaves(param_layout(m, 1)[1], is_leaf=lambda x: isinstance(x, tuple)))
    count = 0
    if dp > 1:
        count += leaves if zero <= 1 else k * (layers + 2)
        count += leaves if zero in (1, 2) else 2 * k * (layers + 2) if zero == 3 else 0
    if tp > 1:
        per_layer = 4 + (2 if m.remat != "none" else 0)  # all-reduces: 2 forward, 2 backward, 2 recomputed
        if cfg.parallel.sequence_parallelism_mode == "split_gather":  # each an all-gather + a reduce-scatter
            per_layer *= 2
            if cfg.parallel.overlap and cfg.training.seq_len >= cfg.parallel.collective_matmul_min_seq:
                per_layer *= tp - 1  # TP collective matmul: each a ring of tp − 1 permutes
        count += k * layers * per_layer
    count += 2 * ticks
    if sp > 1:
        count += 3 * k * layers * (sp - 1)
    return count
