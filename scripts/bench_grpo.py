"""GRPO's step split between rollout and update, and the rollout's tokens/s against the sampler's own,
measured side by side in one run on the same mesh (8 simulated CPU devices by default).

    python scripts/bench_grpo.py                              # configs/grpo_arith.yaml, random weights
    python scripts/bench_grpo.py --config configs/grpo_arith.yaml --steps 20 training.batch_size=128

* sampler alone: :func:`jaxcolossal.generate.make_generator` on the run's params and the same prompt
  batch (``batch_size`` rows, ``max_completion_length`` new tokens, the run's sampling), compiled
  first, timed over ``--steps`` calls;
* GRPO steps: :meth:`jaxcolossal.posttrain.rollout.Rollouts.batch` (sampling, rewards, advantages,
  log-probs, placement) then the train step, each timed to completion (``block_until_ready``).

Prints medians: rollout s, of which sampling s, update s, their shares, rollout tokens/s (the
completion tokens sampled per second of sampling) and the sampler's own tokens/s. Random weights
(``model.init_from`` is cleared) draw full-length completions, so the token counts are comparable.
"""
from __future__ import annotations

import argparse
import sys
import time

import jax
import numpy as np

import jaxcolossal as jc
from jaxcolossal.config import load_config, validate
from jaxcolossal.train.start import initial_state, load_data, mesh_and_plan
from jaxcolossal.train.optimizer import build_optimizer, lr_schedule
from jaxcolossal.train.step import make_train_step


def _setup(config: str, overrides: list[str]):
    cfg = load_config(config, ["model.init_from=", "checkpoint.dir=", *overrides])
    validate(cfg, jax.device_count())
    mesh, plan = mesh_and_plan(cfg, "bench")
    tx = build_optimizer(cfg.training, plan)
    state = initial_state(cfg, plan, tx)
    return cfg, plan, state, load_data(cfg, mesh, plan)[0], make_train_step(plan, tx, lr_schedule(cfg.training))


def sampler_alone(ro, state, steps: int) -> float:
    """The sampler's own tokens/s on the rollout's prompt batch (compiled first; the median call)."""
    idx = np.arange(ro.B) % len(ro.data)
    tokens, mask = ro._prompts(ro.data, idx)
    key = jax.random.key(0)
    ro._generate(state.model_params, tokens, mask, key, ro.sampling)  # compile
    rates = []
    for i in range(steps):
        t0 = time.perf_counter()
        _, lengths = ro._generate(state.model_params, tokens, mask, jax.random.fold_in(key, i), ro.sampling)
        rates.append(int(lengths.sum()) / (time.perf_counter() - t0))
    return float(np.median(rates))


def grpo_steps(ro, state, step_fn, steps: int) -> dict:
    """Medians of the rollout, sampling and update seconds over ``steps`` GRPO steps (after 2 warm-up ones)."""
    rows = []
    for s in range(steps + 2):
        t0 = time.perf_counter()
        batch = ro.batch(s * ro.mu, state)
        jax.block_until_ready(batch)
        t1 = time.perf_counter()
        state, m = step_fn(state, batch)
        jax.block_until_ready((state, m))
        t2 = time.perf_counter()
        rows.append((t1 - t0, ro.metrics["time/rollout_s"], t2 - t1, ro.metrics["rollout_tokens_per_s"]))
    return dict(zip(("rollout_s", "sampling_s", "update_s", "rollout_tokens_per_s"),
                    np.median(np.asarray(rows[2:]), axis=0)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/grpo_arith.yaml")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("overrides", nargs="*")
    ap.add_argument("--devices", type=int, default=8, help="simulated CPU devices (no accelerator)")
    a = ap.parse_args(argv)
    jc.simulate_devices(a.devices)
    cfg, plan, state, ro, step_fn = _setup(a.config, a.overrides)
    own = sampler_alone(ro, state, a.steps)
    r = grpo_steps(ro, state, step_fn, a.steps)
    total = r["rollout_s"] + r["update_s"]
    print(f"{jax.device_count()} {jax.devices()[0].platform} devices, mesh {dict(plan.mesh.shape)}; "
          f"{ro.B} completions x {ro.C} tokens per step")
    print(f"step {total:.4f} s: rollout {r['rollout_s']:.4f} s ({r['rollout_s'] / total:.0%}; sampling "
          f"{r['sampling_s']:.4f} s), update {r['update_s']:.4f} s ({r['update_s'] / total:.0%})")
    print(f"rollout tokens/s {r['rollout_tokens_per_s']:,.0f}; the sampler alone {own:,.0f} "
          f"(ratio {r['rollout_tokens_per_s'] / own:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
