"""The one place that decides sharding.

Model code names *logical* axes (``batch``, ``seq``, ``embed``, ``mlp``, ``heads``,
``kv_heads``, ``head_dim``, ``vocab``, ``layers``, ``stage``); :data:`RULES` maps them to mesh
axes (MaxText's ``logical_axis_rules``). ZeRO is a second, tiny rule on top: the ZeRO stage
decides which parts of the train state get the ``embed`` dimension sharded over ``fsdp``
(Rajbhandari et al., 2020; the ZeRO formulas (docs/zero.md)):

=====  =========================  ======================  ====================
stage  parameters (compute copy)  gradients               optimizer state (+ fp32 master)
=====  =========================  ======================  ====================
0      tp only                    tp only (all-reduce)    tp only
1      tp only                    tp only (all-reduce)    + fsdp
2      tp only                    + fsdp (reduce-scatter) + fsdp
3      + fsdp (all-gathered)      + fsdp                  + fsdp
=====  =========================  ======================  ====================

Switching ZeRO stage or turning on tensor parallelism changes these tables, never model code.
Tensor parallelism follows Megatron-LM (Shoeybi et al., 2019): q/k/v and gate/up are
column-parallel (output dim on ``tp``), o and down are row-parallel (input dim on ``tp``), and the
embedding and LM head are vocab-parallel.

Sequence parallelism (``parallel.sequence_parallelism_mode``, :mod:`jaxcolossal.parallel.sequence`) is a
change of rules too (:func:`rules_for`): ``seq`` goes to ``tp`` (``split_gather``, Megatron-SP) or
to ``sp`` (``all_to_all``, ``ring_attn``; attention itself is then a ``shard_map`` over ``sp``,
:mod:`jaxcolossal.parallel.sequence`). ``seq`` yields: in an array where another dimension already uses a mesh
axis (the heads of q under Megatron-SP), ``seq`` drops it, so XLA gathers the sequence there.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcolossal.config import ConfigError
from jaxcolossal.parallel.mesh import DATA_AXES, EP_AXIS, MESH_AXES, ZERO_AXIS, entry_axes  # noqa: F401  (re-exported: the sharding vocabulary)

ZERO_LOGICAL_AXIS = "embed"

RULES: dict[str, Any] = {
    "batch": DATA_AXES,
    "seq": None,
    "embed": None,
    "head_dim": None,
    "heads": "tp",
    "kv_heads": "tp",
    "mlp": "tp",
    "vocab": "tp",
    "layers": None,
    "stage": "pp",
    "lora_rank": None,
    "latent": None,  # multi-head latent attention's compressed ranks (DeepSeek): every tp rank expands its heads from all of it
    "expert": "ep",
    "zero": ZERO_AXIS,
}
"""Logical axis -> mesh axis (or tuple of mesh axes, or None = replicated). ``zero`` is no array
dimension: it names the mesh axes ZeRO shards the state over (:func:`zero_spec`)."""

ZERO_RULE = "zero"
"""The rules-table entry of the mesh axes ZeRO shards over: ``fsdp``, or with expert parallelism
``("fsdp", "ep")`` (:func:`rules_for`)."""

YIELDING = ("seq",)
"""Logical axes that give up a mesh axis that another dimension of the same array uses."""


def is_spec(x: Any) -> bool:
    """Whether ``x`` is a ``PartitionSpec``: the ``is_leaf`` of a tree of specs (a spec is a tuple,
    which ``jax.tree`` would otherwise walk into)."""
    return isinstance(x, P)


def is_named_sharding(x: Any) -> bool:
    """Whether ``x`` is a ``NamedSharding``: the ``is_leaf`` of a tree of shardings."""
    return isinstance(x, NamedSharding)


def is_shape(x: Any) -> bool:
    """Whether ``x`` is a shape, a tuple of ints: the ``is_leaf`` of a param-shapes tree."""
    return isinstance(x, tuple) and all(isinstance(i, int) for i in x)


def _is_tuple(x: Any) -> bool:
    """The ``is_leaf`` of a tree of logical-axis tuples."""
    return isinstance(x, tuple)


def rules_for(parallel, pipeline: bool = False) -> dict[str, Any]:
    """The rules table for a (resolved) ``ParallelConfig``: :data:`RULES` with the sequence-parallel
    mode's changes, and ``layers`` on ``pp`` when ``pipeline``.

    ==============  ==============  ==========================================
    mode            ``seq``         attention inside
    ==============  ==============  ==========================================
    none            replicated      as outside
    split_gather    ``tp``          full sequence, heads on ``tp`` (XLA gathers)
    all_to_all      ``sp``          full sequence, heads on ``tp`` × ``sp`` (explicit all-to-all)
    ring_attn       ``sp``          blocks of the sequence, k/v passed around (explicit ppermute)
    ==============  ==============  ==========================================
    """
    rules = dict(RULES)
    mode = getattr(parallel, "sequence_parallelism_mode", "none")
    if mode == "split_gather":
        rules["seq"] = "tp"
    elif mode in ("all_to_all", "ring_attn"):
        rules["seq"] = "sp"
    if pipeline:
        rules["layers"] = "pp"
    if getattr(parallel, "expert_parallel_size", 1) > 1 and getattr(parallel, "pipeline_parallel_size", 1) == 1:
        rules[ZERO_RULE] = (ZERO_AXIS, EP_AXIS)  # MoE: the dense state over the whole data group
    return rules


LogicalAxes = tuple  # tuple[str | None, ...], one name per array dimension


def logical_to_spec(axes: Sequence[str | None], rules: Mapping[str, Any] = RULES) -> P:
    """Map logical axis names to a ``PartitionSpec``.

    Raises:
        KeyError: an axis name that the rules table does not know.
    """
    out = []
    for a in axes:
        if a is None:
            out.append(None)
        elif a not in rules:
            raise KeyError(f"logical axis {a!r} is not in the rules table {sorted(rules)}")
        else:
            out.append(rules[a])
    for i, a in enumerate(axes):  # a yielding axis drops the mesh axes that another dimension uses
        if a in YIELDING and out[i] is not None:
            used = {m for j, e in enumerate(out) if j != i for m in entry_axes(e)}
            kept = tuple(m for m in entry_axes(out[i]) if m not in used)
            out[i] = None if not kept else kept[0] if len(kept) == 1 else kept
    return P(*out)


def _axis_size(mesh_shape: Mapping[str, int], entry) -> int:
    if entry is None:
        return 1
    if isinstance(entry, str):
        return mesh_shape.get(entry, 1)
    return math.prod(mesh_shape.get(e, 1) for e in entry)


def check_divisible(name: str, shape: Sequence[int], spec: P, mesh_shape: Mapping[str, int]) -> None:
    """Raise ``ConfigError`` if a mesh axis does not divide the dimension it shards.

    We never replicate silently: a dimension that its axis does not divide is an error.
    """
    for dim, (size, entry) in enumerate(zip(shape, tuple(spec) + (None,) * len(shape))):
        n = _axis_size(mesh_shape, entry)
        if size % n:
            raise ConfigError(
                f"parameter {name!r} dim {dim} of size {size} cannot be split over mesh axes {entry} "
                f"of size {n}; choose sizes that divide (see the sharding rules table)")


def zero_groups(base: Sequence, rules: Mapping[str, Any]) -> list[tuple[str, ...]]:
    """The mesh axes ZeRO may shard one leaf over, first choice first: the rules' ``zero`` entry
    less the axes the leaf's ``base`` spec already uses, then ``fsdp`` alone.

    With expert parallelism (``zero`` = ``("fsdp", "ep")``) a dense leaf's state is sharded over the
    whole data group and a routed expert's (whose expert dimension is on ``ep``) over the data group
    less ``ep``, as Colossal-AI's MoE plugin does (its ``moe_dp_group``); ``fsdp`` alone is the
    fall-back for a dense leaf that no dimension of can be split over the whole group."""
    used = {m for e in base for m in entry_axes(e)}
    groups = []
    for group in (entry_axes(rules.get(ZERO_RULE, ZERO_AXIS)), (ZERO_AXIS,)):
        kept = tuple(a for a in group if a not in used)
        if kept and kept not in groups:
            groups.append(kept)
    return groups


def zero_spec(name: str, axes: Sequence[str | None], shape: Sequence[int], mesh_shape: Mapping[str, int],
              rules: Mapping[str, Any] = RULES) -> P:
    """The spec of a parameter-shaped leaf with its ZeRO dimension sharded over the ZeRO axes
    (:func:`zero_groups`: ``fsdp``, with expert parallelism ``fsdp`` × ``ep`` for dense leaves).

    The ZeRO dimension is the ``embed`` dimension (every LLaMA/GPT-2 weight matrix has one); a
    leaf without one (a bias) falls back to the first unsharded dimension that the group divides,
    then to a ``tp``-sharded dimension split further over ``("tp", *group)``. The ZeRO axes always
    come last in their entry (:func:`one_layer_specs` relies on it).

    Raises:
        ConfigError: if no dimension can be split evenly over ``fsdp``.
    """
    base = list(logical_to_spec(axes, rules))
    for group in zero_groups(base, rules):
        if _axis_size(mesh_shape, group) == 1:  # nothing (left) to shard over
            return P(*base)
        spec = _zero_dimension(base, axes, shape, mesh_shape, group)
        if spec is not None:
            return spec
    n = mesh_shape.get(ZERO_AXIS, 1)
    raise ConfigError(
        f"ZeRO cannot shard parameter {name!r} of shape {tuple(shape)} over fsdp={n}: "
        "no dimension is divisible; change the data-parallel size or the model sizes")


def _zero_dimension(base: list, axes: Sequence[str | None], shape: Sequence[int], mesh_shape: Mapping[str, int],
                    group: tuple[str, ...]) -> P | None:
    """``base`` with one dimension split over ``group`` (:func:`zero_spec`'s order), or ``None``."""
    n, entry = _axis_size(mesh_shape, group), group[0] if len(group) == 1 else group
    candidates = [i for i, a in enumerate(axes) if a == ZERO_LOGICAL_AXIS]
    candidates += [i for i, e in enumerate(base) if e is None and i not in candidates]
    for i in candidates:
        if base[i] is None and shape[i] % n == 0:
            return P(*base[:i], entry, *base[i + 1:])
    # last resort: split a dimension that tensor parallelism already splits further over the group
    for i, e in enumerate(base):
        if e is not None:
            names = entry_axes(e)
            if shape[i] % (_axis_size(mesh_shape, names) * n) == 0:
                return P(*base[:i], names + group, *base[i + 1:])
    return None


@dataclass(frozen=True)
class StateSpecs:
    """PartitionSpecs of one train state, per role, for a given ZeRO stage.

    Attributes:
        params: the compute-dtype parameters used in the forward/backward.
        grads: the fp32 gradient (accumulation) buffer.
        opt: optimizer moments and the fp32 master weights.
        base: tensor parallelism only (no ZeRO axis): per-data-shard buffers use this.
    """

    params: Any
    grads: Any
    opt: Any
    base: Any


def state_specs(param_axes: Any, param_shapes: Any, zero_stage: int, mesh_shape: Mapping[str, int],
                rules: Mapping[str, Any] = RULES) -> StateSpecs:
    """Specs for params / grads / optimizer state as the ZeRO stage prescribes (table above).

    Args:
        param_axes: pytree of logical-axis tuples, one per parameter.
        param_shapes: same pytree of shapes (tuples of ints).
        zero_stage: 0, 1, 2 or 3.
        mesh_shape: ``{axis name: size}``.

    Raises:
        ConfigError: a dimension that its mesh axes do not divide.
    """
    paths = jax.tree_util.tree_flatten_with_path(param_axes, is_leaf=_is_tuple)[0]
    names = jax.tree.unflatten(jax.tree.structure(param_axes, is_leaf=_is_tuple),
                               [jax.tree_util.keystr(p) for p, _ in paths])

    def base(name, axes, shape):
        spec = logical_to_spec(axes, rules)
        check_divisible(name, shape, spec, mesh_shape)
        return spec

    def zero(name, axes, shape):
        return zero_spec(name, axes, shape, mesh_shape, rules)

    def pick(sharded):
        fn = zero if sharded else base
        return jax.tree.map(fn, names, param_axes, param_shapes, is_leaf=_is_tuple)

    return StateSpecs(params=pick(zero_stage >= 3), grads=pick(zero_stage >= 2), opt=pick(zero_stage >= 1),
                      base=pick(False))


class Sharder:
    """Applies activation sharding constraints from logical names; a no-op without a mesh.

    ``shard(x, ("batch", "seq", "embed"))`` is what model code calls. ``inner()`` returns the
    sharder used inside the per-data-shard ``vmap`` of the train step, where the batch dimension
    is already split by ``vmap(spmd_axis_name=DATA_AXES)`` and so maps to nothing.
    """

    def __init__(self, mesh: Mesh | None, rules: Mapping[str, Any] = RULES, sequence_mode: str = "none"):
        self.mesh = mesh
        self.rules = dict(rules)
        self.sequence_mode = sequence_mode
        """``parallel.sequence_parallelism_mode``: how attention runs (:func:`jaxcolossal.parallel.sequence.attend`)."""
        self.zigzag = False
        """The sequence is in :func:`jaxcolossal.parallel.sequence.zigzag_order` (ring attention's balanced split)."""
        self.layer_specs: tuple | None = None
        """ZeRO-3 with ``parallel.overlap``: ``(gathered, sharded)``, one layer's param
        ``PartitionSpec`` trees without and with ``fsdp``, for the layer scan's prefetch
        (:func:`jaxcolossal.parallel.layer_scan.prefetched_scan`); ``None``: XLA places the gathers."""
        self.lowp_gather: tuple | None = None
        """ZeRO-3 with ``parallel.communication_dtype`` bf16/fp8 (ZeRO++'s qwZ): ``(kind, gathered,
        sharded)``, the dtype each layer's weights cross the wire in and one layer's param
        ``PartitionSpec`` trees without and with ``fsdp``; ``None``: gathered as stored."""
        self.collective_matmul_min_seq: int | None = None
        """Megatron-SP with ``parallel.overlap``: the shortest sequence for which the projections
        run as TP collective matmuls (:mod:`jaxcolossal.parallel.collective_matmul`); ``None``: off."""
        self.fp8 = False
        """``precision.fp8``: the layers' projections multiply in FP8
        (:func:`jaxcolossal.models.layers.linear.project_fp8`)."""
        self.manual_experts: tuple | None = None
        """Inside the pipeline's ``shard_map`` (manual over ``pp`` and the data axes): ``(ep, data
        axes, aux weight)`` for a mixture of experts' layers, which then exchange tokens over the
        manual ``ep`` axis directly, take the router's statistics over the data axes, and add their
        router losses' gradient with that weight (:func:`jaxcolossal.models.layers.moe.moe_mlp`); ``None``
        elsewhere."""
        self.decode_kernel: bool | None = False
        """The KV-cached sampler's decode attention: ``True`` the Pallas flash-decoding kernel, ``False``
        XLA's attention, ``None`` decided when lowering (the kernel for CUDA)
        (:func:`jaxcolossal.models.layers.decode_attention.attend_cache`)."""

    def __call__(self, x: jax.Array, axes: Sequence[str | None]) -> jax.Array:
        if self.mesh is None:
            return x
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, logical_to_spec(axes, self.rules)))

    def axis_size(self, logical: str) -> int:
        """How many ways the rules split the logical axis (1 without a mesh)."""
        if self.mesh is None:
            return 1
        return _axis_size(dict(self.mesh.shape), self.rules.get(logical))

    def is_sharded(self, logical: str) -> bool:
        """Whether the logical axis maps to mesh axes of total size > 1."""
        return self.axis_size(logical) > 1

    def _copy(self, **changes) -> "Sharder":
        out = copy.copy(self)
        out.rules = dict(self.rules)
        for name, value in changes.items():
            setattr(out, name, value)
        return out

    def inner(self) -> "Sharder":
        """This sharder with ``batch`` mapped to nothing (inside the per-data-shard vmap)."""
        return self._copy(rules={**self.rules, "batch": None})

    def with_collective_matmul(self, min_seq: int) -> "Sharder":
        """This sharder, running Megatron-SP's projections as TP collective matmuls for sequences
        of at least ``min_seq`` tokens (:meth:`collective_matmul`)."""
        return self._copy(collective_matmul_min_seq=int(min_seq))

    def collective_matmul(self, t: int) -> bool:
        """Whether a projection of a ``t``-token sequence runs as a TP collective matmul: the
        sequence is split over ``tp`` (``split_gather``), ``tp`` > 1 divides ``t``, ``t`` ≥ the
        threshold, and no axis is already manual (inside the pipeline's ``shard_map``)."""
        if self.mesh is None or self.collective_matmul_min_seq is None or self.rules.get("seq") != "tp":
            return False
        n = int(dict(self.mesh.shape).get("tp", 1))
        manual = any(a == jax.sharding.AxisType.Manual for a in getattr(self.mesh, "axis_types", ()))
        return n > 1 and not manual and t % n == 0 and t >= self.collective_matmul_min_seq

    def with_manual_experts(self, ep: int, data_axes: tuple, aux_weight: float) -> "Sharder":
        """This sharder, inside a ``shard_map`` manual over ``ep`` and ``data_axes`` (:attr:`manual_experts`)."""
        return self._copy(manual_experts=(ep, tuple(data_axes), float(aux_weight)))

    def with_fp8(self, on: bool = True) -> "Sharder":
        """This sharder, with the layers' projections in FP8 (:attr:`fp8`)."""
        return self._copy(fp8=bool(on))

    def with_decode_kernel(self, on: bool | None) -> "Sharder":
        """This sharder, with the decode attention chosen by ``on`` (:attr:`decode_kernel`)."""
        return self._copy(decode_kernel=None if on is None else bool(on))

    def with_layer_prefetch(self, layer_param_specs: Any) -> "Sharder":
        """This sharder, with :attr:`layer_specs` from the stacked layers' param specs
        (``P`` leaves ``[L, ...]``, sharded over ``fsdp`` under ZeRO-3)."""
        return self._copy(layer_specs=one_layer_specs(layer_param_specs))

    def with_lowp_gather(self, kind: str, layer_param_specs: Any) -> "Sharder":
        """This sharder, with :attr:`lowp_gather`: the layer scan all-gathers each layer's ZeRO-3
        weight shards in ``kind`` (``bf16``/``fp8``; :func:`jaxcolossal.parallel.wire.gather_lowp`).
        ``layer_param_specs``: the stacked layers' param specs (``P`` leaves ``[L, ...]``)."""
        return self._copy(lowp_gather=(kind, *one_layer_specs(layer_param_specs)))

    def without_layer_specs(self) -> "Sharder":
        """This sharder without :attr:`layer_specs` and :attr:`lowp_gather` (for a second stack of
        layers, such as a mixture of experts' first dense layers, whose params those specs do not
        describe: XLA places its gathers)."""
        return self._copy(layer_specs=None, lowp_gather=None)

    def zigzagged(self) -> "Sharder":
        """This sharder, for a batch that :func:`jaxcolossal.parallel.sequence.zigzag_batch` has reordered."""
        return self._copy(zigzag=True)

    @property
    def ring(self) -> int:
        """The ``sp`` size when attention runs as ring attention (the batch should be zig-zag
        ordered, :func:`jaxcolossal.parallel.sequence.zigzag_batch`), else 1."""
        if self.mesh is None or self.sequence_mode != "ring_attn":
            return 1
        return int(dict(self.mesh.shape).get("sp", 1))


def one_layer_specs(layer_param_specs: Any) -> tuple[Any, Any]:
    """``(gathered, sharded)``: one layer's param ``PartitionSpec`` trees from the stacked layers'
    (``P`` leaves ``[L, ...]``): as stored (the leading ``L`` dropped), and without ZeRO's axes
    (``fsdp``, and ``ep`` where ZeRO added it: ZeRO-3's all-gathered form; tp and an expert
    dimension's ``ep`` stay)."""
    def drop(entry):  # ZeRO's axes come last in an entry, from fsdp on (zero_spec)
        names = entry_axes(entry)
        kept = names[:names.index(ZERO_AXIS)] if ZERO_AXIS in names else names
        return kept[0] if len(kept) == 1 else (kept or None)
    sharded = jax.tree.map(lambda s: P(*tuple(s)[1:]), layer_param_specs, is_leaf=is_spec)
    gathered = jax.tree.map(lambda s: P(*map(drop, s)), sharded, is_leaf=is_spec)
    return gathered, sharded


def named(mesh: Mesh, specs: Any) -> Any:
    """Turn a pytree of PartitionSpecs into NamedShardings on ``mesh``."""
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))


def constrain(tree: Any, mesh: Mesh, specs: Any) -> Any:
    """``with_sharding_constraint`` over a pytree with a matching pytree of specs."""
    return jax.tree.map(lambda x, s: jax.lax.with_sharding_constraint(x, NamedSharding(mesh, s)), tree, specs,
                        is_leaf=lambda x: isinstance(x, P))


def shard_bytes(shape: Sequence[int], dtype: Any, spec: P, mesh_shape: Mapping[str, int]) -> int:
    """Bytes that one device holds of an array of ``shape``/``dtype`` sharded as ``spec``."""
    local = [s // _axis_size(mesh_shape, e) for s, e in zip(shape, tuple(spec) + (None,) * len(shape))]
    return int(math.prod(local)) * jnp.dtype(dtype).itemsize


def describe(spec: P) -> str:
    """``P(None, 'fsdp', 'tp')`` -> ``"(-, fsdp, tp)"`` for tables."""
    parts = []
    for e in spec:
        parts.append("-" if e is None else e if isinstance(e, str) else "+".join(e))
    return "(" + ", ".join(parts) + ")"
