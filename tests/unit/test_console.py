"""What a post-training run's console says (issue 54, items 11 and 18): TRL's columns, the held-out
evaluation named for what it is, ``posttrain.log_completions``' block and W&B table, and the names
TensorBoard and W&B file the records under."""

from jaxcolossal import metrics as mx
from jaxcolossal.config import config_from_dict
from jaxcolossal.train.loop import eval_line, step_line

PERF = {"tokens_per_s": 1000.0, "tflops_6n": 1e-6}


def _cfg(objective):
    data = {"dpo": {"format": "preference"}, "grpo": {"format": "prompts"}}.get(objective, {})
    return config_from_dict({"training": {"objective": objective}, "data": {"corpus": "x.jsonl", **data}})


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
    assert eval_line(_cfg("grpo"), -0.7031, value_only=True) == "0.7031"


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
