"""The GRPO example end to end on a CPU: a supervised warm-up on sums, its export, then GRPO on the
exact-match reward; prints the reward curve.

    python scripts/grpo_arithmetic.py                       # ~3 minutes on 2 CPU cores
    python scripts/grpo_arithmetic.py --sft-steps 600 --grpo-steps 100 --out runs/grpo_arith

Runs, each as its own process (the commands docs/posttraining.md gives):

1. ``scripts/train.py --config configs/arith_sft.yaml`` (``a+b=c`` lines, ``a, b < 20``);
2. ``scripts/convert_hf.py --to-hf`` of its checkpoint (the GRPO run's ``model.init_from``);
3. ``scripts/train.py --config configs/grpo_arith.yaml`` (8 prompts × 8 completions per step, the
   exact-match reward; held-out greedy reward every ``training.eval_every`` steps), its checkpoints in
   ``<out>/grpo/ckpt`` (sample from them with ``scripts/generate.py --config configs/grpo_arith.yaml
   checkpoint.dir=<out>/grpo/ckpt --prompt "3+4="``).

Then prints the held-out reward (greedy completions of the 20 held-out sums) at each evaluation and
the training reward (sampled at temperature 1) averaged over each 10 steps, from the run's
``metrics.jsonl``. Exits 1 when a phase fails.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(args: list[str]) -> None:
    print("+ " + " ".join(args), flush=True)
    if subprocess.call([sys.executable, *args], cwd=ROOT) != 0:
        sys.exit(1)


def reward_curve(metrics_file: str, window: int = 10) -> tuple[list[tuple[int, float]], list[tuple[int, float]]]:
    """``(held-out [(step, val_reward)], training [(last step, mean reward over the window)])``."""
    recs = [json.loads(line) for line in open(metrics_file)]
    held = [(r["step"], r["val_reward"]) for r in recs if "val_reward" in r]
    train = [(r["step"], r["reward"]) for r in recs if "reward" in r]
    means = [(train[min(i + window, len(train)) - 1][0], sum(v for _, v in train[i:i + window]) / len(train[i:i + window]))
             for i in range(0, len(train), window)]
    return held, means


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sft-steps", type=int, default=1000)
    ap.add_argument("--grpo-steps", type=int, default=200)
    ap.add_argument("--out", default="runs/grpo_arith")
    ap.add_argument("overrides", nargs="*", help="more section.key=value overrides of the GRPO run")
    a = ap.parse_args(argv)
    sft = os.path.join(a.out, "sft")
    _run(["scripts/train.py", "--config", "configs/arith_sft.yaml", f"training.max_steps={a.sft_steps}",
          f"checkpoint.dir={sft}/ckpt", f"logging.run_dir={sft}"])
    _run(["scripts/convert_hf.py", "--to-hf", f"{sft}/ckpt", f"{sft}/hf"])
    grpo = os.path.join(a.out, "grpo")
    if os.path.exists(os.path.join(ROOT, grpo, "metrics.jsonl")):
        os.remove(os.path.join(ROOT, grpo, "metrics.jsonl"))
    _run(["scripts/train.py", "--config", "configs/grpo_arith.yaml", f"model.init_from={sft}/hf",
          f"training.max_steps={a.grpo_steps}", f"logging.run_dir={grpo}", f"checkpoint.dir={grpo}/ckpt",
          "checkpoint.overwrite=true", "logging.log_every=1", *a.overrides])
    held, means = reward_curve(os.path.join(ROOT, grpo, "metrics.jsonl"))
    print("held-out reward (greedy): " + ", ".join(f"step {s} {v:.3f}" for s, v in held))
    print("training reward (sampled, 10-step means): " + ", ".join(f"{v:.3f}" for _, v in means))
    print(f"the post-trained model: {grpo}/ckpt (scripts/generate.py --config configs/grpo_arith.yaml "
          f"checkpoint.dir={grpo}/ckpt --prompt 3+4=)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
