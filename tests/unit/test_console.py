"""What a post-training run's console says (issue 54, items 11, 12 and 18): TRL's columns, the held-out
evaluation named for what it is, ``posttrain.log_completions``' block and W&B table, and the names
TensorBoard and W&B file the records under; where the output goes, said at start-up."""

import os

import jax
from tiny import tiny_config

from jaxcolossal import metrics as mx
from jaxcolossal.config import config_from_dict
from jaxcolossal.parallel.mesh import make_mesh
from jaxcolossal.data.prompts import prompt_length_hint
from jaxcolossal.train.evaluate import eval_line, eval_parts
from jaxcolossal.train.report import step_line
from jaxcolossal.train.start_lines import output_lines, warmup_warning
from jaxcolossal.train.optimizer import build_optimizer
from jaxcolossal.train.state import make_plan
from jaxcolossal.train.step import make_train_step

PERF = {"tokens_per_s": 1000.0, "tflops_6n": 1e-6}


def _cfg(objective):
    data = {"dpo": {"format": "preference"}, "grpo": {"format": "prompts"}}.get(objective, {})
    post = {"max_completion_length": 64} if objective == "grpo" else {}  # TRL's 512 fills seq_len 128
    return config_from_dict({"training": {"objective": objective}, "data": {"corpus": "x.jsonl", **data},
                             "posttrain": post})


def test_the_progress_line_shows_trls_columns():
    grpo = {"loss": 0.0, "reward": 0.125, "reward_std": 0.3416, "kl": 2e-4, "completions/mean_length": 3.75,
            "frac_reward_zero_std": 0.5}
    line = step_line(2, 10, grpo, PERF, mx.posttrain_columns(grpo))
    assert line.endswith("reward 0.1250, reward_std 0.3416, kl 0.0002, completion_length 3.8"), line
    dpo = {"loss": 0.69, "rewards/accuracies": 0.75, "rewards/margins": 0.0163, "rewards/chosen": 0.1}
    assert mx.posttrain_columns(dpo) == {"rewards/accuracies": "0.750", "rewards/margins": "0.0163"}
    assert mx.posttrain_columns({"loss": 2.0, "grad_norm": 1.0}) == {}  # SFT: nothing more


def test_the_held_out_evaluation_is_named_for_what_it_is():
    assert eval_line(_cfg("sft"), 2.5, perplexity=12.18) == "validation loss 2.5000 nats/token, perplexity 12.18"
    assert eval_line(_cfg("dpo"), 0.6851) == "held-out DPO loss 0.6851 per pair"
    assert eval_line(_cfg("grpo"), -0.7031) == "held-out reward (greedy) 0.7031"  # not "validation loss -0.7031"
    assert eval_parts(_cfg("grpo"), -0.7031) == ("held-out reward (greedy)", "0.7031")
    assert eval_parts(_cfg("sft"), 2.5) == ("validation loss", "2.5000 nats/token")  # the SFT lines as before


class _Table:
    def __init__(self):
        self.tables = []

    def log(self, step, values):
        pass

    def table(self, step, name, rows):
        self.tables.append((step, name, rows))

    def close(self, exit_code=0):
        pass


def test_log_completions_prints_them_with_their_rewards_and_tables_them(tmp_path):
    rows = [{"step": 3, "prompt": "1+2=", "completion": "3\n", "exact_match": 1.0, "reward": 1.0, "advantage": 0.75},
            {"step": 3, "prompt": "1+2=", "completion": "4", "exact_match": 0.0, "reward": 0.0, "advantage": -0.75}]
    assert mx.completions_text(rows).splitlines() == [
        "completions of the rollout of step 3:",
        "  '1+2=' -> '3\\n': exact_match 1.0000, reward 1.0000, advantage 0.7500",
        "  '1+2=' -> '4': exact_match 0.0000, reward 0.0000, advantage -0.7500"]
    sink = _Table()
    w = mx.MetricsWriter(str(tmp_path), sinks=[sink])
    w.table(4, "completions", rows)
    w.close()
    assert sink.tables == [(4, "completions", rows)]


def test_the_start_up_says_where_the_output_goes():
    cfg = config_from_dict({"logging": {"run_dir": "runs/x"}, "fault_tolerance": {"hang_timeout_s": 0}})
    here = os.path.abspath("runs/x")
    assert output_lines(cfg) == [
        f"run folder {here}: metrics in {here}/metrics.jsonl, log in {here}/train.log",
        "no checkpoint is saved (checkpoint.dir is empty): set checkpoint.dir=checkpoints/NAME to keep the trained "
        "model"]
    cfg = config_from_dict({"checkpoint": {"dir": "ck", "save_every": 10, "local_every": 5, "local_dir": "/l"},
                            "training": {"eval_every": 0}})
    lines = output_lines(cfg)
    assert lines[1] == f"checkpoints to {os.path.abspath('ck')} (every 10 steps, at the end)"
    assert lines[2] == "emergency checkpoints on: every 5 steps in /l (checkpoint.local_every)"
    assert lines[3].startswith("hang watchdog on: a process with no finished step for max(180 s, 10 x the median")


def test_post_training_with_sft_shaped_defaults_is_told_what_fits():
    """Issue 54 item 13: seq_len 512 for 5-token GRPO prompts names the seq_len the data needs; a warm-up
    at or past max_steps is named with the rate the last step gets and a value that works."""
    cfg = config_from_dict({"training": {"objective": "grpo", "seq_len": 512, "batch_size": 16},
                            "data": {"format": "prompts", "corpus": "p.jsonl"},
                            "posttrain": {"num_generations": 4, "max_completion_length": 64}})
    assert prompt_length_hint(cfg, 5) == (
        "GRPO pads every prompt to 449 tokens (training.seq_len=512 + 1 - posttrain.max_completion_length=64) and "
        "the longest is 5: training.seq_len=68 fits this data (the longest prompt + max_completion_length - 1), and "
        "every step's rollout and update shrink with it")
    assert prompt_length_hint(cfg, 300) is None
    warn = warmup_warning(config_from_dict({"training": {"warmup_steps": 30, "max_steps": 2, "learning_rate": 3e-3}}))
    assert warn == ("training.warmup_steps=30 >= training.max_steps=2: the learning rate never reaches "
                    "training.learning_rate=0.003 (the last step runs at 2.000e-04); set training.warmup_steps=0 "
                    "(or anything below 2)"), warn
    assert warmup_warning(config_from_dict({"training": {"warmup_steps": 10, "max_steps": 100}})) is None


def test_held_out_and_goodput_scalars_have_their_own_sections():
    """Issue 54 item 18: TensorBoard and W&B get held-out metrics under eval/, goodput's under goodput/."""
    assert mx.scalars({"step": 4, "val_loss": -0.5, "val_reward": 0.5, "val_rewards/exact_match": 0.25}) == {
        "eval/val_loss": -0.5, "eval/val_reward": 0.5, "eval/val_rewards/exact_match": 0.25}
    assert mx.scalars({"step": 4, "loss": 0.1, "reward": 0.5, "eval_only": True}) == {"train/loss": 0.1,
                                                                                     "train/reward": 0.5}
    assert mx.scalars({"step": 9, "event": "goodput", "goodput": 0.4, "steps_lost": 2, "goodput_compilation_s": 8.0}) == {
        "goodput/goodput": 0.4, "goodput/steps_lost": 2.0, "goodput/goodput_compilation_s": 8.0}


def test_the_train_step_is_named_in_traces():
    """Issue 54 item 18: the profiler's trace and the HLO name the step jit(train_step), not
    jit(<unnamed function>)."""
    plan = make_plan(tiny_config(), make_mesh(tiny_config().parallel, jax.devices()[:1]))
    assert make_train_step(plan, build_optimizer(plan.cfg.training, plan)).__name__ == "train_step"
