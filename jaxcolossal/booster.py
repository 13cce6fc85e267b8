"""Colossal-AI's ``Booster`` and plugins, as small presets of the parallel/precision config.

A plugin is not a wrapper class around the model: it only chooses mesh sizes, the ZeRO stage
and the precision. ``Booster.boost(model, optimizer)`` turns an NNX model and an optax optimizer
into a sharded :class:`~jaxcolossal.train.state.TrainState` and the one jitted train step::

    booster = jc.Booster(plugin=jc.HybridParallelPlugin(tp_size=2, zero_stage=1, precision="bf16"))
    model = jc.models.LlamaForCausalLM(cfg.model, rngs=nnx.Rngs(0))
    state, train_step = booster.boost(model, optax.adamw(3e-4))
    state, metrics = train_step(state, booster.shard_batch(batch))

Plugin names and arguments follow Colossal-AI 0.5 (``colossalai.booster.plugin``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable

import jax
import numpy as np
import optax
from flax import nnx

from jaxcolossal.config import (
    Config,
    ConfigError,
    OffloadConfig,
    ParallelConfig,
    PrecisionConfig,
    TrainingConfig,
    pipeline_microbatches,
)
from jaxcolossal.parallel.mesh import data_size, make_mesh
from jaxcolossal.train.state import TrainPlan, TrainState, init_state, make_plan
from jaxcolossal.train.step import make_train_step

_PRECISIONS = ("fp32", "bf16", "fp16")


def _precision(precision: str, initial_scale: float = 2.0**16) -> PrecisionConfig:
    if precision not in _PRECISIONS:
        raise ConfigError(f"precision={precision!r}: allowed values are {list(_PRECISIONS)}")
    return PrecisionConfig(bf16=precision == "bf16", fp16=precision == "fp16", initial_scale=initial_scale)


@dataclass(frozen=True)
class Plugin:
    """Base preset: ``parallel``, ``precision`` and ``offload`` config sections plus ``max_norm``
    clipping. With a plugin the offloaded optimizer state is updated on the device
    (``optimizer_device=device``): the optimizer is the user's optax transformation."""

    parallel: ParallelConfig
    precision: PrecisionConfig
    max_norm: float = 0.0
    offload: OffloadConfig = field(default_factory=OffloadConfig)


def DDPPlugin(precision: str = "fp32", max_norm: float = 0.0) -> Plugin:
    """Data parallelism over every device, replicated state (ZeRO-0). Colossal-AI: ``TorchDDPPlugin``."""
    return Plugin(ParallelConfig(data_parallel_size=-1, zero_stage=0), _precision(precision), max_norm)


TorchDDPPlugin = DDPPlugin


def _check_bool(plugin: str, **flags) -> None:
    """A plugin's on/off arguments must be bools: ``"false"`` would otherwise turn a feature on.

    Raises:
        ConfigError: naming the argument and the value."""
    for name, v in flags.items():
        if not isinstance(v, bool):
            raise ConfigError(f"{plugin}({name}={v!r}): expected True or False")


def LowLevelZeroPlugin(stage: int = 1, precision: str = "fp16", initial_scale: float = 2.0**32,
                       max_norm: float = 0.0, cpu_offload: bool = False, fp8_communication: bool = False) -> Plugin:
    """ZeRO-1 (optimizer state sharded) or ZeRO-2 (and gradients) over every device.
    ``cpu_offload``: the whole optimizer state (moments and fp32 master) in pinned host memory
    (``offload.offload_optim_frac=1``; ZeRO-Offload). ``fp8_communication``: the gradient
    reduction moved in fp8 e4m3, summed in fp32 (``parallel.communication_dtype=fp8``,
    docs/communication.md).

    Raises:
        ConfigError: ``stage`` not in {1, 2}.
    """
    if stage not in (1, 2):
        raise ConfigError(f"LowLevelZeroPlugin(stage={stage}): allowed values are [1, 2]; use GeminiPlugin for ZeRO-3")
    _check_bool("LowLevelZeroPlugin", fp8_communication=fp8_communication, cpu_offload=cpu_offload)
    return Plugin(ParallelConfig(data_parallel_size=-1, zero_stage=stage,
                                 communication_dtype="fp8" if fp8_communication else "fp32"),
                  _precision(precision, initial_scale), max_norm,
                  OffloadConfig(offload_optim_frac=1.0 if cpu_offload else 0.0))


def GeminiPlugin(precision: str = "fp16", initial_scale: float = 2.0**16, max_norm: float = 0.0,
                 placement_policy: str = "static", offload_optim_frac: float = 0.0, offload_param_frac: float = 0.0,
                 device_memory_limit: str | int = "") -> Plugin:
    """ZeRO-3: parameters, gradients and optimizer state sharded over every device, with Gemini's
    placement: ``offload_optim_frac`` of the optimizer state and ``offload_param_frac`` of the
    compute parameters in pinned host memory, or ``placement_policy="auto"`` to choose them for
    ``device_memory_limit`` (:mod:`jaxcolossal.memory.placement`; no chunk manager — XLA gathers per layer).

    Raises:
        ConfigError: a ``placement_policy`` other than static/auto, or fractions outside [0, 1]
            (when the booster validates the config).
    """
    if placement_policy not in ("static", "auto"):
        raise ConfigError(f"GeminiPlugin(placement_policy={placement_policy!r}): allowed values are ['static', 'auto']")
    off = OffloadConfig(placement_policy=placement_policy, offload_optim_frac=float(offload_optim_frac),
                        offload_param_frac=float(offload_param_frac), device_memory_limit=str(device_memory_limit))
    return Plugin(ParallelConfig(data_parallel_size=-1, zero_stage=3), _precision(precision, initial_scale), max_norm,
                  off)


TorchFSDPPlugin = GeminiPlugin


def HybridParallelPlugin(tp_size: int = 1, pp_size: int = 1, zero_stage: int = 0, precision: str = "fp16",
                         num_microbatches: int = 0, pp_style: str = "1f1b", num_model_chunks: int = 1,
                         initial_scale: float = 2.0**16, max_norm: float = 0.0, cpu_offload: bool = False,
                         sp_size: int = 1, enable_sequence_parallelism: bool = False,
                         sequence_parallelism_mode: str | None = None, fp8_communication: bool = False) -> Plugin:
    """Tensor × pipeline × sequence × data parallelism with ZeRO over the data group; dp = world /
    (tp·pp·sp). ``cpu_offload``: the optimizer state in pinned host memory
    (``offload.offload_optim_frac=1``). ``fp8_communication``: the data-parallel gradient
    reduction in fp8 (``parallel.communication_dtype=fp8``; not with pp or sp, refused). Sequence parallelism as Colossal-AI's: with
    ``enable_sequence_parallelism``, ``sequence_parallelism_mode`` is ``split_gather`` (over the tp
    group, ``sp_size`` 1), ``all_to_all`` (the default) or ``ring_attn`` (over ``sp_size``);
    docs/long_context.md.

    Raises:
        ConfigError: an unknown ``pp_style``, ``zero_stage`` or ``sequence_parallelism_mode``
            (Colossal-AI's ``ring``, Megatron-SP with a ring all-gather, is not offered: use
            ``split_gather`` or ``ring_attn``), or ``sp_size`` > 1 without
            ``enable_sequence_parallelism``.
    """
    _check_bool("HybridParallelPlugin", fp8_communication=fp8_communication, cpu_offload=cpu_offload,
                enable_sequence_parallelism=enable_sequence_parallelism)
    if fp8_communication and (pp_size != 1 or sp_size != 1):
        raise ConfigError(f"HybridParallelPlugin(fp8_communication=True) is not supported with pp_size={pp_size} / "
                          f"sp_size={sp_size} yet: the fp8 gradient reduction needs pp_size=1 and sp_size=1")
    modes = ("split_gather", "all_to_all", "ring_attn")
    mode = "none"
    if enable_sequence_parallelism:
        mode = sequence_parallelism_mode or "all_to_all"
        if mode not in modes:
            raise ConfigError(f"HybridParallelPlugin(sequence_parallelism_mode={mode!r}): allowed values are "
                              f"{list(modes)}")
    elif sp_size != 1:
        raise ConfigError(f"HybridParallelPlugin(sp_size={sp_size}) needs enable_sequence_parallelism=True")
    if zero_stage not in (0, 1, 2, 3):
        raise ConfigError(f"HybridParallelPlugin(zero_stage={zero_stage}): allowed values are [0, 1, 2, 3]")
    if pp_style not in ("gpipe", "1f1b", "interleaved"):
        raise ConfigError(f"HybridParallelPlugin(pp_style={pp_style!r}): allowed values are ['gpipe', '1f1b', 'interleaved']")
    par = ParallelConfig(data_parallel_size=-1, tensor_parallel_size=tp_size, pipeline_parallel_size=pp_size,
                         zero_stage=zero_stage, num_microbatches=num_microbatches, pipeline_schedule=pp_style,
                         num_model_chunks=num_model_chunks, sequence_parallel_size=sp_size,
                         sequence_parallelism_mode=mode, communication_dtype="fp8" if fp8_communication else "fp32")
    return Plugin(par, _precision(precision, initial_scale), max_norm,
                  OffloadConfig(offload_optim_frac=1.0 if cpu_offload else 0.0))


class Booster:
    """Turns a model and an optimizer into a sharded train state and a jitted train step.

    Args:
        plugin: a preset from this module (default: :func:`DDPPlugin`).
        devices: the devices to build the mesh on (default: all).
    """

    def __init__(self, plugin: Plugin | None = None, devices: list | None = None, mixed_precision: str | None = None):
        plugin = plugin or DDPPlugin()
        if mixed_precision is not None:
            plugin = dataclasses.replace(plugin, precision=_precision(mixed_precision))
        self.plugin = plugin
        self.mesh = make_mesh(plugin.parallel, devices)
        self.plan: TrainPlan | None = None

    def boost(self, model: nnx.Module, optimizer: optax.GradientTransformation, *, batch_size: int | None = None,
              gradient_accumulation_steps: int = 1, seed: int = 0) -> tuple[TrainState, Callable]:
        """Shard ``model``'s params and ``optimizer``'s state; return ``(state, train_step)``.

        ``train_step(state, batch) -> (state, metrics)`` with ``batch = {"inputs", "targets"}``
        int32 ``[B, t]`` (use :meth:`shard_batch`). ``B`` must split over the data-parallel group
        and ``gradient_accumulation_steps``.

        Raises:
            ConfigError: the plugin does not fit the model (e.g. tp not dividing the heads).
        """
        data = data_size(dict(self.mesh.shape))
        training = TrainingConfig(batch_size=batch_size or data * gradient_accumulation_steps,
                                  gradient_accumulation_steps=gradient_accumulation_steps,
                                  seq_len=min(128, model.cfg.max_position_embeddings), seed=seed,
                                  max_grad_norm=self.plugin.max_norm)
        cfg = Config(model=model.cfg, training=training, parallel=self.plugin.parallel, precision=self.plugin.precision,
                     offload=dataclasses.replace(self.plugin.offload, optimizer_device="device"))
        pp = self.mesh.shape["pp"]
        if batch_size is None and pp > 1:  # the smallest batch that splits into the pipeline microbatches
            training.batch_size = data * max(gradient_accumulation_steps, pipeline_microbatches(cfg, pp))
        self.plan = make_plan(cfg, self.mesh)
        tx = optimizer
        if self.plugin.max_norm > 0:
            tx = optax.chain(optax.clip_by_global_norm(self.plugin.max_norm), optimizer)
        params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
        if self.plan.vocab != params["embed_tokens"].shape[0]:
            raise ConfigError(
                f"the model was built with a vocabulary of {params['embed_tokens'].shape[0]} rows but this plugin "
                f"needs {self.plan.vocab} (padded for tp); build it with tp={self.mesh.shape['tp']}")
        state = init_state(self.plan, tx, params=params)
        step = make_train_step(self.plan, tx, tx_from_config=False)
        want = self.plan.cfg.training.batch_size

        def train_step(state: TrainState, batch: dict):
            shape = tuple(batch["inputs"].shape)
            if shape[0] != want or tuple(batch["targets"].shape) != shape:
                raise ValueError(
                    f"train_step: the batch has inputs {shape} and targets {tuple(batch['targets'].shape)}, but "
                    f"boost() planned batch_size={want} sequences per step; pass batch_size= to boost()")
            return step(state, batch)

        train_step.lower = step.lower  # AOT access, as on a jitted function
        return state, train_step

    def shard_batch(self, batch: dict) -> dict:
        """Place a host batch ``{"inputs", "targets"}`` (global ``[B, t]`` integer numpy arrays, the
        same on every process), and optionally ``"loss_mask"`` ``[B, t]`` (1 = trained on), with the
        data-parallel sharding.

        Raises:
            ValueError: a token id outside ``[0, model.vocab_size)`` (after :meth:`boost`): it would
                index a padded or missing embedding row and train on garbage without an error; a
                ``loss_mask`` of another shape, or with negative or non-finite values.
        """
        vocab = self.plan.cfg.model.vocab_size if self.plan is not None else None
        for k, v in batch.items():
            v = np.asarray(v)
            if k == "loss_mask":
                if v.shape != np.shape(batch["inputs"]) or not np.all(np.isfinite(v)) or v.min() < 0:
                    raise ValueError(f"shard_batch: loss_mask of shape {v.shape} must match inputs "
                                     f"{np.shape(batch['inputs'])} and hold finite values >= 0 (1 = trained on)")
                continue
            if vocab is not None and v.size and (v.min() < 0 or v.max() >= vocab):
                raise ValueError(f"shard_batch: {k} holds token ids in [{v.min()}, {v.max()}], outside the "
                                 f"model's vocabulary [0, {vocab})")
        sharding = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec(("dp", "fsdp"), None))
        return {k: jax.make_array_from_callback(np.shape(v), sharding, lambda idx, v=v: np.asarray(v)[idx])
                for k, v in batch.items()}
