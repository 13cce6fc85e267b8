"""Reward models through the one train step (training.objective=reward): ZeRO-2 over dp 4 × tp 2 equals one
device (the loss and every gradient leaf, with margins and the centring term), the step's TRL metrics agree
across layouts (ZeRO-1's per-shard statistics: a min and a max over the data shards), the score head replaces
``lm_head`` in the state, and the config refuses what reward-model training does not run with."""
import json
import os
import sys
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny import TINY_MODEL, TINY_TRAINING, setup, worst_leaf_rel

from jaxcolossal.config import ConfigError, config_from_dict, load_config
from jaxcolossal.data import get_tokenizer
from jaxcolossal.data.preference import load_preferences
from jaxcolossal.parallel.mesh import make_mesh
from jaxcolossal.posttrain.reward import REWARD_METRICS
from jaxcolossal.train.loop import train
from jaxcolossal.train.objective import make_objective
from jaxcolossal.train.optimizer import build_optimizer
from jaxcolossal.train.state import init_state, make_plan
from jaxcolossal.train.step import make_grad_fn

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ONE = None
ZERO2 = {"data_parallel_size": 4, "tensor_parallel_size": 2, "zero_stage": 2}


SMALL = {"batch_size": 8, "seq_len": 16}
"""A step of 4 pairs of 16 tokens: one pair per data shard of dp 4."""


def reward_config(parallel=None, posttrain=None, training=None, model=None):
    return config_from_dict({"model": {**TINY_MODEL, **(model or {})},
                             "training": {**TINY_TRAINING, **SMALL, "objective": "reward", **(training or {})},
                             "data": {"format": "preference", "corpus": "unused.jsonl"},
                             "posttrain": posttrain or {}, "parallel": parallel or {"data_parallel_size": 1}})


def reward_batches(cfg, steps, seed=0):
    """Interleaved pair rows (2i chosen, 2i+1 rejected) sharing a prompt, right-padded with 0 (the byte
    tokenizer's pad) at mixed lengths, and each pair's margin broadcast over its rows."""
    rng = np.random.default_rng(seed)
    t, v = cfg.training, cfg.model.vocab_size
    out = []
    for _ in range(steps):
        rows = rng.integers(1, v, (t.batch_size, t.seq_len + 1)).astype(np.int32)
        for i in range(0, t.batch_size, 2):
            rows[i + 1, :6] = rows[i, :6]
            for r in (i, i + 1):
                rows[r, rng.integers(8, t.seq_len + 1):] = 0
        margin = np.repeat(rng.uniform(-1, 1, t.batch_size // 2).astype(np.float32), 2)
        out.append({"inputs": rows[:, :-1], "targets": rows[:, 1:], "loss_mask": np.ones((t.batch_size, t.seq_len),
                   np.float32), "margin": np.ascontiguousarray(np.broadcast_to(margin[:, None], rows[:, :-1].shape))})
    return out


def _plan(cfg, layout):
    return make_plan(cfg, make_mesh(cfg.parallel, jax.devices()[:1] if layout is None else None))


def loss_and_grads(layout, posttrain):
    """One step's mean loss and fp32 gradient (host numpy) on ``layout`` through the step's gradient function,
    from the same initial params (key 0) moved by 2% host noise (so the rewards differ)."""
    cfg = reward_config(layout, posttrain)
    plan = _plan(cfg, layout)
    state = init_state(plan, build_optimizer(cfg.training, plan), key=jax.random.key(0))
    rng = np.random.default_rng(1)
    params = jax.tree.map(lambda p: jax.device_put(np.asarray(p) * (1 + 0.02 * rng.standard_normal(p.shape)).astype(
        p.dtype), p.sharding), state.params)
    b = jax.device_put(reward_batches(cfg, 1)[0], plan.batch_sharding)
    loss_sum, grads = jax.jit(partial(make_grad_fn(plan), fields={"margin": b["margin"]}))(
        params, b["inputs"], b["targets"], np.float32(1.0), b["loss_mask"])
    return float(loss_sum) / (cfg.training.batch_size // 2), jax.device_get(grads), state


def test_reward_zero2_dp4_tp2_equals_one_device():
    """Loss and every gradient leaf within 1e-5 relative, with margins and center_rewards_coefficient=0.01; the
    state holds ``score [d, 1]`` and no ``lm_head``."""
    post = {"center_rewards_coefficient": 0.01}
    one_loss, one, state = loss_and_grads(ONE, post)
    par_loss, par, _ = loss_and_grads(ZERO2, post)
    assert "lm_head" not in state.params and state.params["score"].shape == (TINY_MODEL["hidden_size"], 1)
    loss_rel = abs(par_loss - one_loss) / abs(one_loss)
    worst = worst_leaf_rel(par, one)
    print(f"\nreward: loss {par_loss:.6g} vs {one_loss:.6g} (rel {loss_rel:.1e}); worst gradient leaf {worst}")
    assert loss_rel <= 1e-5 and worst[1] <= 1e-5


def run_reward(cfg, devices=None, steps=2):
    plan, _, state, step = setup(cfg, devices)
    metrics = []
    for b in reward_batches(cfg, steps):
        state, m = step(state, jax.device_put(b, plan.batch_sharding))
        metrics.append({k: float(v) for k, v in m.items()})
    return metrics


def test_reward_metrics_zero1_dp4_equal_one_device():
    """Two steps: TRL's metrics (min_reward/max_reward over all the data shards' rewards: a min and a max of
    the per-shard statistics) and the loss under ZeRO-1's per-shard path equal one device's. (With gradient
    accumulation each microbatch holds other rows on another layout, so the mean over microbatches of each
    one's min and max differ between layouts, as TRL's per-process accumulation does.)"""
    one = run_reward(reward_config(), jax.devices()[:1])
    par = run_reward(reward_config({"data_parallel_size": 4, "zero_stage": 1}), jax.devices()[:4])
    for a, b in zip(par, one):
        for k in ("loss",) + REWARD_METRICS:
            np.testing.assert_allclose(a[k], b[k], rtol=2e-5, atol=1e-6, err_msg=k)
    assert one[0]["min_reward"] < one[0]["mean_reward"] < one[0]["max_reward"]


@pytest.mark.parametrize("raw, message", [
    ({"model": {"num_labels": 0}}, "training.objective=reward trains a score head: set model.num_labels=1"),
    ({"model": {"lora": {"rank": 4}}}, "training.objective=reward does not run with LoRA"),
    ({"posttrain": {"beta": 0.1}}, "posttrain.beta=0.1 is not read by reward-model training"),
    ({"posttrain": {"label_smoothing": 0.1}}, "posttrain.label_smoothing=0.1 is a DPO key"),
    ({"posttrain": {"center_rewards_coefficient": -1}}, "posttrain.center_rewards_coefficient=-1"),
    ({"data": {"format": "prompts"}}, "training.objective=reward with data.format=prompts"),
    ({"training": {"objective": "dpo"}, "model": {"num_labels": 1}}, "model.num_labels=1 .* trains only with"),
    ({"training": {"objective": "dpo"}, "posttrain": {"center_rewards_coefficient": 0.01}}, "is a REWARD key"),
])
def test_the_config_refuses_in_one_line(raw, message):
    base = {"model": dict(TINY_MODEL), "training": {**TINY_TRAINING, "objective": "reward"},
            "data": {"format": "preference", "corpus": "unused.jsonl"}}
    for section, values in raw.items():
        base[section] = {**base.get(section, {}), **values}
    with pytest.raises(ConfigError, match=message) as e:
        config_from_dict(base)
    assert "\n" not in str(e.value)


def test_reward_tiny_learns_and_exports_as_llama_for_sequence_classification(tmp_path):
    """configs/reward_tiny.yaml (ZeRO-2 over dp 4 × tp 2, 300 steps on configs/data/dpo_tiny.jsonl): the held-out
    accuracy (the objective's evaluation, written as ``val_accuracy``) rises above the start's and above 0.6;
    ``convert_hf.py --to-hf`` of its checkpoint writes a ``LlamaForSequenceClassification`` whose scores of the
    held-out rows equal the trained params' (pad id 0: the byte tokenizer's rows)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import convert_hf  # heavy: from scripts/, put on sys.path by this test only

    cfg = load_config(f"{ROOT}/configs/reward_tiny.yaml", [f"data.corpus={ROOT}/configs/data/dpo_tiny.jsonl",
                                                          f"logging.run_dir={tmp_path}/run",
                                                          f"checkpoint.dir={tmp_path}/ckpt"])
    out = train(cfg)
    recs = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    acc = {r["step"]: r["val_accuracy"] for r in recs if "val_accuracy" in r}
    print(f"\nheld-out accuracy by step: {acc}")
    assert acc[300] > max(acc[0], 0.6), acc
    convert_hf.to_hf(str(tmp_path / "ckpt"), str(tmp_path / "hf"))
    model, info = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "hf",
                                                                                    output_loading_info=True)
    assert type(model).__name__ == "LlamaForSequenceClassification" and model.config.pad_token_id == 0
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    rows = np.asarray(load_preferences(cfg.data, get_tokenizer("byte"), cfg.training.seq_len).rows(np.arange(8))[0])
    x = rows[:, :-1]
    plan = out["plan"]
    params = jax.device_get(out["state"].master if plan.mixed else out["state"].params)
    obj = make_objective(plan.family, cfg)
    ours = np.asarray(obj.rewards(params, jnp.asarray(x), cfg.model, lambda a, _: a, False))
    with torch.no_grad():
        want = model.float().eval()(torch.from_numpy(x.astype(np.int64))).logits[:, 0].numpy()
    print(f"export: max |score diff| {np.max(np.abs(ours - want)):.1e}")
    np.testing.assert_allclose(ours, want, atol=1e-5, rtol=1e-5)
