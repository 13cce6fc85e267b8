"""Shared helpers for tests: a tiny config and a few train steps on a given set of devices."""

from __future__ import annotations

import json
import os

import jax
import numpy as np

from jaxcolossal.config import Config, config_from_dict, load_config
from jaxcolossal.data.loader import PairLoader
from jaxcolossal.models.hf_io import init_params_from
from jaxcolossal.parallel.mesh import make_mesh
from jaxcolossal.train.loop import train
from jaxcolossal.train.nvme import nvme_tier
from jaxcolossal.train.optimizer import build_optimizer, lr_schedule
from jaxcolossal.train.state import init_state, make_plan
from jaxcolossal.train.step import make_train_step

TINY_MODEL = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=128, max_position_embeddings=64)
TINY_TRAINING = dict(batch_size=16, seq_len=32, learning_rate=1e-3, warmup_steps=1, max_steps=10)


def tiny_config(parallel: dict | None = None, precision: str | None = None, model: dict | None = None,
                training: dict | None = None) -> Config:
    raw = {"model": {**TINY_MODEL, **(model or {})}, "training": {**TINY_TRAINING, **(training or {})},
           "parallel": parallel or {"data_parallel_size": 1}}
    if precision:
        raw["precision"] = {precision: True}
    return config_from_dict(raw)


def random_batches(cfg: Config, steps: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    t = cfg.training
    return [rng.integers(0, cfg.model.vocab_size, (t.batch_size, t.seq_len + 1)).astype(np.int32)
            for _ in range(steps)]


def setup(cfg: Config, devices=None):
    """(plan, tx, state, jitted step) for ``cfg`` on ``devices`` (default: all); the params are
    ``model.init_from``'s Hugging Face weights when it is set, else drawn from key 0."""
    mesh = make_mesh(cfg.parallel, devices)
    plan = make_plan(cfg, mesh)
    tx = build_optimizer(cfg.training, plan)
    state = init_state(plan, tx, key=jax.random.key(0), params=init_params_from(cfg.model, plan.mesh_shape["tp"]))
    tier = nvme_tier(plan, tx)
    if tier is not None:  # offload.nvme_path: the NVMe leaves go to their files, tokens take their places
        state = tier.spill(state)
    return plan, tx, state, make_train_step(plan, tx, lr_schedule(cfg.training))


def run_steps(cfg: Config, devices=None, steps: int = 3, seed: int = 0):
    """Train ``steps`` steps on random tokens; returns (final state, list of metrics dicts, plan)."""
    plan, tx, state, step = setup(cfg, devices)
    out = []
    for x in random_batches(cfg, steps, seed):
        batch = {"inputs": jax.device_put(x[:, :-1], plan.batch_sharding),
                 "targets": jax.device_put(x[:, 1:], plan.batch_sharding)}
        state, m = step(state, batch)
        out.append({k: float(v) if np.ndim(v) == 0 else np.asarray(v) for k, v in m.items()})
    return state, out, plan


def worst_leaf_rel(got, want) -> tuple[str, float]:
    """``(leaf path, relative error)`` of the leaf of ``got`` farthest from ``want`` (two trees of arrays):
    ``‖got - want‖ / ‖want‖`` in float64."""
    def rel(a, b):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        return float(np.linalg.norm(a - b) / np.linalg.norm(b))
    rels = jax.tree_util.tree_map_with_path(lambda path, a, b: (jax.tree_util.keystr(path), rel(a, b)), got, want)
    return max(jax.tree.leaves(rels, is_leaf=lambda x: isinstance(x, tuple)), key=lambda x: x[1])


def assert_params_match(got, want, lr: float = 1e-3):
    """Updated parameters of a parallel run against the single-device run (fp32).

    Nearly every element must agree to rtol 1e-5 / atol 1e-6 (at most 0.1% of a leaf may not), and
    every element to atol ``0.1·lr``. Adam's update ``lr·m/(√v + ε)`` is ≈ ``lr·sign(g)`` from the first
    step on, so an element whose gradient is ~ε turns fp32 summation-order noise in ``g`` into a
    step difference of a fraction of ``lr``, by an amount that depends on the CPU's kernels. Measured
    over the 475 leaves compared by the parallel-equivalence tests (ZeRO × tp, pipelines, MoE, DPO,
    GRPO, LoRA, sequence parallelism, compression, offload): at most 4 elements of 16,384 off (0.024%)
    and at most 0.013·lr on an Intel Xeon; 0.024·lr on an AMD EPYC (DPO under ZeRO-2/3). Both bounds
    are about 4× the largest measured spread. A wrong reduction or sharding moves whole leaves by ~lr
    and fails both.
    """
    def check(path, a, b):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        off = np.abs(a - b) > 1e-6 + 1e-5 * np.abs(b)
        name = jax.tree_util.keystr(path)
        assert off.mean() <= 1e-3, f"{name}: {off.sum()} of {off.size} elements differ by > 1e-6"
        np.testing.assert_allclose(a, b, rtol=0, atol=0.1 * lr, err_msg=name)

    jax.tree_util.tree_map_with_path(check, got, want)


SMALL_MAIN_JOB = ["model.num_layers=2", "model.hidden_size=64", "model.intermediate_size=128", "training.seq_len=32",
                  "training.batch_size=16", "training.eval_batches=2", "training.sample_tokens=0",
                  "data.max_corpus_bytes=200000", "logging.progress_bar=false", "logging.log_every=1",
                  "training.eval_every=0"]
"""Overrides that shrink the main job (``configs/llama_tiny.yaml``) to a few seconds per run."""


def resumed_and_uninterrupted(tmp_path, overrides: list[str]):
    """The small main job with ``overrides``: 6 steps in one run, and 3 steps then 3 more resumed
    from the checkpoint. Returns ``(uninterrupted summary, resumed summary, [loss per step of
    each])`` (:func:`jaxcolossal.train.loop.train`'s summaries)."""
    main_job = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs/llama_tiny.yaml")

    def cfg(where, *extra):
        return load_config(main_job, SMALL_MAIN_JOB + overrides + [
            f"logging.run_dir={where}/run", f"checkpoint.dir={where}/ckpt", f"data.cache_dir={tmp_path}/cache", *extra])
    full = train(cfg(tmp_path / "a", "training.max_steps=6"))
    train(cfg(tmp_path / "b", "training.max_steps=3"))
    resumed = train(cfg(tmp_path / "b", "training.max_steps=6", "training.resume=true"))
    losses = [{r["step"]: r["loss"] for r in map(json.loads, open(tmp_path / d / "run" / "metrics.jsonl")) if "loss" in r}
              for d in ("a", "b")]
    return full, resumed, losses


def in_order_loader_metrics(data, pairs: int) -> dict:
    """:meth:`jaxcolossal.data.loader.PairLoader.step_metrics` of step 0 over preference ``data`` when that step
    draws pairs ``0 .. pairs - 1`` in order (the draw is the only thing replaced): what the training loop
    logs beside the objective's metrics for a parity test's fixed batch."""
    loader = PairLoader(data, batch_size=2 * pairs, seed=0)
    loader._draws = lambda step: np.arange(pairs)
    return loader.step_metrics(0)
