"""GRPO's rollout phase: completions sampled from the policy on the training mesh, scored, and laid
out as the train step's batch (Shao et al., 2024; TRL 1.16 ``GRPOTrainer._generate_and_score_completions``).

Every ``posttrain.num_iterations`` (μ) steps, :meth:`Rollouts.batch` draws ``batch_size / G`` prompts
(a pure function of the seed and the step), samples ``G = num_generations`` completions of each with
the KV-cached sampler (:func:`jaxcolossal.generate.make_generator`) on the *current* params as training
lays them out (no copy of the weights), scores them with the reward functions
(:mod:`jaxcolossal.posttrain.rewards`), normalises the rewards within each group into advantages,
and, when the loss needs them, computes the per-token log-probs of the sampling policy (μ > 1) and
of the reference (``beta > 0``) through the chunked log-prob path. The μ steps of one rollout reuse
its batch; with ``checkpoint.dir`` it is also written to ``<checkpoint.dir>/rollouts/<step>.npz`` so
that a run resumed between them continues bit for bit.

A completion ends at the first end-of-text id: the tokenizer's ``eos_id`` or any id of the
``eos_token_id`` list of ``model.init_from``'s ``generation_config.json`` (LLaMA 3's ``<|eot_id|>``,
``<|eom_id|>``, ``<|end_of_text|>``: :func:`jaxcolossal.generate.run_eos_ids`); each of them counts as an
end for the truncation flags and is left out of the text the reward functions read.

A row is ``[left-padded prompt (P tokens) | completion (C tokens)]``, ``P = seq_len + 1 - C``; the
batch is ``inputs``/``targets`` (the row less its last/first token, int32 ``[B, seq_len]``),
``loss_mask`` (1 on the completion tokens up to and including the end-of-text one), ``segment_ids``
(0 on the pads, 1 elsewhere) and ``positions`` (counted from the prompt's first real token, as the
sampler counts them), and fp32 ``advantages``, ``old_logps``, ``ref_logps`` and ``tokens_per_step`` (the
generation's completion tokens over its optimizer steps, repeated), all ``[B, seq_len]``, sharded like
every training batch (the batch over the data axes), each step's rows in the order of
:func:`jaxcolossal.parallel.microbatch_order.microbatch_order`. With ``posttrain.dynamic_sampling`` a
rollout samples rounds of prompts until its groups with a signal fill the generation (:meth:`Rollouts._sample`).
"""
from __future__ import annotations

import functools
import json
import os
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding

from jaxcolossal.config import ConfigError
from jaxcolossal.config.derived import (grpo_generation_batch, grpo_prompt_length, posttrain_beta, rollout_reshards,
                                         rollout_tp)
from jaxcolossal.data.prompts import PromptData, prompt_batch
from jaxcolossal.errors import RewardError
from jaxcolossal.generate import Sampling, data_shards, make_generator, pad_prompts, run_eos_ids
from jaxcolossal.parallel.decode_layout import decode_mesh, make_reshard
from jaxcolossal.models.layers.logprobs import token_logprobs
from jaxcolossal.parallel.layer_scan import fetch_layer
from jaxcolossal.parallel.microbatch_order import microbatch_order
from jaxcolossal.parallel.pipeline_executor import make_pipeline_hidden
from jaxcolossal.parallel.sharding import RULES, logical_to_spec
from jaxcolossal.posttrain.reward_model import ModelReward
from jaxcolossal.posttrain.rewards import RewardSet, TrainerState, make_rewards
from jaxcolossal.runtime.dist_logger import get_dist_logger

__all__ = ["Rollouts", "completion_ids", "group_advantages", "rloo_advantages", "rollout_token_logps", "row_layout",
           "truncated_rows"]

ROLLOUTS_KEPT = 2
"""Rollout batches kept in ``<checkpoint.dir>/rollouts`` (the newest ones)."""
COMPLETIONS_SHOWN = 4
"""Completions of a rollout that ``posttrain.log_completions`` shows (the first ones: the first group's)."""


def group_advantages(rewards: np.ndarray, group: int, scale: str) -> tuple[np.ndarray, np.ndarray]:
    """TRL's ``sum_then_normalize`` advantages: ``(r - mean(group)) / (std + 1e-4)`` with the group's
    std (``group``), the batch's (``batch``) or none (``none``); Bessel-corrected, NaN-skipping
    (unscorable rows are NaN and get advantage 0). Returns fp32 ``(advantages [n], no_signal [n])``:
    ``no_signal`` where the std is 0 (TRL's ``is_std_zero``) or undefined (fewer than two scored
    completions, which TRL counts as a signal: such a group's advantages are 0 all the same)."""
    grouped = rewards.reshape(-1, group)
    with warnings.catch_warnings():  # an all-NaN group (nothing scored) is NaN, then advantage 0
        warnings.simplefilter("ignore", RuntimeWarning)
        mean = np.repeat(np.nanmean(grouped, axis=1), group)
        if scale == "batch":
            std = np.full_like(rewards, np.nanstd(rewards, ddof=1))
        else:
            std = np.repeat(np.nanstd(grouped, axis=1, ddof=1), group)
    adv = rewards - mean
    if scale != "none":
        adv = adv / (std + 1e-4)
    return np.nan_to_num(adv, nan=0.0).astype(np.float32), np.isclose(std, 0.0) | np.isnan(std)


def rloo_advantages(rewards: np.ndarray, group: int, kl: np.ndarray | None, beta: float,
                    normalize: bool) -> tuple[np.ndarray, np.ndarray]:
    """TRL 1.16 ``RLOOTrainer``'s advantages, fp32 ``[n]``: with ``beta > 0`` each reward first less
    ``β·kl`` (``kl [n]``: the completion's summed ``log π_old - log π_ref``), then less the mean of the
    *other* scored completions of its group (the leave-one-out baseline); with ``normalize`` the
    advantages are then ``(a - mean) / (std + 1e-4)`` over the batch (Bessel-corrected); unscorable rows
    (NaN) get 0. Also returns ``no_signal [n]`` as :func:`group_advantages` does (the group's std of the
    penalised rewards is 0 or undefined)."""
    if beta and kl is not None:
        rewards = rewards - beta * kl
    grouped = rewards.reshape(-1, group)
    scored = (~np.isnan(grouped)).sum(axis=1, keepdims=True)
    with warnings.catch_warnings():  # a group with one scored completion has no baseline: NaN, then 0
        warnings.simplefilter("ignore", RuntimeWarning)
        baseline = (np.nansum(grouped, axis=1, keepdims=True) - grouped) / (scored - 1)
        adv = (grouped - baseline).reshape(-1)
        if normalize:
            adv = (adv - np.nanmean(adv)) / (np.nanstd(adv, ddof=1) + 1e-4)
        std = np.repeat(np.nanstd(grouped, axis=1, ddof=1), group)
    return np.nan_to_num(adv, nan=0.0).astype(np.float32), np.isclose(std, 0.0) | np.isnan(std)


def row_layout(prompt_tokens: np.ndarray, prompt_mask: np.ndarray, completions: np.ndarray, lengths: np.ndarray,
               truncated_out: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """The train step's rows (module docstring) from left-padded prompts ``[B, P]`` (``prompt_mask``
    bool), completions int ``[B, C]`` and their ``lengths [B]`` (eos included); ``truncated_out``
    (bool ``[B]``): rows left out of the loss (``mask_truncated_completions``)."""
    B, P = prompt_tokens.shape
    C = completions.shape[1]
    tokens = np.concatenate([prompt_tokens, completions], axis=1).astype(np.int32)
    comp_mask = (np.arange(C)[None, :] < lengths[:, None]).astype(np.float32)
    if truncated_out is not None:
        comp_mask = comp_mask * (~truncated_out)[:, None]
    real = np.concatenate([prompt_mask, np.ones((B, C), bool)], axis=1)
    loss_mask = np.zeros((B, P + C - 1), np.float32)
    loss_mask[:, P - 1:] = comp_mask  # target j + P - 1 is completion token j
    positions = np.maximum(np.cumsum(real, axis=1) - 1, 0).astype(np.int32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "loss_mask": loss_mask,
            "segment_ids": real[:, :-1].astype(np.int32), "positions": positions[:, :-1]}


def completion_ids(completions: np.ndarray, lengths: np.ndarray, eos: tuple[int, ...], vocab: int) -> list[list[int]]:
    """Each completion's ids as the reward functions read them: its first ``lengths`` tokens (int
    ``[B, C]``, ``[B]``) less every ``eos`` id and the ids at or past ``vocab`` (the tokenizer's size)."""
    return [[int(i) for i in row[:n] if int(i) not in eos and i < vocab] for row, n in zip(completions, lengths)]


def truncated_rows(completions: np.ndarray, lengths: np.ndarray, eos: tuple[int, ...]) -> np.ndarray:
    """bool ``[B]``: the rows that did not end at an end-of-text id (any of ``eos``; all rows when
    there is none), i.e. ran to ``max_completion_length``."""
    if not eos:
        return np.ones(len(lengths), bool)
    last = completions[np.arange(len(lengths)), np.maximum(lengths - 1, 0)]
    return ~np.isin(last, np.asarray(eos))


def rollout_token_logps(plan, params, inputs, targets, mask, segment_ids, positions) -> jax.Array:
    """The rollout's per-token log-probs of ``targets`` under ``params`` (the sampling policy's
    ``old_logps`` or the reference's ``ref_logps``), fp32 ``[B, t]``, 0 where ``mask`` is 0: the
    family's hidden states, then the chunked log-probs (token and vocabulary chunks, never the whole
    fp32 logits: :func:`jaxcolossal.models.layers.logprobs.token_logprobs`). ``plan``: the run's
    :class:`~jaxcolossal.train.state.TrainPlan` (its family, sharder and model config); ``params``
    laid out as training holds them (offloaded leaves are fetched in); ``inputs``/``targets``/
    ``segment_ids``/``positions`` int32 and ``mask`` fp32, ``[B, t]`` with the batch sharding. Over a pipeline
    the layers run on its GPipe forward ticks (:func:`jaxcolossal.parallel.pipeline_executor.make_pipeline_hidden`).
    :class:`Rollouts` jits it with ``plan`` bound; so does the GPU compile test. The log-probs are those
    of ``logits / posttrain.temperature``, as TRL computes its old and reference log-probs (trl 1.16)."""
    cfg, family, shard = plan.cfg.model, plan.family, plan.sharder
    params = fetch_layer(params)
    if plan.mesh_shape["pp"] > 1:  # over a pipeline: its forward ticks, then the family's final norm
        x = make_pipeline_hidden(plan)(params, inputs, None, segment_ids, positions)
        h = family.final_norm(params, x, cfg)
    else:
        h = family.hidden_states(params, inputs, cfg, shard, shard.is_sharded("vocab"), segment_ids, positions)
    return token_logprobs(h, family.head_weight(params, cfg), targets, mask, cfg.vocab_size, shard,
                          cfg.loss_chunk_tokens, cfg.loss_chunk_vocab, cfg.final_logit_softcapping,
                          plan.cfg.posttrain.temperature)


def group_has_signal(rewards: np.ndarray, group: int) -> np.ndarray:
    """bool ``[n / group]``: the groups whose scored rewards are not all equal (a nonzero,
    Bessel-corrected std over at least two scored completions): DAPO's dynamic sampling keeps these."""
    grouped = rewards.reshape(-1, group)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        std = np.nanstd(grouped, axis=1, ddof=1)
    return ~(np.isclose(std, 0.0) | np.isnan(std))


@dataclass
class _Groups:
    """Sampled, scored completions: prompt indices ``[n]``, left-padded prompts ``[n, P]`` and mask,
    completions ``[n, C]`` and lengths ``[n]``, rewards ``[n, F]``, texts; the generation's seconds and
    the tokens it generated (over every round)."""

    idx: np.ndarray
    prompt_tokens: np.ndarray
    prompt_mask: np.ndarray
    completions: np.ndarray
    lengths: np.ndarray
    per_func: np.ndarray
    texts: list
    seconds: float
    generated: int

    def group(self, i: int, size: int) -> "_Groups":
        """Group ``i`` (rows ``i·size`` to ``(i+1)·size``)."""
        rows = slice(i * size, (i + 1) * size)
        return _Groups(self.idx[rows], self.prompt_tokens[rows], self.prompt_mask[rows], self.completions[rows],
                       self.lengths[rows], self.per_func[rows], self.texts[rows], 0.0, 0)

    @staticmethod
    def concat(parts: list["_Groups"], generated: int) -> "_Groups":
        def cat(name):
            return np.concatenate([getattr(p, name) for p in parts])
        return _Groups(cat("idx"), cat("prompt_tokens"), cat("prompt_mask"), cat("completions"), cat("lengths"),
                       cat("per_func"), [t for p in parts for t in p.texts], 0.0, generated)


@dataclass
class _Rollout:
    """One rollout: its step, the host batch (global numpy arrays) and its metrics."""

    step: int
    host: dict
    metrics: dict
    placed: dict = field(default_factory=dict)
    """Each slice of ``host`` (the step's ``batch_size`` rows) on the mesh, placed once for the steps that reuse it."""


class Rollouts:
    """GRPO's batches (module docstring): ``batch(step, state)`` the train step's batch of ``step``
    from the policy in ``state``; ``batch(step)`` without a state a batch of zeros of the same
    shapes (to compile the step). ``metrics``: the last rollout's, merged into the step's log.
    ``shown``: with ``posttrain.log_completions``, the first :data:`COMPLETIONS_SHOWN` completions of
    the last rollout sampled here (:meth:`take_shown`), else ``[]``.

    Raises (``batch``):
        FileNotFoundError: a resume between the μ steps of a rollout whose batch was not saved
            (``<checkpoint.dir>/rollouts``).
    """

    on_policy = True

    def __init__(self, cfg, plan, prompts: PromptData, tokenizer, batch_sharding: NamedSharding,
                 held: PromptData | None = None):
        t, po = cfg.training, cfg.posttrain
        self.cfg, self.plan, self.data, self.tok, self.sharding = cfg, plan, prompts, tokenizer, batch_sharding
        self.held = held if held is not None and len(held) else prompts
        self.G, self.B, self.mu = po.num_generations, t.batch_size, po.num_iterations
        self.k = grpo_generation_batch(cfg) // t.batch_size
        """Optimizer steps one generation feeds per iteration (TRL's ``steps_per_generation`` in optimizer steps)."""
        self.period = self.k * self.mu
        """Optimizer steps between two rollouts."""
        self.microbatch_order = microbatch_order(t.batch_size, getattr(plan, "data_size", 1),
                                                 t.gradient_accumulation_steps)
        """The order of a step's rows on the mesh (:mod:`jaxcolossal.parallel.microbatch_order`)."""
        self.P, self.C = grpo_prompt_length(cfg), po.max_completion_length
        def reward_model(path):  # posttrain.reward_funcs=model:PATH, sharded as the policy's params
            return ModelReward(path, getattr(plan, "mesh", None), tokenizer, cfg.parallel.zero_stage)
        self.rewards: RewardSet = make_rewards(po.reward_funcs, po.reward_weights, po.format_pattern, reward_model)
        try:
            self.eos: tuple[int, ...] = run_eos_ids(tokenizer, cfg.model.init_from or None)
        except ValueError as e:
            raise ConfigError(f"model.init_from={cfg.model.init_from!r}: {e}") from None
        self._refuse_what_trains_nothing(prompts)
        self._warned_unscored = False
        self.sampling = Sampling(temperature=po.temperature, top_k=po.top_k, top_p=po.top_p)
        self.dir = os.path.join(cfg.checkpoint.dir, "rollouts") if cfg.checkpoint.dir else ""
        self.current: _Rollout | None = None
        self.metrics: dict = {}
        self.shown: list[dict] = []
        self._generators: dict = {}
        self._logps = jax.jit(functools.partial(rollout_token_logps, plan))
        mesh = getattr(plan, "mesh", None)
        self.decode_tp = rollout_tp(cfg, mesh.size, jax.local_device_count()) if mesh is not None else 1
        reshards = mesh is not None and rollout_reshards(cfg, mesh.shape, self.decode_tp)
        self.gen_mesh = decode_mesh(mesh, self.decode_tp) if reshards else mesh
        """The sampler's mesh: the decode layout's (:mod:`jaxcolossal.parallel.decode_layout`) or the training one."""
        self._reshard = None

    def _refuse_what_trains_nothing(self, prompts: PromptData) -> None:
        """Before anything compiles: a reward function that cannot take the rows' fields, ``exact_match``
        on rows without an ``answer``, ``mask_truncated_completions`` without an end-of-text id.

        Raises:
            ConfigError: one line naming the key (or the function) and what works."""
        cfg = self.cfg
        self.rewards.check_fields(list(dict.fromkeys(prompts.columns + self.held.columns)))
        self._check_answers(prompts, "prompt")
        if self.held is not prompts:
            self._check_answers(self.held, f"held-out prompt (data.val_fraction={cfg.data.val_fraction:g})")
        if cfg.posttrain.mask_truncated_completions and not self.eos:
            raise ConfigError(f"posttrain.mask_truncated_completions=true needs an end-of-text id, and data.tokenizer="
                              f"{cfg.data.tokenizer} has none (nor has model.init_from's generation_config.json): "
                              "every completion would count as truncated and none would train; set "
                              "posttrain.mask_truncated_completions=false")

    def _check_answers(self, data: PromptData, what: str) -> None:
        """``exact_match`` scores a row by its ``answer``: refuse prompts none of which has one.

        Raises:
            ConfigError: ``exact_match`` listed and no row of ``data`` has an ``answer``."""
        if "exact_match" in self.rewards.names and all(a is None for a in data.column("answer", range(len(data)))):
            raise ConfigError(f"posttrain.reward_funcs={self.cfg.posttrain.reward_funcs}: exact_match compares a "
                              f"completion with its row's 'answer', and no {what} row of data.corpus="
                              f"{self.cfg.data.corpus!r} has one, so nothing would be scored; add an 'answer' to the "
                              "rows, or name another reward function")

    # ------------------------------------------------------------------ the batch
    def batch(self, step: int, state: Any = None) -> dict:
        """The train step's batch of optimizer step ``step`` (module docstring)."""
        if state is None:
            return self._place(self._zeros())
        first = step - step % self.period
        if self.current is None or self.current.step != first:
            self.current = self._load(first) if step != first else self._roll(first, state)
            self.metrics = self.current.metrics
        j = (step - first) % self.k  # TRL's order: every slice once, then again for each of the μ iterations
        if j not in self.current.placed:  # the step's microbatches: consecutive rows of the slice on any layout
            order = j * self.B + self.microbatch_order
            self.current.placed[j] = self._place({k: v[order] for k, v in self.current.host.items()})
        return self.current.placed[j]

    def _zeros(self) -> dict:
        t = self.P + self.C - 1
        ints = {k: np.zeros((self.B, t), np.int32) for k in ("inputs", "targets", "segment_ids", "positions")}
        return ints | {k: np.zeros((self.B, t), np.float32) for k in ("loss_mask", "advantages", "old_logps",
                                                                           "ref_logps", "tokens_per_step")}

    def _place(self, host: dict) -> dict:
        return {k: jax.make_array_from_callback(v.shape, self.sharding, lambda idx, v=v: v[idx])
                for k, v in host.items()}

    # ------------------------------------------------------------------ one rollout, in phases
    def _roll(self, step: int, state: Any) -> _Rollout:
        t0 = time.perf_counter()
        jax.block_until_ready(state.params)  # the previous update's time is not the rollout's
        t1 = time.perf_counter()
        g, sampling_metrics, t_gen = self._sample(step, state)
        t3 = time.perf_counter()
        total = self.rewards.total(g.per_func)
        truncated = self._truncated(g.completions, g.lengths)
        host = row_layout(g.prompt_tokens, g.prompt_mask, g.completions, g.lengths,
                          truncated if self.cfg.posttrain.mask_truncated_completions else None)
        host.update(self._policy_logps(state, host))
        t4 = time.perf_counter()
        adv, std_zero, kl_metric = self._advantages(total, host)
        host["advantages"] = np.repeat(adv[:, None], host["inputs"].shape[1], axis=1)
        # TRL's num_items_in_batch over the generation's optimizer steps (dapo, cispo, vespo divide by it)
        host["tokens_per_step"] = np.full(host["inputs"].shape, host["loss_mask"].sum() / self.k, np.float32)
        if self.cfg.posttrain.log_completions:
            self.shown = self._shown(step, g.idx, g.texts, g.per_func, total, adv)
        metrics = self._metrics(g.per_func, total, std_zero, g.lengths, truncated) | kl_metric | sampling_metrics
        metrics.update({"time/wait_update_s": t1 - t0, "time/rollout_s": t_gen, "time/reward_s": t3 - t1 - t_gen,
                        "time/logps_s": t4 - t3, "rollout_tokens_per_s": float(g.generated) / max(t_gen, 1e-9)})
        self._save(step, host, metrics)
        return _Rollout(step, host, metrics)

    def _sample(self, step: int, state: Any) -> tuple["_Groups", dict, float]:
        """The generation's completions, scored: one round of ``k·B/G`` prompts × ``G``; with
        ``posttrain.dynamic_sampling`` (DAPO's dynamic sampling, as verl/OpenRLHF run it) rounds of as
        many prompts again until that many groups whose rewards are not all equal are gathered (at most
        ``max_sampling_rounds``; short of them, the last dropped groups fill the batch, advantage 0).
        Returns the groups, the ``sampling/*`` metrics (with dynamic sampling) and the generation seconds."""
        po = self.cfg.posttrain
        need = self.k * self.B // self.G
        kept, dropped, t_gen, generated = [], [], 0.0, 0
        rounds = po.max_sampling_rounds if po.dynamic_sampling else 1
        for r in range(rounds):
            g = self._sample_round(step, state, need, r)
            t_gen += g.seconds
            generated += g.generated
            if not po.dynamic_sampling:
                return g, {}, t_gen
            signal = group_has_signal(self.rewards.total(g.per_func), self.G)
            kept += [g.group(i, self.G) for i in np.flatnonzero(signal)]
            dropped += [g.group(i, self.G) for i in np.flatnonzero(~signal)]
            if len(kept) >= need:
                break
        filled = max(need - len(kept), 0)
        chosen = kept[:need] + dropped[len(dropped) - filled:]
        metrics = {"sampling/rounds": float(r + 1), "sampling/groups_dropped": float(len(dropped)),
                   "sampling/groups_filled": float(filled)}
        return _Groups.concat(chosen, generated), metrics, t_gen

    def _sample_round(self, step: int, state: Any, groups: int, r: int) -> "_Groups":
        """Round ``r`` of a rollout: ``groups`` prompts (round 0: the step's own draw, :func:`prompt_batch`;
        later rounds: draws of their own, a pure function of the step and the round), ``G`` completions
        each, scored."""
        seed = self.cfg.training.seed
        draw = step // self.period if r == 0 else np.random.default_rng([seed, step // self.period, r]).integers(2**31)
        idx = np.repeat(prompt_batch(self.data, int(draw), groups, seed), self.G)
        prompt_tokens, prompt_mask = self._prompts(self.data, idx)
        key = jax.random.fold_in(jax.random.key(seed), step)
        if r:
            key = jax.random.fold_in(key, r)
        t = time.perf_counter()
        completions, lengths = self._generate(state.model_params, prompt_tokens, prompt_mask, key, self.sampling)
        seconds = time.perf_counter() - t
        per_func, texts = self._score(self.data, idx, completions, lengths, f"step {step + 1}",
                                      TrainerState(step, self.cfg.training.max_steps))
        self._check_scored(per_func, step)
        return _Groups(idx, prompt_tokens, prompt_mask, completions, lengths, per_func, texts, seconds,
                       int(lengths.sum()))

    def _advantages(self, total: np.ndarray, host: dict) -> tuple[np.ndarray, np.ndarray, dict]:
        """Each completion's advantage ``[n]``, its group's no-signal flag ``[n]`` and the rollout's own
        metrics: GRPO's group advantages (:func:`group_advantages`), or RLOO's (:func:`rloo_advantages`,
        the KL from the sampling policy's and the reference's log-probs; TRL's ``kl`` metric, the mean per
        completion token of ``log π_old - log π_ref``)."""
        po = self.cfg.posttrain
        if po.advantage != "rloo":
            return (*group_advantages(total, self.G, po.scale_rewards), {})
        beta = posttrain_beta(self.cfg)
        kl, metric = None, {}
        if beta:
            per_token = (host["old_logps"] - host["ref_logps"]) * host["loss_mask"]
            kl = per_token.sum(axis=1)
            metric = {"kl": float(per_token.sum() / max(host["loss_mask"].sum(), 1.0))}
        return (*rloo_advantages(total, self.G, kl, beta, po.normalize_advantages), metric)

    def _shown(self, step: int, idx, texts: list[str], per_func: np.ndarray, total: np.ndarray,
               adv: np.ndarray) -> list[dict]:
        """TRL's ``log_completions`` rows of the first :data:`COMPLETIONS_SHOWN` completions: ``step``
        (the optimizer step it trains, from 1), ``prompt``, ``completion``, each function's reward by its
        name, ``reward`` (the weighted sum) and ``advantage`` (NaN: no reward)."""
        rows = []
        for r in range(min(COMPLETIONS_SHOWN, len(texts))):
            funcs = {n: float(per_func[r, j]) for j, n in enumerate(self.rewards.names)}
            rows.append({"step": step + 1, "prompt": self.data.prompts[idx[r]], "completion": texts[r], **funcs,
                         "reward": float(total[r]), "advantage": float(adv[r])})
        return rows

    def take_shown(self) -> list[dict]:
        """The rows of :attr:`shown`, once: a rollout's completions are shown at one logged step."""
        rows, self.shown = self.shown, []
        return rows

    def _prompts(self, data: PromptData, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Left-padded prompt tokens and mask ``[B, P]``, every row ``P`` wide."""
        toks, mask = pad_prompts([data.tokens[i] for i in idx], pad_id=self._pad)
        width = toks.shape[1]
        if width < self.P:
            toks = np.pad(toks, ((0, 0), (self.P - width, 0)), constant_values=self._pad)
            mask = np.pad(mask, ((0, 0), (self.P - width, 0)))
        return toks, mask

    @property
    def _pad(self) -> int:
        """The pad id: the tokenizer's eos (else the first end id, else 0)."""
        own = getattr(self.tok, "eos_id", None)
        return int(own) if own is not None else self.eos[0] if self.eos else 0

    def _generate(self, params, tokens, mask, key, sampling: Sampling) -> tuple[np.ndarray, np.ndarray]:
        """Completions int32 ``[B, C]`` and lengths ``[B]``, gathered to every process. With
        ``posttrain.rollout_layout=decode`` the params are resharded into the decode layout first
        (:mod:`jaxcolossal.parallel.decode_layout`); that copy is dropped on return."""
        if self.gen_mesh is not self.plan.mesh:
            if self._reshard is None:
                self._reshard, _ = make_reshard(params, self.gen_mesh)
            params = self._reshard(params)
        fn = self._generator(params, sampling)
        batch_sharding = NamedSharding(self.gen_mesh, logical_to_spec(("batch", None), RULES))
        put = {k: jax.make_array_from_callback(v.shape, batch_sharding, lambda i, v=v: v[i])
               for k, v in (("tokens", tokens), ("mask", mask))}
        out, lengths = fn(params, put["tokens"], put["mask"], key)
        if jax.process_count() > 1:
            out, lengths = multihost_utils.process_allgather((out, lengths), tiled=True)
        return np.asarray(out), np.asarray(lengths)

    def _generator(self, params, sampling: Sampling):
        """The jitted sampler for the params' layout (built once per sampling mode)."""
        name = "greedy" if sampling.is_greedy else "sampled"
        if name not in self._generators:
            specs = jax.tree.map(lambda x: x.sharding.spec, params)
            self._generators[name] = make_generator(
                self.plan.family, self.cfg.model, self.C, sampling, eos_id=self.eos, pad_id=self._pad,
                mesh=self.gen_mesh, param_specs=specs, fp8=self.cfg.precision.fp8, slots=self._slots())
        return self._generators[name]

    def _slots(self) -> int | None:
        """``posttrain.rollout_slots`` rounded up to a multiple of the sampler's data shards; ``None``: static."""
        slots = self.cfg.posttrain.rollout_slots
        if not slots:
            return None
        shards = data_shards(self.gen_mesh)
        return -(-slots // shards) * shards

    def _score(self, data: PromptData, idx: np.ndarray, completions: np.ndarray, lengths: np.ndarray, where: str,
               state: TrainerState) -> tuple[np.ndarray, list[str]]:
        """Each reward function's values ``[B, F]`` for the completions of prompts ``idx`` of ``data``, and
        the completions' texts (every eos id dropped, ids past the tokenizer's vocabulary skipped:
        :func:`completion_ids`). The functions get the rows' prompts as given, the texts (a chat
        prompt's as ``[{"role": "assistant", "content": text}]``) and every field of the rows.

        Raises:
            RewardError: as :meth:`RewardSet.score`, naming ``where``."""
        ids = completion_ids(completions, lengths, self.eos, self.tok.vocab_size)
        texts = [self.tok.decode(np.asarray(r, np.int32)) for r in ids]
        comps = [[{"role": "assistant", "content": t}] if data.is_chat(i) else t for t, i in zip(texts, idx)]
        fields = {k: data.column(k, idx) for k in data.columns}
        per_func = self.rewards.score([data.prompts[i] for i in idx], comps, ids, fields, where, state)
        return per_func, texts

    def _check_scored(self, per_func: np.ndarray, step: int) -> None:
        """Stop on a step no function scored (it would train nothing, silently); warn once, as TRL warns,
        when some completions have no reward.

        Raises:
            RewardError: every reward of the step is None or NaN."""
        unscored = np.all(np.isnan(per_func), axis=1)
        if unscored.all():
            raise RewardError(f"every reward function ({', '.join(self.rewards.names)}) returned None or NaN for all "
                              f"{len(unscored)} completions of step {step + 1}: a step without a reward trains "
                              "nothing. Return a float for the completions a function can score (0.0 where none "
                              "applies)")
        if unscored.any() and not self._warned_unscored:
            self._warned_unscored = True
            get_dist_logger().warning(f"step {step + 1}: {int(unscored.sum())} of {len(unscored)} completions have no "
                                      "reward (every function returned None or NaN): their advantage is 0, as in TRL "
                                      "(said once per run)", ranks=[0])

    def _truncated(self, completions: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """Rows that ended at ``max_completion_length`` without an end-of-text id (:func:`truncated_rows`)."""
        return truncated_rows(completions, lengths, self.eos)

    def _policy_logps(self, state: Any, host: dict) -> dict:
        """``old_logps`` (the sampling policy's, when a step trains off-policy: μ > 1 or more than one step
        per generation, as TRL computes ``old_per_token_logps``) and ``ref_logps`` (``beta > 0``), fp32
        ``[k·B, t]`` host arrays computed ``batch_size`` rows at a time; zeros where the loss does not read them."""
        out = {name: np.zeros(host["inputs"].shape, np.float32) for name in ("old_logps", "ref_logps")}
        ref = state.frozen if self.cfg.posttrain.reference == "lora_base" else state.reference
        rloo_kl = self.cfg.posttrain.advantage == "rloo" and posttrain_beta(self.cfg) > 0  # the KL in the reward
        which = {"old_logps": state.model_params if self.period > 1 or rloo_kl else None,
                 "ref_logps": ref if posttrain_beta(self.cfg) > 0 else None}
        for j in range(self.k):
            rows = slice(j * self.B, (j + 1) * self.B)
            placed = self._place({k: host[k][rows] for k in ("inputs", "targets", "loss_mask", "segment_ids",
                                                             "positions")})
            args = [placed[k] for k in ("inputs", "targets", "loss_mask", "segment_ids", "positions")]
            for name, params in which.items():
                if params is not None:
                    out[name][rows] = self._host(self._logps(params, *args))
        return out

    @staticmethod
    def _host(x: jax.Array) -> np.ndarray:
        if jax.process_count() > 1:
            x = multihost_utils.process_allgather(x, tiled=True)
        return np.asarray(x, np.float32)

    def _metrics(self, per_func, total, std_zero, lengths, truncated) -> dict:
        """TRL's rollout metrics: ``reward``, ``reward_std``, ``rewards/<name>/mean`` and ``/std``,
        ``frac_reward_zero_std``, ``completions/mean_length``, ``completions/clipped_ratio``."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            out = {"reward": float(np.nanmean(total)), "reward_std": float(np.nanstd(total, ddof=1))}
            for j, name in enumerate(self.rewards.names):
                out[f"rewards/{name}/mean"] = float(np.nanmean(per_func[:, j]))
                out[f"rewards/{name}/std"] = float(np.nanstd(per_func[:, j], ddof=1))
        out.update({"frac_reward_zero_std": float(np.mean(std_zero)), "completions/mean_length": float(lengths.mean()),
                    "completions/clipped_ratio": float(np.mean(truncated))})
        return out | self.rewards.metrics

    # ------------------------------------------------------------------ resume between the μ steps
    def _save(self, step: int, host: dict, metrics: dict) -> None:
        """Rollout ``step``'s batch and metrics (process 0; only when it feeds several steps and with
        ``checkpoint.dir``)."""
        if not self.dir or self.period == 1 or jax.process_index() != 0:
            return
        os.makedirs(self.dir, exist_ok=True)
        np.savez(os.path.join(self.dir, f"{step}.npz"), **host, metrics_json=np.asarray(json.dumps(metrics)))
        kept = sorted(int(f[:-4]) for f in os.listdir(self.dir) if f.endswith(".npz"))
        for old in kept[:-ROLLOUTS_KEPT]:
            os.remove(os.path.join(self.dir, f"{old}.npz"))

    def _load(self, step: int) -> _Rollout:
        path = os.path.join(self.dir, f"{step}.npz") if self.dir else ""
        if not path or not os.path.exists(path):
            raise FileNotFoundError(f"resuming GRPO between the {self.period} steps of the rollout of step {step} needs "
                                    f"its batch, {path or '<checkpoint.dir>/rollouts/' + str(step) + '.npz'}, "
                                    "which is missing")
        with np.load(path) as f:
            return _Rollout(step, {k: f[k] for k in f.files if k != "metrics_json"}, json.loads(str(f["metrics_json"])))

    # ------------------------------------------------------------------ held-out reward
    def evaluate(self, state: Any) -> dict:
        """Greedy completions of the held-out prompts (the first ``batch_size``, cycled): the mean
        weighted reward and each function's mean, ``{"val_reward": ..., "val_rewards/<name>": ...}``."""
        idx = np.arange(self.B) % len(self.held)
        tokens, mask = self._prompts(self.held, idx)
        completions, lengths = self._generate(state.model_params, tokens, mask, jax.random.key(0),
                                              Sampling(greedy=True))
        step = int(state.step)
        where = f"the held-out evaluation {'before step 1' if step == 0 else f'after step {step}'}"
        per_func, _ = self._score(self.held, idx, completions, lengths, where,
                                  TrainerState(step, self.cfg.training.max_steps))
        with warnings.catch_warnings():  # no held-out reward at all: NaN (a step without one stops the run)
            warnings.simplefilter("ignore", RuntimeWarning)
            out = {"val_reward": float(np.nanmean(self.rewards.total(per_func)))}
            out.update({f"val_rewards/{n}": float(np.nanmean(per_func[:, j]))
                        for j, n in enumerate(self.rewards.names)})
        return out | {f"val_{k}": v for k, v in self.rewards.metrics.items()}

