"""Pure functions of the config that several stages need: the bytes per parameter of each
precision and its label in the logs, the compute dtype, the pipeline's microbatches, and which path the train step takes
(the layer-wise gradient reduction, ZeRO-3's weight prefetch, a narrower weight gather, the
attention kernel)."""

from __future__ import annotations

from typing import Mapping

import jax.numpy as jnp

from jaxcolossal.config.schema import Config


def pipeline_microbatches(cfg: Config, pp: int) -> int:
    """Pipeline microbatches per step for ``pp`` stages (see docs/pipeline.md).

    With pipeline parallelism the pipeline microbatches *replace* gradient accumulation: the
    batch of a step is split into ``m`` microbatches that flow through the stages. ``m`` is
    ``parallel.num_microbatches`` when set, else ``training.gradient_accumulation_steps`` when
    that is above 1, else ``2 · pp``.
    """
    p, t = cfg.parallel, cfg.training
    if p.num_microbatches > 0:
        return p.num_microbatches
    if t.gradient_accumulation_steps > 1:
        return t.gradient_accumulation_steps
    return 2 * pp


COMPUTE_DTYPES = {"fp32": jnp.float32, "bf16": jnp.bfloat16, "fp16": jnp.float16}
"""The forward/backward dtype of each precision mode (``precision.mode``)."""

BYTES_PER_PARAM = {"fp32": dict(p=4, g=4, K=8), "bf16": dict(p=2, g=4, K=12), "fp16": dict(p=2, g=4, K=12)}
"""The ZeRO paper's bytes per parameter of each precision mode: ``p`` the compute copy, ``g`` the
gradients (always fp32), ``K`` the optimizer state with any fp32 master copy (docs/zero.md)."""

WIRE_BYTES = {"fp32": 4, "bf16": 2, "fp8": 1}
"""Bytes per element of each ``parallel.communication_dtype``."""

FP8_RECIPE = "fp8 projections (e4m3/e5m2, current scaling)"
"""What ``precision.fp8`` adds, as the logs say it: the layers' projections in FP8, activations and
weights in e4m3 and gradients in e5m2, each scaled by its own amax in the step that uses it."""


def precision_label(cfg: Config) -> str:
    """The run's precision as the start-up log and the dry run print it: ``precision.mode``
    (``fp32``, ``bf16``, ``fp16``), plus :data:`FP8_RECIPE` when ``precision.fp8`` is on, e.g.
    ``bf16 + fp8 projections (e4m3/e5m2, current scaling)``. Raises nothing."""
    return cfg.precision.mode + (f" + {FP8_RECIPE}" if cfg.precision.fp8 else "")


def reduces_layerwise(cfg: Config) -> bool:
    """Whether the step takes the gradient of the whole microbatch, so that XLA reduces(-scatters)
    each layer's weight gradient inside the backward layer scan: ZeRO-2/3 with fp32 communication
    and no gradient compression, without a pipeline (else each data shard's gradient is reduced
    after the backward, by hand); and a mixture of experts at any ZeRO stage (the tokens of the
    whole microbatch are routed together, across ``ep``)."""
    p = cfg.parallel
    if cfg.model.moe and p.pipeline_parallel_size == 1:  # the experts' all-to-all needs the global batch
        return True
    return (p.zero_stage >= 2 and p.communication_dtype == "fp32" and p.gradient_compression == "none"
            and p.pipeline_parallel_size == 1)


def prefetches_weights(cfg: Config) -> bool:
    """Whether the layer scan prefetches ZeRO-3's weights (:func:`jaxcolossal.parallel.layer_scan.prefetched_scan`):
    ``parallel.overlap`` with ZeRO-3, ``model.remat=full`` and :func:`reduces_layerwise` (offloaded
    params stream in instead)."""
    return (reduces_layerwise(cfg) and cfg.parallel.zero_stage == 3 and cfg.parallel.overlap
            and cfg.model.remat == "full" and cfg.offload.offload_param_frac == 0)


def weight_gather_dtype(cfg: Config, data_size: int) -> str | None:
    """The dtype ZeRO-3's layer-weight all-gathers move when it is not the compute dtype
    (ZeRO++'s qwZ, :func:`jaxcolossal.parallel.wire.gather_lowp`): ``parallel.communication_dtype``
    under ZeRO-3 over a data group of ``data_size`` > 1, where it is narrower than the compute
    dtype (fp8 in any run, bf16 in an fp32 run). ``None``: the weights are gathered as stored.
    The one rule the train step, the planner and the dry run read."""
    p = cfg.parallel
    narrower = WIRE_BYTES[p.communication_dtype] < BYTES_PER_PARAM[cfg.precision.mode]["p"]
    return p.communication_dtype if p.zero_stage == 3 and data_size > 1 and narrower else None


def attention_kernel(cfg: Config, mesh_shape: Mapping[str, int]) -> str:
    """The attention the step runs for ``model.attention_impl`` on ``mesh_shape``: ``cudnn`` becomes
    ``xla`` inside a pipeline (cuDNN's partitioner cannot run in the pipeline's partly manual
    ``shard_map`` on jax 0.10: :mod:`jaxcolossal.parallel.sequence`); otherwise the config's."""
    impl = cfg.model.attention_impl
    return "xla" if impl == "cudnn" and mesh_shape.get("pp", 1) > 1 else impl


def double_buffers_loops(cfg: Config) -> bool:
    """Whether ``parallel.overlap`` asks XLA:GPU for while-loop double buffering: under ZeRO-3 only.
    There it hides more of the layers' weight gathers (7B on 8 H200s: 65.7% of the collective time
    against 58.5%, for 0.7 GiB); under ZeRO-0/1/2 it hides nothing more and holds two layers'
    backward working sets at once (7B ZeRO-2: 84.1 GiB per GPU without it, 95.4 GiB with it;
    ``scripts/gpu_overlap.py``)."""
    return cfg.parallel.overlap and cfg.parallel.zero_stage == 3


DPO_LOSS_TYPES = ("sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "aot",
                  "aot_unpaired", "apo_zero", "apo_down", "discopop", "sft", "sigmoid_norm")
"""TRL 1.16's DPO loss types (``DPOConfig.loss_type``), in its order."""
GRPO_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
GRPO_CLIPPED_LOSSES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")
"""The GRPO losses that clip the ratio at ``[1 - ε, 1 + ε_high]`` (and honour ``delta``); TRL logs
their ``clip_ratio/*`` metrics."""


def posttrain_beta(cfg: Config) -> float:
    """``posttrain.beta`` with ``auto`` resolved to TRL 1.16's default of the run's objective: 0.1 for
    DPO (``DPOConfig.beta``), 0.0 for GRPO (``GRPOConfig.beta``) and SFT, 0.05 for GRPO with
    ``advantage=rloo`` (``RLOOConfig.beta``)."""
    b = cfg.posttrain.beta
    if b != "auto":
        return float(b)
    if cfg.training.objective == "grpo" and cfg.posttrain.advantage == "rloo":
        return 0.05
    return 0.1 if cfg.training.objective == "dpo" else 0.0


def posttrain_loss_type(cfg: Config) -> str:
    """``posttrain.loss_type`` with ``auto`` resolved: ``sigmoid`` for DPO, ``dapo`` for GRPO (TRL 1.16's
    defaults), ``""`` for SFT."""
    lt, objective = cfg.posttrain.loss_type, cfg.training.objective
    if lt != "auto":
        return lt
    return {"dpo": "sigmoid", "grpo": "dapo"}.get(objective, "")


LABEL_SMOOTHING_LOSSES = ("exo_pair", "robust", "aot", "aot_unpaired")
"""The DPO losses that read ``posttrain.label_smoothing`` (TRL 1.16 ``DPOTrainer._compute_loss``)."""


def dpo_loss_types(cfg: Config) -> tuple[str, ...]:
    """DPO's ``posttrain.loss_type`` as TRL's list: the comma-separated names, stripped, in order
    (``auto``: ``("sigmoid",)``, TRL's default). Unchecked here (``_check_loss_type`` refuses an unknown one)."""
    lt = cfg.posttrain.loss_type
    return ("sigmoid",) if lt.strip() == "auto" else tuple(n.strip() for n in lt.split(","))


def dpo_loss_weights(cfg: Config) -> tuple[float, ...]:
    """``posttrain.loss_weights`` as floats, one per :func:`dpo_loss_types` name; ``""``: 1.0 each
    (TRL's ``loss_weights or [1.0] * len(loss_types)``).

    Raises:
        ValueError: a word that is not a number (the config's check refuses it first)."""
    w = cfg.posttrain.loss_weights
    if not w.strip():
        return (1.0,) * len(dpo_loss_types(cfg))
    return tuple(float(x) for x in w.split(","))


def grpo_prompt_length(cfg: Config) -> int:
    """GRPO's prompt width in tokens: ``training.seq_len + 1 - posttrain.max_completion_length`` (a row
    of ``seq_len`` inputs holds the left-padded prompt and the completion, less its last token)."""
    return cfg.training.seq_len + 1 - cfg.posttrain.max_completion_length


def grpo_epsilon_high(cfg: Config) -> float:
    """GRPO's upper clip: ``posttrain.epsilon_high``, or ``epsilon`` when it is 0 (TRL's None)."""
    return cfg.posttrain.epsilon_high or cfg.posttrain.epsilon


def uses_reference(cfg: Config) -> bool:
    """Whether the objective compares the policy with a reference model: DPO, or GRPO with ``beta > 0``."""
    t = cfg.training
    return t.objective == "dpo" or (t.objective == "grpo" and posttrain_beta(cfg) > 0)


def precomputes_ref_logps(cfg: Config) -> bool:
    """Whether DPO's reference log-probs come from the pass before training
    (``posttrain.precompute_ref_log_probs``) rather than a reference forward in each step."""
    return cfg.training.objective == "dpo" and cfg.posttrain.precompute_ref_log_probs


def holds_reference(cfg: Config) -> bool:
    """Whether the train state holds a frozen reference copy: DPO, or GRPO with ``beta > 0``, with
    ``posttrain.reference=frozen``, unless DPO precomputes its reference log-probs (then the weights are
    read by that pass only)."""
    return uses_reference(cfg) and cfg.posttrain.reference == "frozen" and not precomputes_ref_logps(cfg)


def rollout_tp_sizes(cfg: Config, num_devices: int) -> list[int]:
    """The decode layout's possible tensor-parallel sizes on ``num_devices``: those that divide
    ``model.num_attention_heads``, ``num_key_value_heads``, ``intermediate_size`` and the experts'
    ``moe_intermediate_size`` (the splits Megatron's tp makes), whose product with the training's
    ``parallel.expert_parallel_size`` (the decode layout keeps the experts' split) divides the
    devices, and that leave a data group of ``num_devices / tp`` dividing the rollout's rows
    (:func:`grpo_generation_batch`); smallest first."""
    m, rows, ep = cfg.model, grpo_generation_batch(cfg), max(1, cfg.parallel.expert_parallel_size)
    dims = (m.num_attention_heads, m.num_key_value_heads, m.intermediate_size) + \
        ((m.moe_intermediate_size or m.intermediate_size,) if m.moe else ())
    return [t for t in range(1, num_devices + 1)
            if num_devices % (t * ep) == 0 and all(d % t == 0 for d in dims) and rows % (num_devices // t) == 0]


def rollout_tp(cfg: Config, num_devices: int, devices_per_host: int) -> int:
    """GRPO's decode-layout tensor-parallel size: ``posttrain.rollout_tp`` when set, else the largest of
    :func:`rollout_tp_sizes` within a host's ``devices_per_host`` devices (the kv heads cap it: a kv head
    is never split); 1 when none is (then the caller's check refuses an explicit size)."""
    if cfg.posttrain.rollout_tp:
        return cfg.posttrain.rollout_tp
    fits = [t for t in rollout_tp_sizes(cfg, num_devices) if t <= devices_per_host]
    return fits[-1] if fits else 1


def grpo_generation_batch(cfg: Config) -> int:
    """GRPO's completions per generation (TRL 1.16's ``generation_batch_size``): ``posttrain.
    generation_batch_size``, else ``training.batch_size × steps_per_generation / gradient_accumulation_steps``
    (``steps_per_generation`` 0: the accumulation steps, so ``batch_size``)."""
    t, po = cfg.training, cfg.posttrain
    if po.generation_batch_size:
        return po.generation_batch_size
    steps = po.steps_per_generation or t.gradient_accumulation_steps
    return t.batch_size * steps // max(1, t.gradient_accumulation_steps)


def grpo_off_policy(cfg: Config) -> bool:
    """Whether a GRPO step may train on completions of an older policy, so the sampling policy's log-probs
    are kept (TRL's ``old_per_token_logps``): ``num_iterations > 1``, or a generation feeding several steps."""
    return cfg.posttrain.num_iterations > 1 or grpo_generation_batch(cfg) > cfg.training.batch_size


def rollout_reshards(cfg: Config, mesh_shape: Mapping[str, int], decode_tp: int) -> bool:
    """Whether GRPO's rollout reshards the params into a decode layout: ``posttrain.rollout_layout=decode``
    and the training mesh ``mesh_shape`` lays the params out otherwise (ZeRO-3 splits them over a
    data group of more than one device, ``fsdp``, or with expert parallelism ``fsdp × ep`` for the dense
    weights; a pipeline over stages; or training's tp is not ``decode_tp``); otherwise the sampler
    decodes on the params as they are, with no copy."""
    shape = dict(mesh_shape)
    zero_group = shape.get("fsdp", 1) * shape.get("ep", 1)
    return cfg.posttrain.rollout_layout == "decode" and (
        (cfg.parallel.zero_stage >= 3 and zero_group > 1) or shape.get("pp", 1) > 1
        or shape.get("tp", 1) != decode_tp)
