"""``posttrain.precompute_ref_log_probs`` (TRL 1.16's ``DPOConfig.precompute_ref_log_probs``): DPO's reference
sequence log-probs computed once, before training, instead of by a reference forward in every step.

The pass (:func:`compute_ref_logps`) runs the objective's own reference computation
(:meth:`jaxcolossal.posttrain.dpo.Dpo.reference_logps`) over every training pair and every held-out
evaluation batch, under the run's mesh and ZeRO stage (the reference's params sharded like the policy's,
``plan.specs.params``; the rows over the data group, one microbatch's rows per forward, as the evaluation
batches), with the reference TRL's precompute uses: the initial policy, ``posttrain.ref_model``'s weights, or
under LoRA the base without the adapters. Those weights are then dropped: the train state holds no
reference (:func:`jaxcolossal.config.derived.holds_reference`), so none is checkpointed.

The values, two fp32 per pair, are keyed by the pair's index in the training split (the preference loader
draws pair indices, :class:`jaxcolossal.data.loader.PairLoader`, and hands each row its pair's value as the
batch field ``ref_logps``), and the held-out ones by evaluation batch and row. They are stored in
``<checkpoint.dir>/ref_logps/ref_logps.npz`` (:data:`STORE`), one file written by process 0 and read by
every process, rather than orbax shards per process: every process draws any pair, so each needs the whole
table, and it is small (8 B per pair: a million pairs are 8 MB, less than one shard of the weights). A
``meta.json`` beside it holds what the values depend on (:func:`fingerprint`); a resume reads the values
(:func:`stored_ref_logps`), never recomputes them (the initial policy is gone by then), and refuses a
store that belongs to other data or another reference.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcolossal.config import Config, ConfigError
from jaxcolossal.config.derived import precomputes_ref_logps
from jaxcolossal.posttrain.ref_model import load_ref_model
from jaxcolossal.runtime.dist_logger import get_dist_logger
from jaxcolossal.train.objective import make_objective
from jaxcolossal.train.state import TrainPlan

STORE = "ref_logps"
"""The store's folder under ``checkpoint.dir``: ``ref_logps.npz`` (``train`` fp32 ``[N, 2]``, ``held_out``
fp32 ``[E, rows]``) and ``meta.json`` (:func:`fingerprint`)."""

PASSES = [0]
"""How many passes this process has run (the tests' evidence that a resume does not run one)."""


def store_dir(cfg: Config) -> str | None:
    """``<checkpoint.dir>/ref_logps``, or None without ``checkpoint.dir`` (the values stay in memory)."""
    return os.path.join(cfg.checkpoint.dir, STORE) if cfg.checkpoint.dir else None


def fingerprint(cfg: Config, loader: Any, evals: list) -> dict:
    """What the stored values depend on: the training pairs' rows and masks (sha256), the held-out batches'
    shape, the reference (``posttrain.ref_model``, else ``model.init_from`` or ``training.seed``, the LoRA
    base) and the precision it ran in."""
    h = hashlib.sha256()
    h.update(np.ascontiguousarray(loader.examples).tobytes())
    h.update(np.ascontiguousarray(loader.masks).tobytes())
    m, po = cfg.model, cfg.posttrain
    reference = po.ref_model or (f"model.init_from={m.init_from}" if m.init_from else f"training.seed="
                                 f"{cfg.training.seed}") + (" (the LoRA base)" if m.lora.enabled else "")
    return {"pairs": int(loader.num_pairs), "pairs_sha256": h.hexdigest(),
            "held_out": [len(evals), int(evals[0][0].shape[0]) if evals else 0], "reference": reference,
            "precision": cfg.precision.mode}


def _ref_fn(plan: TrainPlan):
    """Jitted ``fn(reference, inputs, targets, mask) -> fp32 [rows]`` replicated on every device: the
    rows' reference sequence log-probs by the objective's own computation, under the run's sharder."""
    cfg, sharder = plan.cfg, plan.sharder
    objective, vp = make_objective(plan.family, cfg), sharder.is_sharded("vocab")

    def fn(reference, x, y, mask):
        x = sharder(x, ("batch", "seq"))
        return objective.reference_logps(reference, x, y, mask.astype(jnp.float32), cfg.model, sharder, vp)
    return jax.jit(fn, out_shardings=NamedSharding(plan.mesh, P()))


def _reference_params(cfg: Config, plan: TrainPlan, state: Any) -> Any:
    """The pass's reference weights, sharded like the model's params: ``posttrain.ref_model``'s (read now,
    dropped after the pass), else under LoRA the base (``state.frozen``), else the initial policy
    (``state.params`` of the fresh state, which the frozen copy would equal)."""
    if cfg.posttrain.ref_model:
        params = load_ref_model(cfg, plan.mesh_shape["tp"])
        specs = plan.frozen_specs if plan.lora else plan.specs.params
        shardings = jax.tree.map(lambda s: NamedSharding(plan.mesh, s), specs, is_leaf=lambda x: isinstance(x, P))
        return jax.jit(lambda p: jax.tree.map(lambda x: x.astype(plan.compute_dtype), p),
                       out_shardings=shardings)(params)
    return state.frozen if plan.lora else state.params


def compute_ref_logps(cfg: Config, plan: TrainPlan, state: Any, loader: Any, evals: list) -> dict:
    """The pass: ``{"train": fp32 [N, 2], "held_out": fp32 [E, rows]}``, each training pair's (chosen,
    rejected) and each held-out evaluation row's reference sequence log-prob. ``state``: the fresh
    (not restored) state. The training rows go through in chunks of one evaluation batch's rows (one
    microbatch), the last chunk filled up with the first rows and cut off after."""
    fn, ref = _ref_fn(plan), _reference_params(cfg, plan, state)
    rows = int(evals[0][0].shape[0]) if evals else cfg.training.batch_size // cfg.training.gradient_accumulation_steps
    ex, masks = loader.examples, loader.masks
    n = len(ex)
    out = []
    for start in range(0, n, rows):
        idx = np.arange(start, start + rows) % n
        chunk, m = ex[idx], masks[idx]
        got = fn(ref, loader.to_global(chunk[:, :-1]), loader.to_global(chunk[:, 1:]), loader.to_global(m))
        out.append(np.asarray(got)[: min(rows, n - start)])
    held = [np.asarray(fn(ref, x, y, m)) for x, y, m in evals]
    PASSES[0] += 1
    return {"train": np.concatenate(out).reshape(-1, 2).astype(np.float32),
            "held_out": np.stack(held).astype(np.float32) if held else np.zeros((0, rows), np.float32)}


def save_ref_logps(path: str, values: dict, meta: dict) -> int:
    """Write the store (process 0; atomically: a temporary file renamed); returns its bytes."""
    if jax.process_index() != 0:
        return 0
    os.makedirs(path, exist_ok=True)
    tmp = os.path.join(path, "ref_logps.tmp.npz")
    np.savez(tmp, **values)
    os.replace(tmp, os.path.join(path, "ref_logps.npz"))
    with open(os.path.join(path, "meta.json.tmp"), "w") as f:
        json.dump(meta, f, indent=1)
    os.replace(os.path.join(path, "meta.json.tmp"), os.path.join(path, "meta.json"))
    return os.path.getsize(os.path.join(path, "ref_logps.npz"))


def stored_ref_logps(path: str | None, meta: dict) -> dict:
    """The stored values (:func:`compute_ref_logps`'s dict) of the store ``path``, checked against ``meta``.

    Raises:
        ConfigError: no store, or one computed for other data or another reference (the differing keys)."""
    file = os.path.join(path, "ref_logps.npz") if path else ""
    if not path or not os.path.isfile(file):
        raise ConfigError(f"posttrain.precompute_ref_log_probs: {file or 'checkpoint.dir (not set)'} holds no stored "
                          "reference log-probs to resume or evaluate with (the reference weights are not in the "
                          "checkpoint); start a fresh run (training.resume=false) to compute them")
    with open(os.path.join(path, "meta.json")) as f:
        saved = json.load(f)
    diff = [f"{k} {saved.get(k)!r} stored, {v!r} now" for k, v in meta.items() if saved.get(k) != v]
    if diff:
        raise ConfigError(f"posttrain.precompute_ref_log_probs: the reference log-probs in {path} belong to other "
                          f"data or another reference ({'; '.join(diff)}); start a fresh run to recompute them")
    with np.load(file) as z:
        return {"train": z["train"], "held_out": z["held_out"]}


def attach(values: dict, loader: Any, evals: list) -> list:
    """Hand the values to the loader (:meth:`PairLoader.attach_ref_logps`) and return the evaluation
    batches with each one's ``ref_logps`` fp32 ``[rows, 1]`` appended, placed like its rows."""
    loader.attach_ref_logps(values["train"])
    return [tuple(b) + (loader.to_global(h[:, None]),) for b, h in zip(evals, values["held_out"])]


def ref_logps_phase(cfg: Config, plan: TrainPlan, state: Any, loader: Any, evals: list,
                    resumed: bool) -> list:
    """The start's reference phase (after the restore): with ``posttrain.precompute_ref_log_probs``, the
    values computed (a fresh run: ``state`` is the initial one) and stored, or read back (``resumed``),
    and attached (:func:`attach`). Returns the evaluation batches (unchanged without the option).

    Raises:
        ConfigError: a resume without a matching store (:func:`stored_ref_logps`)."""
    if not precomputes_ref_logps(cfg):
        return evals
    log, path, meta = get_dist_logger(), store_dir(cfg), fingerprint(cfg, loader, evals)
    if resumed:
        values = stored_ref_logps(path, meta)
        log.info(f"reference log-probs: read from {path} for {len(values['train'])} training pairs and "
                 f"{values['held_out'].size} held-out rows (not recomputed)", ranks=[0])
        return attach(values, loader, evals)
    t0 = time.time()
    values = compute_ref_logps(cfg, plan, state, loader, evals)
    where = "kept in memory (no checkpoint.dir)"
    if path:
        size = save_ref_logps(path, values, meta)
        where = f"stored in {path}" + (f" ({size:,} B)" if size else "")
    log.info(f"reference log-probs (posttrain.precompute_ref_log_probs): computed for {len(values['train'])} "
             f"training pairs and {values['held_out'].size} held-out rows with {meta['reference']} in "
             f"{time.time() - t0:.1f}s, {where}; the reference weights are not kept", ranks=[0])
    return attach(values, loader, evals)

