"""Shared helpers for tests: a tiny config and a few train steps on a given set of devices."""

from __future__ import annotations

import jax
import numpy as np

from jaxcolossal.config import Config, config_from_dict
from jaxcolossal.mesh import make_mesh
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
    """(plan, tx, state, jitted step) for ``cfg`` on ``devices`` (default: all)."""
    mesh = make_mesh(cfg.parallel, devices)
    plan = make_plan(cfg, mesh)
    tx = build_optimizer(cfg.training, plan)
    state = init_state(plan, tx, key=jax.random.key(0))
    return plan, tx, state, make_train_step(plan, tx, lr_schedule(cfg.training))


def run_steps(cfg: Config, devices=None, steps: int = 3, seed: int = 0):
    """Train ``steps`` steps on random tokens; returns (final state, list of metrics dicts, plan)."""
    plan, tx, state, step = setup(cfg, devices)
    out = []
    for x in random_batches(cfg, steps, seed):
        batch = {"inputs": jax.device_put(x[:, :-1], plan.batch_sharding),
                 "targets": jax.device_put(x[:, 1:], plan.batch_sharding)}
        state, m = step(state, batch)
        out.append({k: float(v) for k, v in m.items()})
    return state, out, plan
