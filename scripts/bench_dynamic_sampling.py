"""GRPO with and without dynamic sampling on the arithmetic example's task, side by side in one run.

    python scripts/bench_dynamic_sampling.py                      # ~6 minutes on 2 CPU cores
    python scripts/bench_dynamic_sampling.py --grpo-steps 60 --out runs/dyn

The supervised warm-up and its export are those of ``scripts/grpo_arithmetic.py`` (reused when
``<out>/sft/hf`` exists). Then two GRPO runs of ``configs/grpo_arith.yaml`` from the same warm-up and
seed, ``posttrain.dynamic_sampling`` off and on, each its own process. Prints, per run: the share of
zero-variance groups in the trained batches (``frac_reward_zero_std``, mean over the steps), the
generation rounds and the groups dropped, the completions generated, the training reward (mean of
the last ``--window`` steps) and the held-out greedy reward at the end; then the training reward
against the completions generated so far, both runs on one grid. Exits 1 when a phase fails.
"""
from __future__ import annotations

import argparse
import json
import os

from grpo_arithmetic import ROOT, _run

GROUPS_ROWS = 64  # configs/grpo_arith.yaml: 8 prompts x 8 completions per generation


def _grpo(out: str, name: str, steps: int, extra: list[str]) -> list[dict]:
    run = os.path.join(out, name)
    metrics = os.path.join(ROOT, run, "metrics.jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)
    _run(["scripts/train.py", "--config", "configs/grpo_arith.yaml", f"training.max_steps={steps}",
          f"model.init_from={out}/sft/hf", f"logging.run_dir={run}", "checkpoint.dir=", "logging.log_every=1",
          f"training.eval_every={steps}", *extra])
    return [json.loads(line) for line in open(metrics)]


def summary(recs: list[dict], window: int) -> dict:
    """The run's figures from its ``metrics.jsonl`` records."""
    steps = [r for r in recs if "reward" in r]
    rounds = [r.get("sampling/rounds", 1.0) for r in steps]
    held = [r["val_reward"] for r in recs if "val_reward" in r]
    return {"zero_std_share": sum(r["frac_reward_zero_std"] for r in steps) / len(steps),
            "rounds": sum(rounds), "dropped": sum(r.get("sampling/groups_dropped", 0.0) for r in steps),
            "filled": sum(r.get("sampling/groups_filled", 0.0) for r in steps),
            "generated": int(sum(rounds) * GROUPS_ROWS), "reward": sum(r["reward"] for r in steps[-window:])
            / len(steps[-window:]), "held_out": held[-1] if held else float("nan"),
            "curve": [(int(sum(rounds[:i + 1]) * GROUPS_ROWS), r["reward"]) for i, r in enumerate(steps)]}


def _on_grid(curve: list[tuple[int, float]], at: int, window: int = 5) -> float:
    """The mean training reward of the ``window`` steps up to ``at`` completions generated (NaN past the
    run's last step)."""
    if not curve or at > curve[-1][0]:
        return float("nan")
    seen = [r for n, r in curve if n <= at]
    return sum(seen[-window:]) / len(seen[-window:]) if seen else float("nan")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sft-steps", type=int, default=1000)
    ap.add_argument("--grpo-steps", type=int, default=60)
    ap.add_argument("--window", type=int, default=10)
    ap.add_argument("--out", default="runs/grpo_arith")
    a = ap.parse_args(argv)
    sft = os.path.join(a.out, "sft")
    if not os.path.exists(os.path.join(ROOT, sft, "hf", "config.json")):
        _run(["scripts/train.py", "--config", "configs/arith_sft.yaml", f"training.max_steps={a.sft_steps}",
              f"checkpoint.dir={sft}/ckpt", f"logging.run_dir={sft}"])
        _run(["scripts/convert_hf.py", "--to-hf", f"{sft}/ckpt", f"{sft}/hf"])
    runs = {"off": summary(_grpo(a.out, "dyn_off", a.grpo_steps, []), a.window),
            "on": summary(_grpo(a.out, "dyn_on", a.grpo_steps, ["posttrain.dynamic_sampling=true"]), a.window)}
    print(f"\nGRPO on the arithmetic task, {a.grpo_steps} steps, dynamic sampling off against on:")
    print("run  zero-std share  rounds  groups dropped  filled  completions  reward (last "
          f"{a.window})  held-out reward")
    for name, s in runs.items():
        print(f"{name:4} {s['zero_std_share']:14.3f}  {s['rounds']:6.0f}  {s['dropped']:14.0f}  {s['filled']:6.0f}  "
              f"{s['generated']:11d}  {s['reward']:17.3f}  {s['held_out']:15.3f}")
    print("\ntraining reward (mean of the last 5 steps) against completions generated:")
    print("completions   off     on")
    for at in range(GROUPS_ROWS * 10, runs["on"]["generated"] + 1, GROUPS_ROWS * 10):
        print(f"{at:11d}  {_on_grid(runs['off']['curve'], at):5.3f}  {_on_grid(runs['on']['curve'], at):5.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
