"""Held-out evaluation: the one the loop runs at the start, every ``training.eval_every`` steps and
at the end (:func:`held_out`, as the objective's ``evaluation`` says: the language-model loss, the
objective's own loss against the reference, or the on-policy loader's reward), how it is named
(:func:`eval_parts`), ``--eval-only`` (:func:`evaluate_only`) and the state it and
``scripts/generate.py`` read (:func:`state_for_sampling`), and the end-of-run sample
(:func:`sample_text`)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import numpy as np

from jaxcolossal import metrics as mx
from jaxcolossal.checkpoint import CheckpointManager, step_dirs
from jaxcolossal.config import Config, ConfigError
from jaxcolossal.config.derived import holds_reference, precomputes_ref_logps
from jaxcolossal.data import get_tokenizer
from jaxcolossal.data.formats import data_format
from jaxcolossal.generate import Sampling, generate, run_eos_ids, sample_tokens
from jaxcolossal.parallel.layer_scan import fetch_layer
from jaxcolossal.parallel.sharding import Sharder
from jaxcolossal.runtime.dist_logger import get_dist_logger
from jaxcolossal.train.guard import StepWatchdog
from jaxcolossal.train.objective import objective_class
from jaxcolossal.train.optimizer import build_optimizer
from jaxcolossal.train.preflight import preflight
from jaxcolossal.train.ref_logps import attach, fingerprint, store_dir, stored_ref_logps
from jaxcolossal.train.report import quiet_console
from jaxcolossal.train.run import Run, new_run_id
from jaxcolossal.train.start import eval_step_for, initial_state, load_data, mesh_and_plan
from jaxcolossal.train.state import TrainPlan


# ----------------------------------------------------------------------------- the held-out evaluation


def held_out(run: Run, state: Any) -> float:
    """Mean validation loss (nats/token) over the fixed evaluation batches; with DPO the mean DPO loss
    over the held-out pairs, and their TRL metrics written as ``val_rewards/accuracies`` etc. (a reward
    model: its loss, ``val_accuracy`` etc.); with
    GRPO minus the mean reward of greedy completions of the held-out prompts (``val_reward``)."""
    evaluation = objective_class(run.cfg).evaluation
    if evaluation == "rollouts":
        metrics = run.loader.evaluate(state)  # its line is the caller's (eval_line: "held-out reward (greedy) X")
        run.write({"step": int(state.step), **metrics})
        return -metrics["val_reward"]
    if evaluation != "objective":
        return float(np.mean([float(run.eval_step(state.model_params, *batch)) for batch in run.evals]))
    reference = state.frozen if run.cfg.posttrain.reference == "lora_base" else state.reference
    outs = [run.eval_step(state.model_params, reference, *batch) for batch in run.evals]
    metrics = {f"val_{k}": float(np.mean([float(m[k]) for _, m in outs])) for k in outs[0][1]}
    run.write({"step": int(state.step), **metrics})
    first, second = objective_class(run.cfg).headline_metrics  # DPO's rewards/accuracies, a reward model's accuracy
    get_dist_logger().info(f"step {int(state.step)}: held-out {first} {metrics['val_' + first]:.3f}, {second} "
                           f"{metrics['val_' + second]:.4f}", ranks=[0])
    return float(np.mean([float(v) for v, _ in outs]))


def eval_parts(cfg: Config, val: float) -> tuple[str, str]:
    """``(name, value with its unit)`` of a held-out evaluation's value ``val`` (:func:`held_out`'s):
    SFT's ``("validation loss", "X nats/token")``, DPO's ``("held-out DPO loss", "X per pair")``, GRPO's
    ``("held-out reward (greedy)", "X")`` (``val`` is minus the reward)."""
    return objective_class(cfg).held_out_parts(val)


def eval_line(cfg: Config, val: float, perplexity: float | None = None) -> str:
    """:func:`eval_parts` as one phrase, ``validation loss X nats/token`` (with ``perplexity``),
    ``held-out DPO loss X per pair``, ``held-out reward (greedy) X``."""
    name, value = eval_parts(cfg, val)
    return f"{name} {value}" + ("" if perplexity is None else f", perplexity {perplexity:.2f}")


# ----------------------------------------------------------------------------- in the loop


def first_evaluation(run: Run) -> float:
    """The held-out evaluation of the state the run starts from (:func:`held_out`), before the first
    step: its time ``evaluation`` in the goodput, its line (``validation loss at step N: X
    nats/token``) and its record in the metrics."""
    with run.goodput.phase("evaluation"):
        val = held_out(run, run.state)
    name, value = eval_parts(run.cfg, val)
    get_dist_logger().info(f"{name} at step {int(run.state.step)}: {value}", ranks=[0])
    run.write({"step": int(run.state.step), "val_loss": val})
    return val


def evaluate_phase(run: Run, state: Any, done: int) -> float:
    """The evaluation at step ``done`` inside the loop: its loss logged and written, its time
    ``evaluation`` in the goodput, a phase boundary for the hang watchdog."""
    run.hang.progress(f"in the evaluation at step {done}")
    with run.goodput.phase("evaluation"):
        v = held_out(run, state)
    run.hang.progress(f"after the evaluation at step {done}")
    run.write({"step": done, "val_loss": v})
    get_dist_logger().info(f"step {done}: {eval_line(run.cfg, v)}", ranks=[0])
    return v


def final_evaluation(run: Run, state: Any, val_start: float, watchdog: StepWatchdog) -> float:
    """The held-out evaluation of the trained ``state`` (:func:`held_out`): its time ``evaluation`` in
    the goodput, then the collective-timeout ``watchdog`` stopped (past the loop's last collective;
    orbax's own barriers time out the final save), its record and its line against the start's
    ``val_start`` (``validation loss: X at start -> Y at step N``)."""
    with run.goodput.phase("evaluation"):
        val_end = held_out(run, state)
    watchdog.stop()  # past the last collective of the loop; orbax's own barriers time out the final save
    run.write({"step": int(state.step), "val_loss": val_end})
    (name, start), (_, end) = eval_parts(run.cfg, val_start), eval_parts(run.cfg, val_end)
    get_dist_logger().info(f"{name}: {start} at start -> {end} at step {int(state.step)}", ranks=[0])
    return val_end


# ----------------------------------------------------------------------------- evaluate only


def _nothing_to_evaluate(cfg: Config, what: str = "--eval-only: nothing to evaluate") -> None:
    """Raises ConfigError (one line, starting with ``what``) when ``checkpoint.dir`` holds no step and
    ``model.init_from`` is empty."""
    c = cfg.checkpoint
    if (c.dir and step_dirs(c.dir)) or cfg.model.init_from:
        return
    where = f"checkpoint.dir={c.dir!r} holds no checkpoint" if c.dir else "checkpoint.dir is not set"
    raise ConfigError(f"{what}: {where} and model.init_from is empty; set checkpoint.dir "
                      "to a run's checkpoints or model.init_from=HF_DIR (a Hugging Face folder)")


POLICY_FIELDS = ("step", "params", "frozen")
"""The state's fields that sampling and evaluation read (:func:`_restored_state`): a post-training
run's saved ``reference.*`` and every optimizer state stay unread, whatever ``training.objective``."""


def _restored_state(cfg: Config, plan: TrainPlan, reference: bool = False) -> tuple[Any, str]:
    """``(state, source)``: the newest step in ``checkpoint.dir`` that restores, else ``model.init_from``'s
    Hugging Face weights, and a phrase naming which. Only the policy is read (:data:`POLICY_FIELDS`;
    ``reference``: DPO's frozen reference too), so a DPO or GRPO checkpoint restores under an SFT
    config and the other way round. Raises as :func:`evaluate_only`."""
    state = initial_state(cfg, plan, build_optimizer(cfg.training, plan))
    if not reference:
        state = state.replace(reference=None)
    source = f"the Hugging Face weights in {cfg.model.init_from}"
    if cfg.checkpoint.dir and step_dirs(cfg.checkpoint.dir):
        ckpt = CheckpointManager(cfg.checkpoint.dir, cfg.checkpoint.max_to_keep, config=cfg.to_dict())
        try:
            state = ckpt.restore(state, only=POLICY_FIELDS + (("reference",) if reference else ()))
        finally:
            ckpt.close()
        source = f"checkpoint step {int(state.step)} in {ckpt.directory}"
    return state, source


def state_for_sampling(cfg: Config) -> tuple[TrainPlan, Any, str]:
    """``scripts/generate.py``: ``(plan, state, source)``, the state that :func:`evaluate_only` would
    evaluate (the newest checkpoint in ``checkpoint.dir``, else ``model.init_from``), on the run's
    mesh and in its layout (``state.model_params``, sharded as ``plan.specs.params``). Never trains.

    Raises:
        ConfigError: nothing to sample from, or a :func:`preflight` refusal.
        CheckpointMismatchError, CheckpointNotFoundError: as :func:`evaluate_only`.
    """
    preflight(cfg, eval_only=True)
    _nothing_to_evaluate(cfg, "nothing to sample from")
    with quiet_console():
        _, plan = mesh_and_plan(cfg, new_run_id())
        state, source = _restored_state(cfg, plan)
    return plan, state, source


def evaluate_only(cfg: Config) -> dict:
    """``scripts/train.py --eval-only``: the held-out evaluation of the state a run of ``cfg`` would
    start from, by the loop's own evaluation (:func:`held_out`, the one ``training.eval_every``
    runs) over the same fixed batches (``training.eval_batches`` of the validation split, with the
    same data keys, mesh and sharding). The state: the policy of the newest step in ``checkpoint.dir``
    that restores (as ``training.resume=true`` restores it, whatever ``training.resume`` says; a DPO
    or GRPO run's frozen reference is read only where DPO's evaluation needs it), else
    ``model.init_from``'s Hugging Face weights. Never trains, never saves a checkpoint. With
    ``posttrain.precompute_ref_log_probs`` the held-out reference log-probs are the run's stored ones
    (:mod:`jaxcolossal.train.ref_logps`).

    Prints one line (process 0), :func:`eval_line`'s ``<what> at step N (<source>)``: SFT's
    ``validation loss X.XXXX nats/token, perplexity Y``, DPO's held-out pairs' loss and
    ``rewards/accuracies``, GRPO's held-out ``reward`` of greedy completions. Appends ``{"step": N,
    "val_loss": ..., "eval_only": true}`` (with DPO's ``val_rewards/*``, GRPO's ``val_reward``) to
    ``<run_dir>/metrics.jsonl``; returns ``{"step", "val_loss", "perplexity" (SFT), "source"}``.

    Raises:
        ConfigError: before anything compiles: nothing to evaluate (no checkpoint in
            ``checkpoint.dir`` and no ``model.init_from``), or any :func:`preflight` refusal.
        CheckpointMismatchError: the checkpoint is of another model size.
        CheckpointNotFoundError: ``checkpoint.dir`` holds steps, none of which restores.
    """
    preflight(cfg, eval_only=True)
    _nothing_to_evaluate(cfg)
    run_id, evaluation = new_run_id(), objective_class(cfg).evaluation  # its own train.log separator and TB folder
    with quiet_console():
        mesh, plan = mesh_and_plan(cfg, run_id)
        loader, evals, _ = load_data(cfg, mesh, plan)
        state, source = _restored_state(cfg, plan, reference=evaluation == "objective" and holds_reference(cfg))
        if evaluation == "objective" and precomputes_ref_logps(cfg):  # the run's stored held-out values
            evals = attach(stored_ref_logps(store_dir(cfg), fingerprint(cfg, loader, evals)), loader, evals)
        metrics = mx.MetricsWriter.for_run(cfg, run_id, enabled=jax.process_index() == 0)
        run = Run(cfg=cfg, plan=plan, state=state, ckpt=None, loader=loader, evals=evals, compiled=None,
                  eval_step=eval_step_for(plan), compile_s=0.0,
                  compiled_peak=0, metrics=metrics)
        ok = False
        try:
            step, val = int(state.step), held_out(run, state)
            run.write({"step": step, "val_loss": val, "eval_only": True})
            ok = True
        finally:
            metrics.close(exit_code=0 if ok else 1)
    out = {"step": step, "val_loss": val, "source": source}
    if evaluation == "loss":
        out["perplexity"] = math.exp(val) if val < 700 else math.inf  # exp overflows a float past ~709
    if run.is_main:
        print(f"{eval_line(cfg, val, out.get('perplexity'))} at step {step} ({source})")
    return out


# ----------------------------------------------------------------------------- the end-of-run sample


SAMPLE_WINDOW = 2048
"""The end-of-run sample's context in tokens, at most: it runs unsharded on one device, with the
whole window through every layer per token (a 16k window of a long-context run did not fit a
23 GiB host)."""


def sample_text(run: Run, state: Any) -> str:
    """A short generated text from the run's sample prompt (:func:`load_data`), the tokenizer's ids only
    (temperature 0.8, the prompt cut to its last ``seq_len`` tokens), encoded as the run's data is: a
    GRPO run's prompt as its prompts are (``encode_prompt``: the tokenizer's BOS), a chat run's rendered
    text and a text corpus's without special tokens. After chat fine-tuning or GRPO it ends at the first
    end-of-text id (the tokenizer's, or any of ``model.init_from``'s ``generation_config.json`` list:
    :func:`jaxcolossal.generate.run_eos_ids`). The KV-cached sampler
    (:func:`jaxcolossal.generate.generate`) on the params as training lays them out; a family without
    a decode path (``Family.forward_cached`` None) uses the windowed one."""
    cfg, t = run.cfg.model, run.cfg.training
    if t.sample_tokens <= 0 or cfg.num_labels:  # a score head (a reward model) has no LM head to sample from
        return ""
    tok = get_tokenizer(run.cfg.data.tokenizer)
    fmt = data_format(run.cfg)
    eos = run_eos_ids(tok, cfg.init_from or None) if fmt.sample_ends_at_eos else ()
    encode = tok.encode_prompt if fmt.sample_as_prompt else tok.encode
    prompt = encode(run.sample_prompt)[-min(t.seq_len, SAMPLE_WINDOW):]
    family = run.plan.family
    if family.forward_cached is None:
        shard = Sharder(None).with_fp8(run.cfg.precision.fp8)
        fn = jax.jit(lambda p, x: family.forward(fetch_layer(p), x, cfg, shard)[..., : tok.vocab_size])
        out = sample_tokens(fn, state.model_params, prompt, t.sample_tokens, min(t.seq_len, SAMPLE_WINDOW),
                            jax.random.key(t.seed + 1)).tolist()
    else:  # the tokenizer's ids only: the logits past its vocabulary are masked like the padded ones
        small = dataclasses.replace(cfg, vocab_size=min(cfg.vocab_size, tok.vocab_size))
        out = generate(family, small, state.model_params, [list(prompt)], t.sample_tokens, Sampling(temperature=0.8),
                       eos_id=eos, seed=t.seed + 1, fp8=run.cfg.precision.fp8).rows()[0]
    out = out[: next((i for i, t in enumerate(out) if t in eos), len(out))]
    return run.sample_prompt + tok.decode(np.asarray(out, np.int32))
