"""A post-trained model can be looked at (issue 54, items 5 and 6): ``scripts/generate.py`` samples from a
DPO checkpoint and a GRPO one with β > 0 under the run's own config or an SFT one (their frozen
``reference.*`` arrays stay unread), and ``scripts/train.py --eval-only`` evaluates them: the SFT
validation loss of the policy, or the run's own held-out evaluation, bit for bit the value it logged.
The run's console (item 11) shows TRL's columns, names its held-out evaluation, and with
``posttrain.log_completions`` GRPO's completions with their rewards."""

import importlib.util
import json
import os
import pathlib

import pytest
from test_dpo_train import DPO_JOB
from test_grpo_train import GRPO_JOB
from tiny import SMALL_MAIN_JOB

from jaxcolossal.config import load_config
from jaxcolossal.train.evaluate import evaluate_only
from jaxcolossal.train.loop import train

ROOT = pathlib.Path(__file__).parents[2]
spec = importlib.util.spec_from_file_location("generate_script", ROOT / "scripts" / "generate.py")
script = importlib.util.module_from_spec(spec)
spec.loader.exec_module(script)


def _logged(run_dir, key):
    return {r["step"]: r[key] for r in map(json.loads, open(run_dir / "metrics.jsonl")) if key in r}


CONSOLE = {"dpo": ("rewards/accuracies ", "rewards/margins ", "held-out DPO loss at step 0: 0.6931 per pair",
                   "held-out DPO loss: 0.6931 per pair at start -> "),
           "grpo": ("reward ", "reward_std ", "kl ", "completion_length ", "held-out reward (greedy) at step 0: ")}


@pytest.mark.parametrize("job, extra, printed", [
    (DPO_JOB, [], "held-out DPO loss {:.4f} per pair at step 2"),
    (GRPO_JOB + ["posttrain.log_completions=true"], ["model.vocab_size=256"], "held-out reward (greedy) {:.4f} at step 2"),
], ids=["dpo", "grpo"])
def test_a_post_trained_checkpoint_samples_and_evaluates(tmp_path, capsys, job, extra, printed):
    where = [f"checkpoint.dir={tmp_path / 'ckpt'}", f"logging.run_dir={tmp_path / 'run'}",
             f"data.cache_dir={tmp_path / 'cache'}"]
    post = SMALL_MAIN_JOB + job + where

    def cfg(keys, *more):
        return load_config(str(ROOT / "configs/llama_tiny.yaml"), keys + list(more))
    train(cfg(post, "training.max_steps=2", "training.eval_every=2"))
    logged = _logged(tmp_path / "run", "val_loss")[2]
    log = (tmp_path / "run" / "train.log").read_text()
    kind = "dpo" if job is DPO_JOB else "grpo"
    steps = [line for line in log.splitlines() if "step 2/2, loss" in line]
    assert steps and all(c in (log if c.startswith("held") else steps[-1]) for c in CONSOLE[kind]), (steps, log[-3000:])
    assert "validation loss" not in log and "nats/token" not in log, log[-3000:]
    if kind == "grpo":  # posttrain.log_completions: the first group's 4 completions, their rewards
        block = log.split("completions of the rollout of step 1:")[1].splitlines()[1:5]
        assert all(" -> " in r and "format " in r and "exact_match " in r and "advantage " in r for r in block), block
    sft = SMALL_MAIN_JOB + extra + where  # the main job's SFT config on the post-trained checkpoint
    whose = "DPO's" if kind == "dpo" else "GRPO's (beta > 0)"  # item 18: the memory table names the objective
    assert f"({whose} frozen reference copy, sharded like params)" in capsys.readouterr().out
    for keys in (sft, post):
        assert script.main(["--prompt", "12+", "--max-new-tokens", "3", "--greedy", "--devices", "8", *keys]) == 0
        assert "sampling from checkpoint step 2" in capsys.readouterr().err
    got = evaluate_only(cfg(sft))
    assert got["step"] == 2 and got["perplexity"] > 1, got  # the policy's validation loss on text
    assert "validation loss" in capsys.readouterr().out
    got = evaluate_only(cfg(post, "training.max_steps=2"))
    assert got["val_loss"] == logged, (got, logged)  # the run's own held-out evaluation, bit for bit
    assert printed.format(logged if kind == "dpo" else -logged) in capsys.readouterr().out
