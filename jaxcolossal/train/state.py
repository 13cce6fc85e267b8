"""The train state and the static plan that shards it.

:class:`TrainPlan` gathers everything static about a run — mesh, logical axes, ZeRO specs,
dtypes — and :func:`init_state` builds a :class:`TrainState` directly in its target sharding
(initialisation runs under ``jit`` with ``out_shardings``, so no device ever holds more than its
shard).

Precision modes, with the ZeRO paper's (docs/zero.md) bytes per parameter (p compute params, g gradients,
K optimizer state including any fp32 master copy):

======  ===========================================  =====  =====  ======
mode    state                                        p      g      K
======  ===========================================  =====  =====  ======
fp32    params fp32; Adam m, v fp32                  4      4      8
bf16    params bf16; master fp32; Adam m, v fp32     2      4      12
fp16    params fp16; master fp32; Adam m, v fp32     2      4      12
======  ===========================================  =====  =====  ======

Gradients are always accumulated and reduced in fp32 (g = 4).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import struct
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcolossal.config import BYTES_PER_PARAM, COMPUTE_DTYPES, Config, ConfigError, validate  # noqa: F401  (BYTES_PER_PARAM: re-exported)
from jaxcolossal.config.derived import holds_reference
from jaxcolossal.memory.budget import resolve
from jaxcolossal.memory.placement import Placement, place_state
from jaxcolossal.models import adapter_layout, get_family, param_layout
from jaxcolossal.models.layers.lora import init_adapters, merge
from jaxcolossal.optim.loss_scale import LossScaleState, scaler_init
from jaxcolossal.parallel.compression import check_powersgd, powersgd_init, powersgd_specs, powersgd_views
from jaxcolossal.parallel.mesh import DATA_AXES, data_size, platform
from jaxcolossal.parallel.sharding import Sharder, StateSpecs, named, rules_for, state_specs
from jaxcolossal.runtime.platforms import fp8_refusal


@struct.dataclass
class TrainState:
    """Everything a step reads and writes.

    Attributes:
        step: int32 scalar, optimizer steps taken (skipped fp16 steps included).
        params: compute-dtype params, sharded by ``specs.params``.
        master: fp32 master params sharded by ``specs.opt``, or ``None`` in fp32 mode
            (then ``params`` are the master copy).
        opt_state: optax state; moments sharded by ``specs.opt``.
        scaler: :class:`LossScaleState` in fp16 mode, else ``None``.
        residual: with ``parallel.gradient_compression=topk`` and ``error_feedback``, each data
            shard's fp32 gradient not yet sent: param-shaped leaves with a leading ``[N]`` (the
            data group), sharded ``P(("dp", "fsdp"), ...)`` (each device its own); with
            ``parallel.momentum_correction``, ``{"error": that, "velocity": the shard's momentum,
            the same shapes}``; with ``powersgd``, ``{"q": {leaf: fp32 [*layers, m, r]} (replicated), "error": {leaf: fp32
            [N, ...]}}`` for the compressed leaves (:func:`jaxcolossal.parallel.compression.powersgd_init`);
            else ``None``.
        frozen: with LoRA (``model.lora.rank > 0``), the base model's weights in the compute dtype,
            sharded by ``plan.frozen_specs`` and never updated; ``params``, ``master`` and
            ``opt_state`` then hold only the adapters (:mod:`jaxcolossal.models.layers.lora`). Else ``None``.
        reference: with ``training.objective=dpo`` (or ``grpo`` with ``beta > 0``) and
            ``posttrain.reference=frozen`` (:func:`holds_reference`), the reference policy: a copy of the
            initial params, or of ``posttrain.ref_model``'s weights, in the compute dtype, sharded like the
            model's params (``specs.params``; under LoRA the base's ``frozen_specs``), never updated, saved
            and restored with the rest. Else ``None`` (also with ``posttrain.precompute_ref_log_probs``).
    """

    step: jax.Array
    params: Any
    master: Any
    opt_state: Any
    scaler: Any
    residual: Any = None
    frozen: Any = None
    reference: Any = None

    @property
    def model_params(self) -> Any:
        """The model's whole params dict: ``params``, with the frozen base under LoRA
        (:func:`jaxcolossal.models.layers.lora.merge`)."""
        return merge(self.frozen, self.params)


@dataclass(frozen=True)
class TrainPlan:
    """Static description of a run: config, mesh, shapes, logical axes and ZeRO specs."""

    cfg: Config
    mesh: Mesh
    mesh_shape: dict
    vocab: int
    param_axes: Any
    param_shapes: Any
    specs: StateSpecs
    precision: str
    placement: Placement = None
    placement_report: str = ""
    frozen_shapes: Any = None
    frozen_axes: Any = None
    frozen_specs: Any = None

    @property
    def lora(self) -> bool:
        """True when the run trains LoRA adapters on a frozen base (``model.lora.rank > 0``): then
        ``param_shapes``/``param_axes``/``specs`` describe the adapters and ``frozen_*`` the base."""
        return self.frozen_shapes is not None

    @property
    def layer_param_specs(self) -> Any:
        """The stacked layers' params specs the forward sees (the frozen base's and the adapters'
        under LoRA): what the ZeRO-3 layer gathers follow."""
        return merge(self.frozen_specs, self.specs.params)["layers"]

    @property
    def compute_dtype(self):
        """jnp dtype of the forward/backward (float32, bfloat16 or float16)."""
        return COMPUTE_DTYPES[self.precision]

    @property
    def mixed(self) -> bool:
        """True when a separate fp32 master copy is kept (bf16/fp16)."""
        return self.precision != "fp32"

    @property
    def data_size(self) -> int:
        """N = dp × fsdp, the data-parallel group size."""
        return data_size(self.mesh_shape)

    @property
    def sharder(self) -> Sharder:
        """Activation-constraint helper for this mesh and the rules table."""
        p = self.cfg.parallel
        shard = Sharder(self.mesh, self.rules, p.sequence_parallelism_mode).with_fp8(self.cfg.precision.fp8)
        if p.overlap and p.sequence_parallelism_mode == "split_gather":  # TP collective matmul
            shard = shard.with_collective_matmul(p.collective_matmul_min_seq)
        return shard

    @property
    def rules(self) -> dict:
        """The rules table of this run (:func:`jaxcolossal.parallel.sharding.rules_for`)."""
        return rules_for(self.cfg.parallel, self.mesh_shape["pp"] > 1)

    @property
    def batch_sharding(self) -> NamedSharding:
        """``P(("dp", "fsdp"), None)`` for int32 ``[B, t]`` batches."""
        return NamedSharding(self.mesh, P(DATA_AXES, None))

    @property
    def family(self):
        """The model family module (``jaxcolossal.models.llama``, ...)."""
        return get_family(self.cfg.model)

    def init_model(self, key: jax.Array) -> dict:
        """fp32 params (pure dict) from the model family's initialiser."""
        return self.family.init_params(self.cfg.model, key, self.mesh_shape["tp"])


def make_plan(cfg: Config, mesh: Mesh) -> TrainPlan:
    """Validate ``cfg`` against ``mesh`` and derive the ZeRO/TP specs.

    Raises:
        ConfigError: impossible sizes (heads not divisible by tp, batch not divisible by the
            data-parallel group, a dimension that its mesh axis does not divide, ...), or a run
            whose predicted device bytes exceed ``offload.device_memory_limit`` (or the device's
            reported capacity) with the offload settings that would fit
            (:func:`jaxcolossal.memory.budget.resolve`).
    """
    validate(cfg, num_devices=mesh.size)
    _check_fp8(cfg, mesh)
    shape = {k: int(v) for k, v in mesh.shape.items()}
    vocab, shapes, axes = param_layout(cfg.model, shape["tp"])
    # pipeline: the stacked layers dimension is split over pp (the layout stays [L, ...])
    rules = rules_for(cfg.parallel, shape["pp"] > 1)
    specs = state_specs(axes, shapes, cfg.parallel.zero_stage, shape, rules)
    check_powersgd(cfg.parallel, shapes, axes)
    # which shards live in host memory (offload section), checked against the device limit (LoRA: the
    # base model's layout, which the memory model turns into the frozen base and the adapters' state)
    placement, report = resolve(cfg, shapes, specs, shape, list(mesh.devices.flat))
    frozen = {}
    if cfg.model.lora.enabled:  # the base is frozen (held as ZeRO holds params); the adapters are trained
        frozen = {"frozen_shapes": shapes, "frozen_axes": axes, "frozen_specs": specs.params}
        shapes, axes = adapter_layout(cfg.model, shapes, axes)
        specs = state_specs(axes, shapes, cfg.parallel.zero_stage, shape, rules)
    return TrainPlan(cfg=cfg, mesh=mesh, mesh_shape=shape, vocab=vocab, param_axes=axes,
                     param_shapes=shapes, specs=specs, precision=cfg.precision.mode, placement=placement,
                     placement_report=report, **frozen)


def _check_fp8(cfg: Config, mesh: Mesh) -> None:
    """``precision.fp8`` on GPUs without FP8 tensor cores (compute capability below 8.9) is refused;
    other platforms emulate it.

    Raises:
        ConfigError: FP8 on such a GPU.
    """
    device = mesh.devices.flat[0]
    why = fp8_refusal(device.device_kind, getattr(device, "compute_capability", None))
    if cfg.precision.fp8 and platform(mesh) == "gpu" and why:
        raise ConfigError(why)


def opt_state_specs(tx: optax.GradientTransformation, params_abstract: Any, param_like_specs: Any) -> Any:
    """Specs of the optax state: parameter-shaped leaves follow ``param_like_specs``; counters
    and other scalars are replicated."""
    abstract = jax.eval_shape(tx.init, params_abstract)
    return optax.tree_map_params(tx, lambda _, s: s, abstract, param_like_specs,
                                 transform_non_params=lambda _: P(), is_leaf=lambda x: isinstance(x, P))


def keeps_residual(plan: TrainPlan) -> bool:
    """True when the state carries compression state: top-k's error-feedback residual, or
    PowerSGD's ``Q`` (and errors)."""
    p = plan.cfg.parallel
    return (p.gradient_compression == "topk" and p.error_feedback) or p.gradient_compression == "powersgd"


def powersgd_views_of(plan: TrainPlan) -> dict:
    """The leaves PowerSGD compresses in this plan (:func:`jaxcolossal.parallel.compression.powersgd_views`)."""
    return powersgd_views(plan.param_shapes, plan.param_axes, plan.cfg.parallel.powersgd_rank)


def residual_specs(plan: TrainPlan) -> Any:
    """Specs of :attr:`TrainState.residual` (``None`` without one): ``[N, ...]`` per data shard
    (with ``parallel.momentum_correction``: ``{"error": ..., "velocity": ...}``, both so)."""
    if not keeps_residual(plan):
        return None
    if plan.cfg.parallel.gradient_compression == "powersgd":
        return powersgd_specs(powersgd_views_of(plan), plan.cfg.parallel.error_feedback)
    specs = jax.tree.map(lambda s: P(DATA_AXES, *s), plan.specs.base, is_leaf=lambda x: isinstance(x, P))
    return {"error": specs, "velocity": specs} if plan.cfg.parallel.momentum_correction else specs


def init_residual(plan: TrainPlan, params: Any) -> Any:
    """The compression state at step 0 (zeros; PowerSGD's seeded ``Q``), or ``None``."""
    if not keeps_residual(plan):
        return None
    p = plan.cfg.parallel
    if p.gradient_compression == "powersgd":
        return powersgd_init(powersgd_views_of(plan), p.powersgd_rank, plan.data_size, p.error_feedback,
                             seed=plan.cfg.training.seed)

    def zeros():  # fp32 [N, ...] per data shard, like params
        return jax.tree.map(lambda x: jnp.zeros((plan.data_size,) + x.shape, jnp.float32), params)

    return {"error": zeros(), "velocity": zeros()} if p.momentum_correction else zeros()


def reference_specs(plan: TrainPlan) -> Any:
    """Specs of :attr:`TrainState.reference`: the whole model's params specs (under LoRA the base's,
    ``frozen_specs``: a ``posttrain.ref_model`` held beside it), or ``None`` without a reference copy."""
    if not holds_reference(plan.cfg):
        return None
    return plan.frozen_specs if plan.lora else plan.specs.params


def state_shardings(plan: TrainPlan, tx: optax.GradientTransformation) -> TrainState:
    """A :class:`TrainState` whose leaves are the target ``NamedSharding`` of each array, in the
    memory kind (device or pinned host) that ``plan.placement`` gives each leaf."""
    abstract = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, jnp.float32), plan.param_shapes,
                            is_leaf=lambda x: isinstance(x, tuple))
    specs = TrainState(
        step=P(),
        params=plan.specs.params,
        master=plan.specs.opt if plan.mixed else None,
        opt_state=opt_state_specs(tx, abstract, plan.specs.opt),
        scaler=LossScaleState(P(), P(), P(), P()) if plan.precision == "fp16" else None,
        residual=residual_specs(plan),
        frozen=plan.frozen_specs,
        reference=reference_specs(plan),
    )
    shardings = named(plan.mesh, specs)
    if plan.placement is not None and plan.placement.active:
        shardings = place_state(shardings, plan.placement, tx, plan.mixed)
    return shardings


def abstract_state(plan: TrainPlan, tx: optax.GradientTransformation) -> TrainState:
    """The train state as ``jax.ShapeDtypeStruct`` leaves with their shardings: what
    :func:`init_state` would build, without building it (to lower or compile a step)."""
    abstract = jax.eval_shape(lambda k: init_state(plan, tx, key=k), jax.random.key(0))
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract,
                        state_shardings(plan, tx))


def init_state(plan: TrainPlan, tx: optax.GradientTransformation, key: jax.Array | None = None,
               params: Any = None, adapters: Any = None, reference: Any = None) -> TrainState:
    """Build the sharded train state, from ``params`` (fp32 pure dict) or fresh from ``key``.

    Under LoRA (``plan.lora``) ``params`` (or the fresh init) is the frozen base, cast to the
    compute dtype, and the trained params are ``adapters`` (a PEFT import,
    :func:`jaxcolossal.models.peft.load_adapters`) or fresh ones drawn from ``key``
    (:func:`jaxcolossal.models.layers.lora.init_adapters`).

    ``reference``: the reference copy's weights (a pure dict shaped like the model's params, any float
    dtype: ``posttrain.ref_model``'s, :func:`jaxcolossal.posttrain.ref_model.load_ref_model`); None: the
    initial params. Kept (in the compute dtype) only when :func:`holds_reference`.

    Runs under ``jit`` with the target ``out_shardings``: each device materialises only its
    shard.
    """
    shardings = state_shardings(plan, tx)
    pc = plan.cfg.precision

    def build(key, params, adapters, reference):
        if params is None:
            params = plan.init_model(key)
        params = jax.tree.map(lambda x: x.astype(jnp.float32), params)
        if holds_reference(plan.cfg):  # the initial policy (a copy, not an alias), or posttrain.ref_model's
            reference = jax.tree.map(lambda x: x.astype(plan.compute_dtype) + 0,
                                     params if reference is None else reference)
        else:
            reference = None
        frozen = None
        if plan.lora:  # the base model is frozen; the adapters are what is trained
            frozen = jax.tree.map(lambda x: x.astype(plan.compute_dtype), params)
            params = adapters if adapters is not None else init_adapters(
                plan.cfg.model.lora, plan.param_shapes, jax.random.fold_in(key, 1))
            params = jax.tree.map(lambda x: x.astype(jnp.float32), params)
        master = params if plan.mixed else None
        return TrainState(
            step=jnp.zeros((), jnp.int32),
            params=jax.tree.map(lambda x: x.astype(plan.compute_dtype), params),
            master=master,
            opt_state=tx.init(params),
            scaler=scaler_init(pc.initial_scale) if plan.precision == "fp16" else None,
            residual=init_residual(plan, params),
            frozen=frozen,
            reference=reference,
        )

    if key is None and (params is None or (plan.lora and adapters is None)):
        raise ValueError("init_state needs a PRNG key, or an initial params dict (and adapters under LoRA)")
    if key is None:
        key = jax.random.key(0)  # unused: everything comes from params and adapters
    return jax.jit(build, out_shardings=shardings)(key, params, adapters, reference)
