"""The checks of ``training.objective`` and the ``posttrain`` section: the data format each
objective reads, the keys, loss types and reference model DPO and GRPO take, and the features they
do not run with yet; run by :func:`jaxcolossal.config.checks.validate`.

The objectives themselves sit above this floor (:data:`jaxcolossal.train.objective.OBJECTIVES`),
so each one's ``data_format`` reaches the check the other way: the registry declares it here
(:func:`declare_objective`) when the package is imported, and :func:`check_data_format` reads
:data:`OBJECTIVE_FORMATS`.
"""

from __future__ import annotations

import math
import re

from jaxcolossal.config.derived import (DPO_LOSS_TYPES, GRPO_LOSS_TYPES, LABEL_SMOOTHING_LOSSES, dpo_loss_types,
                                        dpo_loss_weights, grpo_prompt_length, pipeline_microbatches, posttrain_beta,
                                        posttrain_loss_type)
from jaxcolossal.config.reward_funcs import reward_specs
from jaxcolossal.config.schema import DPO_ONLY_KEYS, GRPO_ONLY_KEYS, REWARD_ONLY_KEYS, Config, PosttrainConfig
from jaxcolossal.errors import ConfigError

OBJECTIVE_FORMATS: dict[str, tuple[str | None, str]] = {}
"""Each registered objective's name → ``(data_format, reads)``: the ``data.format`` it reads and
only it does (None: any format no objective claims) and the words of the refusal ("DPO reads
preference pairs"), in the registry's order; filled by :func:`declare_objective`."""


def declare_objective(name: str, data_format: str | None, reads: str) -> None:
    """Record what objective ``name`` reads (:data:`OBJECTIVE_FORMATS`); the objectives' registry
    calls it once per objective when it is imported."""
    OBJECTIVE_FORMATS[name] = (data_format, reads)


def check_data_format(cfg: Config) -> None:
    """``training.objective`` against ``data.format``: a format objectives claim (``data_format``) goes
    with those objectives and no other, in both directions (``preference`` with ``dpo`` and ``reward``).

    Raises:
        ConfigError: ``training.objective=dpo with data.format=chat: DPO reads preference pairs and
            only DPO and REWARD do; set both ...``; or an objective no registry line declares.
    """
    t, d = cfg.training, cfg.data
    if t.objective not in OBJECTIVE_FORMATS:
        raise ConfigError(f"training.objective={t.objective}: no objective of that name is registered "
                          f"(registered: {', '.join(OBJECTIVE_FORMATS) or 'none'}; "
                          "jaxcolossal.train.objective.OBJECTIVES)")
    own, what = OBJECTIVE_FORMATS[t.objective]
    fmt = own if own is not None else d.format
    readers = [o for o, (f, _) in OBJECTIVE_FORMATS.items() if f is not None and f == fmt]
    if fmt != d.format or (readers and t.objective not in readers):
        what = what if own is not None else OBJECTIVE_FORMATS[readers[0]][1]
        names = " and ".join(o.upper() for o in readers)
        raise ConfigError(f"training.objective={t.objective} with data.format={d.format}: {what} and only "
                          f"{names} {'does' if len(readers) == 1 else 'do'}; set both training.objective="
                          f"{'|'.join(readers)} and data.format={fmt}, or neither")


def check_objective(cfg: Config) -> None:
    """``training.objective`` against the data (:func:`check_data_format`), and dpo/grpo against
    the reference model and the features they do not run with.

    Raises:
        ConfigError: one line naming the key(s) and what to set.
    """
    t, d = cfg.training, cfg.data
    check_data_format(cfg)
    _check_head(cfg)
    if t.objective == "sft":
        return
    if d.corpus == "stdlib":
        raise ConfigError(f"data.format={d.format} needs data.corpus: JSON-lines files of " + (
            "{'prompt', 'answer'} rows" if t.objective == "grpo" else "{'prompt', 'chosen', 'rejected'} pairs"))
    _check_objective_keys(cfg)
    if t.objective == "reward":
        _check_reward(cfg)
        return
    _check_loss_type(cfg)
    _check_reference(cfg)
    if t.objective == "grpo":
        _check_grpo(cfg)
    _check_posttrain_features(cfg)


def _check_objective_keys(cfg: Config) -> None:
    """A ``posttrain`` key only another objective reads (:data:`~jaxcolossal.config.schema.GRPO_ONLY_KEYS`,
    ``DPO_ONLY_KEYS``, ``REWARD_ONLY_KEYS``) set away from its default: the run would ignore it."""
    objective = cfg.training.objective
    owners = {"grpo": GRPO_ONLY_KEYS, "dpo": DPO_ONLY_KEYS, "reward": REWARD_ONLY_KEYS}
    default = PosttrainConfig()
    for other, keys in owners.items():
        for key in keys if other != objective else ():
            value = getattr(cfg.posttrain, key)
            if value != getattr(default, key):
                raise ConfigError(f"posttrain.{key}={value!r} is a {other.upper()} key, which a {objective.upper()} "
                                  f"run (training.objective={objective}) never reads: remove it")


def _check_head(cfg: Config) -> None:
    """``model.num_labels`` against the objective: the score head with reward-model training only.

    Raises:
        ConfigError: one line naming the keys."""
    n, objective = cfg.model.num_labels, cfg.training.objective  # 0 or 1: config.ranges
    if objective == "reward" and n != 1:
        raise ConfigError("training.objective=reward trains a score head: set model.num_labels=1")
    if objective != "reward" and n:
        raise ConfigError(f"model.num_labels={n} (a score head, no lm_head) trains only with "
                          f"training.objective=reward, not {objective}: set model.num_labels=0")


def _check_reward(cfg: Config) -> None:
    """Reward-model training: the DPO/GRPO keys it does not read, and what it does not run with yet (LoRA,
    and the post-training features :func:`_check_posttrain_features` refuses).

    Raises:
        ConfigError: one line naming the key."""
    po = cfg.posttrain
    for key in ("beta", "loss_type"):
        if getattr(po, key) != "auto":
            raise ConfigError(f"posttrain.{key}={getattr(po, key)!r} is not read by reward-model training "
                              "(training.objective=reward, TRL's RewardTrainer has neither): remove it")
    if cfg.model.lora.enabled:
        raise ConfigError("training.objective=reward does not run with LoRA (model.lora.rank > 0) yet: the score "
                          "head would need training beside the adapters (PEFT's modules_to_save); set "
                          "model.lora.rank=0")
    _check_posttrain_features(cfg)


def _check_loss_type(cfg: Config) -> None:
    """``posttrain.loss_type`` against the objective: one GRPO name, or DPO's list (:func:`_check_dpo_losses`).

    Raises:
        ConfigError: one line naming the key and the allowed values."""
    po, objective = cfg.posttrain, cfg.training.objective
    if objective == "dpo":
        _check_dpo_losses(cfg)
        return
    lt = posttrain_loss_type(cfg)
    if lt not in GRPO_LOSS_TYPES:
        raise ConfigError(f"posttrain.loss_type={lt} is not a GRPO loss; allowed values are auto, "
                          + ", ".join(GRPO_LOSS_TYPES))


def _check_dpo_losses(cfg: Config) -> None:
    """DPO's loss list, its weights, β and the options only some losses read, as TRL 1.16's
    ``DPOConfig.__post_init__`` and ``DPOTrainer.__init__`` check them (and the options set for no loss
    that reads them, which TRL ignores).

    Raises:
        ConfigError: one line naming the key and what to set."""
    po = cfg.posttrain
    names = dpo_loss_types(cfg)
    for name in names:
        if name not in DPO_LOSS_TYPES:
            raise ConfigError(f"posttrain.loss_type={po.loss_type}: {name or '(empty)'} is not a DPO loss; allowed "
                              "values are auto or comma-separated names of " + ", ".join(DPO_LOSS_TYPES))
    try:
        weights = dpo_loss_weights(cfg)
    except ValueError:
        raise ConfigError(f"posttrain.loss_weights={po.loss_weights!r}: expected comma-separated numbers") from None
    if not all(math.isfinite(w) for w in weights):
        raise ConfigError(f"posttrain.loss_weights={po.loss_weights!r}: each weight must be a finite number")
    if len(weights) != len(names):
        raise ConfigError(f"posttrain.loss_weights={po.loss_weights!r} has {len(weights)} weights for "
                          f"{len(names)} loss types ({', '.join(names)}): give one each, or none (1 each)")
    if posttrain_beta(cfg) <= 0:
        raise ConfigError(f"posttrain.beta={po.beta!r}: must be > 0 for DPO (0 is GRPO's no-reference setting)")
    _check_dpo_options(po, names)


def _check_dpo_options(po: PosttrainConfig, names: tuple[str, ...]) -> None:
    """``label_smoothing`` and ``discopop_tau`` against the losses that read them: TRL raises for
    ``exo_pair`` with ε = 0 and documents ``robust``'s ε < 0.5; an option no listed loss reads is refused."""
    eps = po.label_smoothing
    if eps > 0 and not set(names) & set(LABEL_SMOOTHING_LOSSES):
        raise ConfigError(f"posttrain.label_smoothing={eps:g} is read only by the loss types "
                          f"{', '.join(LABEL_SMOOTHING_LOSSES)}, none of which posttrain.loss_type={po.loss_type} "
                          "lists: set it to 0 (sigmoid's conservative DPO was TRL < 1.0's)")
    if "exo_pair" in names and eps == 0:
        raise ConfigError("posttrain.loss_type=exo_pair needs posttrain.label_smoothing > 0 (EXO's ε, as TRL "
                          "requires; the EXO paper recommends 1e-3)")
    if "robust" in names and eps >= 0.5:
        raise ConfigError(f"posttrain.label_smoothing={eps:g}: the robust loss's share of flipped labels must be in "
                          "[0, 0.5) (TRL's documented range; 0.5 divides by zero)")
    if po.discopop_tau != PosttrainConfig.discopop_tau and "discopop" not in names:
        raise ConfigError(f"posttrain.discopop_tau={po.discopop_tau:g} is read only by the discopop loss, which "
                          f"posttrain.loss_type={po.loss_type} does not list: remove it")


def _check_reference(cfg: Config) -> None:
    """``posttrain.reference`` against LoRA, and ``posttrain.ref_model`` against both (TRL's ``ref_model``:
    another model as the reference, held as the frozen copy).

    Raises:
        ConfigError: one line naming the keys and what to set."""
    po, m = cfg.posttrain, cfg.model
    if cfg.training.objective == "grpo" and posttrain_beta(cfg) == 0:
        if po.ref_model:
            raise ConfigError(f"posttrain.ref_model={po.ref_model!r}: GRPO with beta 0 keeps no reference model, so "
                              "it would never be read; set posttrain.beta > 0 or remove it")
        return  # no reference at all
    if po.ref_model and po.reference == "lora_base":
        raise ConfigError(f"posttrain.ref_model={po.ref_model!r} with posttrain.reference=lora_base: the one names "
                          "another model as the reference, the other the LoRA base; set posttrain.reference=frozen")
    if po.reference == "lora_base" and not m.lora.enabled:
        raise ConfigError("posttrain.reference=lora_base needs LoRA (model.lora.rank > 0): without adapters there "
                          "is no base to tell apart from the policy; use posttrain.reference=frozen")
    if po.reference == "frozen" and m.lora.enabled and not po.ref_model:
        raise ConfigError("posttrain.reference=frozen with LoRA would hold a second copy of the base weights; use "
                          "posttrain.reference=lora_base (the base without the adapters is the reference)")


def _check_grpo(cfg: Config) -> None:
    """GRPO's batch against its groups, the row against the completion, and the reward functions
    (imported now, so a missing one is refused before anything compiles)."""
    t, po = cfg.training, cfg.posttrain
    if t.batch_size % po.num_generations:
        raise ConfigError(f"training.batch_size={t.batch_size} completions per step is not a multiple of "
                          f"posttrain.num_generations={po.num_generations} (the completions of one prompt); e.g. "
                          + _grpo_batch_hint(cfg))
    if grpo_prompt_length(cfg) < 1:
        default = " (TRL's default)" if po.max_completion_length == PosttrainConfig.max_completion_length else ""
        raise ConfigError(f"posttrain.max_completion_length={po.max_completion_length}{default} leaves no room for a "
                          f"prompt in training.seq_len={t.seq_len} (a row holds seq_len + 1 tokens: prompt and "
                          "completion): set posttrain.max_completion_length below training.seq_len")
    _check_generation_batch(cfg)
    _check_advantage(cfg)
    reward_specs(po.reward_funcs, po.reward_weights)  # user functions imported now: raises ConfigError
    try:
        re.compile(po.format_pattern)
    except re.error as e:
        raise ConfigError(f"posttrain.format_pattern={po.format_pattern!r}: not a regular expression ({e})") from None


RLOO_UNREAD = ("loss_type", "scale_rewards", "importance_sampling_level", "delta", "top_entropy_quantile",
               "use_bias_correction_kl", "sapo_temperature_pos", "sapo_temperature_neg", "vespo_k_pos",
               "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg")
"""The GRPO keys ``advantage=rloo`` does not read (TRL's ``RLOOTrainer`` has one loss and no such options)."""


def _check_advantage(cfg: Config) -> None:
    """``advantage=rloo`` with a ``GRPOTrainer``-only key set, or ``normalize_advantages`` (RLOO's) without it.

    Raises:
        ConfigError: one line naming the key."""
    po, default = cfg.posttrain, PosttrainConfig()
    if po.advantage != "rloo":
        if po.normalize_advantages:
            raise ConfigError("posttrain.normalize_advantages=true is RLOO's (TRL's RLOOConfig): set "
                              "posttrain.advantage=rloo, or use posttrain.scale_rewards for GRPO's group advantages")
        return
    for key in RLOO_UNREAD:
        if getattr(po, key) != getattr(default, key):
            raise ConfigError(f"posttrain.{key}={getattr(po, key)!r} is a GRPOTrainer option that "
                              "posttrain.advantage=rloo (TRL's RLOOTrainer: one clipped sequence-level loss) never "
                              "reads: remove it")


def _check_generation_batch(cfg: Config) -> None:
    """TRL's ``steps_per_generation`` / ``generation_batch_size``: one of them, whole optimizer steps.

    Raises:
        ConfigError: one line naming the key and the values that work."""
    t, po = cfg.training, cfg.posttrain
    ga = t.gradient_accumulation_steps
    if po.steps_per_generation and po.generation_batch_size:
        raise ConfigError("posttrain.steps_per_generation and posttrain.generation_batch_size can not both be set "
                          "(as in TRL): set one")
    if po.steps_per_generation % ga:
        raise ConfigError(f"posttrain.steps_per_generation={po.steps_per_generation} microbatches is not a whole number "
                          f"of optimizer steps of training.gradient_accumulation_steps={ga}: use a multiple of {ga}")
    if po.generation_batch_size % t.batch_size:
        raise ConfigError(f"posttrain.generation_batch_size={po.generation_batch_size} is not a multiple of "
                          f"training.batch_size={t.batch_size} (a generation feeds whole optimizer steps)")


def _grpo_batch_hint(cfg: Config) -> str:
    """A ``training.batch_size`` that holds whole groups of ``posttrain.num_generations`` and passes the
    data-parallel checks too: the nearest multiple of ``num_generations`` and of
    ``gradient_accumulation_steps`` × the data-parallel size (when ``parallel.data_parallel_size`` is
    set), else of the power of two the given batch splits by (so it splits wherever the given one does)."""
    t, g, dp = cfg.training, cfg.posttrain.num_generations, cfg.parallel.data_parallel_size
    acc = max(t.gradient_accumulation_steps, 1)
    split = dp if dp > 0 else (t.batch_size // acc) & -(t.batch_size // acc) or 1  # the lowest set bit
    unit = math.lcm(g, acc * split)
    value = max(unit, round(t.batch_size / unit) * unit)
    why = (f"gradient_accumulation_steps × data_parallel_size = {acc * split}" if dp > 0 else
           f"{acc * split}, which {t.batch_size} splits by over the data-parallel group")
    return f"training.batch_size={value} (a multiple of num_generations={g} and of {why})"


def _check_pipeline(cfg: Config) -> None:
    """An objective over a pipeline (:mod:`jaxcolossal.train.pipeline_objective`): DPO or GRPO on a dense model,
    GPipe's schedule (its backward is autodiff of the forward ticks through the objective's head), the
    objective's microbatches the pipeline's, no LoRA.

    Raises:
        ConfigError: one line naming the key and what to set."""
    t, p, pp = cfg.training, cfg.parallel, cfg.parallel.pipeline_parallel_size
    if pp in (1,) or pp == -1:
        return
    name = f"training.objective={t.objective} with parallel.pipeline_parallel_size={pp}"
    if t.objective not in ("dpo", "grpo"):
        raise ConfigError(f"{name}: only DPO and GRPO run over a pipeline yet; set parallel.pipeline_parallel_size=1")
    if p.pipeline_schedule != "gpipe":
        raise ConfigError(f"{name} runs GPipe's schedule (the objective's head is differentiated through the "
                          f"forward ticks): set parallel.pipeline_schedule=gpipe, not {p.pipeline_schedule}")
    m = pipeline_microbatches(cfg, pp)
    if t.gradient_accumulation_steps != m:
        raise ConfigError(f"{name}: the objective's microbatches are the pipeline's {m}; set "
                          f"training.gradient_accumulation_steps={m}")
    for what, on in (("a mixture of experts (model.num_experts > 0)", cfg.model.moe),
                     ("LoRA (model.lora.rank > 0)", cfg.model.lora.enabled)):
        if on:
            raise ConfigError(f"{name} does not run with {what} yet; set parallel.pipeline_parallel_size=1")


def _check_posttrain_features(cfg: Config) -> None:
    t, d, p, m = cfg.training, cfg.data, cfg.parallel, cfg.model
    name = t.objective.upper()
    _check_pipeline(cfg)
    why = {           "parallel.sequence_parallel_size > 1": (p.sequence_parallel_size not in (1,),
                                                   "ring attention reorders the tokens the log-probs are summed over"),
           "data.packing_mask": (d.packing_mask, "a row holds one response"),
           "parallel.gradient_compression": (p.gradient_compression != "none", f"not tested with {name} yet"),
           "offload (offload_param_frac, nvme_path)": (
               cfg.offload.offload_param_frac > 0 or bool(cfg.offload.nvme_path),
               "not tested with REWARD yet" if t.objective == "reward" else "the reference copy is not offloaded yet"),
           "model.attention_impl=cudnn": (t.objective == "grpo" and m.attention_impl == "cudnn",
                                          "the rollout rows' segment ids (left-padded prompts) need attention_impl "
                                          "xla or flash")}
    for what, (on, reason) in why.items():
        if on:
            raise ConfigError(f"training.objective={t.objective} does not run with {what}: {reason}")
