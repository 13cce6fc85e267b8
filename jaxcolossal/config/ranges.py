"""Every numeric key's accepted values (:data:`RANGES`), each a :class:`Range`, checked by
:func:`check_ranges` first of :func:`jaxcolossal.config.checks.validate`'s checks."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from jaxcolossal.config.schema import Config
from jaxcolossal.errors import ConfigError


@dataclass(frozen=True)
class Range:
    """The values a numeric key accepts: ``lo``/``hi`` bounds (closed unless ``*_open``), plus
    ``special`` values outside them with the meaning given in ``note``. NaN and ±inf are never
    accepted."""

    lo: float = -math.inf
    hi: float = math.inf
    lo_open: bool = False
    hi_open: bool = False
    special: tuple = ()
    note: str = ""

    def contains(self, v: float) -> bool:
        """True when ``v`` is finite and inside the bounds, or one of ``special``."""
        if v in self.special:
            return True
        if not math.isfinite(v):
            return False
        above = v > self.lo if self.lo_open else v >= self.lo
        below = v < self.hi if self.hi_open else v <= self.hi
        return above and below

    def describe(self, what: str = "must be") -> str:
        """The bounds in words, e.g. ``must be > 0`` or ``must be in [0, 1)``."""
        if self.hi == math.inf:
            text = f"{what} {'>' if self.lo_open else '>='} {self.lo:g}"
        else:
            text = (f"{what} in {'(' if self.lo_open else '['}{self.lo:g}, {self.hi:g}"
                    f"{')' if self.hi_open else ']'}")
        return text + (f" ({self.note})" if self.note else "")


_POS = Range(1)                      # a count or a size: 1, 2, ...
_NONNEG = Range(0)
_GT0 = Range(0, lo_open=True)        # a strictly positive real
_MESH = Range(1, special=(-1,), note="or -1: the remaining devices")
_BETA = Range(0, 1, hi_open=True)

RANGES: dict[str, Range] = {
    "model.num_layers": _POS, "model.hidden_size": _POS, "model.num_attention_heads": _POS,
    "model.num_key_value_heads": _POS, "model.intermediate_size": _POS,
    "model.max_position_embeddings": _POS, "model.vocab_size": _POS, "model.vocab_pad_multiple": _POS,
    "model.rms_norm_eps": _GT0, "model.layer_norm_eps": _GT0, "model.rope_theta": _GT0,
    "model.initializer_range": _GT0, "model.num_labels": Range(0, 1, note="0: the LM head; 1: a score head"),
    "model.loss_chunk_tokens": Range(0, note="0: materialize the logits of all tokens"),
    "model.loss_chunk_vocab": Range(0, note="0: the whole vocabulary shard in one chunk"),
    "model.lora.rank": Range(0, note="0: LoRA off"), "model.lora.alpha": _GT0,
    "model.lora.dropout": Range(0, 1, hi_open=True),
    "model.attention_head_dim": Range(0, note="0: hidden_size / num_attention_heads"),
    "model.num_experts": Range(0, note="0: dense"), "model.num_experts_per_tok": _POS,
    "model.moe_intermediate_size": Range(0, note="0: intermediate_size"), "model.num_shared_experts": _NONNEG,
    "model.first_k_dense": _NONNEG, "model.router_aux_loss_coef": _NONNEG, "model.router_z_loss_coef": _NONNEG,
    "model.capacity_factor": Range(0, note="0: dropless"), "parallel.expert_parallel_size": _POS,
    "model.rope.factor": _NONNEG, "model.rope.original_max_position_embeddings": _NONNEG,
    "model.rope.low_freq_factor": _GT0, "model.rope.high_freq_factor": _GT0, "model.rope.beta_fast": _GT0,
    "model.rope.beta_slow": _GT0, "model.rope.mscale": _NONNEG, "model.rope.mscale_all_dim": _NONNEG,
    "model.rope.attention_factor": Range(0, note="0: derived"), "model.rope.partial_rotary_factor": Range(0, 1, lo_open=True),
    "model.rope_local_theta": Range(0, note="0: rope_theta"), "model.sliding_window": Range(0, note="0: none"),
    "model.query_pre_attn_scalar": Range(0, note="0: head_dim"), "model.attn_logit_softcapping": _NONNEG,
    "model.final_logit_softcapping": _NONNEG, "model.swiglu_limit": Range(0, note="0: no clamp"),
    "model.q_lora_rank": Range(0, note="0: no q compression"), "model.kv_lora_rank": _NONNEG,
    "model.qk_nope_head_dim": _NONNEG, "model.qk_rope_head_dim": _NONNEG, "model.v_head_dim": _NONNEG,
    "model.n_group": Range(0, note="0: no groups"), "model.topk_group": _NONNEG, "model.routed_scaling_factor": _GT0,
    "training.batch_size": _POS, "training.micro_batch_size": Range(0, note="0: use batch_size"),
    "training.seq_len": _POS, "training.gradient_accumulation_steps": _POS,
    "training.learning_rate": _GT0, "training.min_learning_rate_ratio": Range(0, 1),
    "training.max_steps": _POS, "training.warmup_steps": _NONNEG, "training.weight_decay": _NONNEG,
    "training.adam_beta1": _BETA, "training.adam_beta2": _BETA, "training.adam_eps": _GT0,
    "training.adam_freeze_step": Range(0, note="0: never; else Adam's variance is frozen after that many steps"),
    "training.max_grad_norm": Range(0, note="0: no clipping"), "training.seed": Range(0, 2**32 - 1),
    "training.eval_every": Range(0, note="0: only at the start and the end"),
    "training.eval_batches": _POS, "training.sample_tokens": Range(0, note="0: no sample"),
    "parallel.data_parallel_size": _MESH, "parallel.tensor_parallel_size": _MESH,
    "parallel.pipeline_parallel_size": _MESH, "parallel.sequence_parallel_size": _MESH,
    "parallel.num_microbatches": Range(0, note="0: the default"), "parallel.num_model_chunks": _POS,
    "parallel.compression_ratio": Range(0, 1, lo_open=True), "parallel.powersgd_rank": _POS,
    "parallel.collective_matmul_min_seq": Range(0, note="0: every sequence length"),
    "parallel.compression_warmup_steps": Range(0, note="0: compress from the first step"),
    "parallel.bucket_size_mb": Range(0, note="0: XLA's default thresholds"),
    "parallel.heartbeat_timeout_s": Range(0, note="0: the collective timeout, at most 100"),
    "precision.initial_scale": _GT0, "precision.growth_factor": Range(1),
    "precision.backoff_factor": Range(0, 1, lo_open=True), "precision.growth_interval": _POS,
    "precision.hysteresis": _POS, "precision.min_scale": _GT0, "precision.max_scale": _GT0,
    "precision.max_consecutive_skips": _POS,
    "data.val_fraction": Range(0, 1, hi_open=True), "data.max_corpus_bytes": Range(0, note="0: all of it"),
    "checkpoint.save_every": Range(0, note="0: only at evaluations and the end"), "checkpoint.max_to_keep": _POS,
    "checkpoint.local_every": Range(0, note="0: no emergency checkpoints"),
    "fault_tolerance.hang_timeout_s": Range(0, note="0: no hang watchdog"), "fault_tolerance.hang_factor": _GT0,
    "fault_tolerance.straggler_factor": Range(1), "fault_tolerance.straggler_min_share": Range(0, 1),
    "fault_tolerance.straggler_min_s": _NONNEG, "fault_tolerance.straggler_checks": _POS,
    "logging.log_every": _POS,
    "offload.offload_optim_frac": Range(0, 1), "offload.offload_param_frac": Range(0, 1),
    "offload.devices_per_host": _POS,
    "posttrain.beta": Range(0), "posttrain.delta": Range(0, note="0: off"),
    "posttrain.top_entropy_quantile": Range(0, 1, lo_open=True), "posttrain.sapo_temperature_pos": _GT0,
    "posttrain.sapo_temperature_neg": _GT0, "posttrain.vespo_k_pos": _NONNEG, "posttrain.vespo_lambda_pos": _NONNEG,
    "posttrain.vespo_k_neg": _NONNEG, "posttrain.vespo_lambda_neg": _NONNEG,
    "posttrain.label_smoothing": Range(0, 1, hi_open=True), "posttrain.discopop_tau": _GT0,
    "posttrain.max_sampling_rounds": _POS, "posttrain.center_rewards_coefficient": Range(0, note="0: off"),
    "posttrain.num_generations": Range(2), "posttrain.max_completion_length": _POS,
    "posttrain.temperature": _GT0, "posttrain.top_k": Range(0, note="0: all tokens"),
    "posttrain.top_p": Range(0, 1, lo_open=True), "posttrain.epsilon": Range(0, 1, lo_open=True, hi_open=True),
    "posttrain.epsilon_high": Range(0, note="0: epsilon"), "posttrain.num_iterations": _POS,
    "posttrain.rollout_tp": Range(0, note="0: a host's devices, capped by the kv heads"),
    "posttrain.steps_per_generation": Range(0, note="0: training.gradient_accumulation_steps"),
    "posttrain.rollout_slots": Range(0, note="0: the whole generation at once"),
    "posttrain.generation_batch_size": Range(0, note="0: batch_size x steps_per_generation / accumulation"),
}
"""Every numeric (int or float) key and the values it accepts, checked by :func:`check_ranges` (in :func:`jaxcolossal.config.checks.validate`)."""


def check_ranges(cfg: Config) -> None:
    """Check every key of :data:`RANGES` (NaN and ±inf are refused everywhere).

    Raises:
        ConfigError: ``section.key=value: must be ...``.
    """
    for key, rng in RANGES.items():
        v = functools.reduce(getattr, key.split("."), cfg)
        if v == "auto":  # an AutoFloat key left to its objective's default
            continue
        if not rng.contains(v):
            raise ConfigError(f"{key}={v!r}: {rng.describe('must be' if math.isfinite(v) else 'must be a finite number')}")
