"""Post-training on every architecture of the zoo (tests/integration/hf_zoo.py): DPO, GRPO and LoRA DPO
from ``model.init_from`` of a tiny transformers model with the real keys, 3 steps each, every metric
finite and the policy moved (DPO's margins, GRPO's KL, away from 0 after the first update)."""
import dataclasses
import os

import jax
import numpy as np
import pytest

pytest.importorskip("torch")

from hf_zoo import ZOO, build  # noqa: E402
from tiny import setup  # noqa: E402

from jaxcolossal.config import config_from_dict  # noqa: E402
from jaxcolossal.data import get_tokenizer  # noqa: E402
from jaxcolossal.data.prompts import load_prompts  # noqa: E402
from jaxcolossal.models.hf_io import load_hf  # noqa: E402
from jaxcolossal.posttrain.rollout import Rollouts  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VOCAB = 256  # byte tokens for GRPO's arithmetic prompts
STEPS = 3


@pytest.fixture(scope="module", params=sorted(ZOO))
def saved(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    build(request.param, vocab_size=VOCAB).save_pretrained(path)
    return request.param, path


def post_config(path, objective: str, lora: bool = False):
    cfg_m, _ = load_hf(path)
    model = {k: v for k, v in dataclasses.asdict(cfg_m).items() if k != "lora"}
    targets = "all" if cfg_m.type == "deepseek" else "q,v"  # DeepSeek: every projection of its latent attention
    model.update(init_from=str(path), lora={"rank": 4, "targets": targets} if lora else {})
    post = {"beta": 0.1, "reference": "lora_base"} if lora else {"beta": 0.1}
    data = {"format": "preference", "corpus": "unused.jsonl"}
    if objective == "grpo":
        post = {"num_generations": 4, "max_completion_length": 4, "beta": 0.04, "reward_funcs": "format",
                "format_pattern": r"\d"}
        data = {"format": "prompts", "corpus": f"{ROOT}/configs/data/arith_prompts.jsonl", "tokenizer": "byte"}
    return config_from_dict({"model": model, "data": data, "posttrain": post,
                             "training": {"batch_size": 8, "seq_len": 16, "learning_rate": 1e-3, "warmup_steps": 1,
                                          "max_steps": STEPS, "objective": objective},
                             "parallel": {"data_parallel_size": 1}})


def pair_batches(cfg, steps, seed=0):
    """Pairs of random rows (2i chosen, 2i + 1 rejected) sharing a prompt, response-only masks."""
    rng = np.random.default_rng(seed)
    t = cfg.training
    out = []
    for _ in range(steps):
        rows = rng.integers(2, VOCAB, (t.batch_size, t.seq_len + 1)).astype(np.int32)
        mask = np.zeros((t.batch_size, t.seq_len), np.float32)
        for i in range(0, t.batch_size, 2):
            rows[i + 1, :5] = rows[i, :5]
            mask[i:i + 2, 4:] = 1
        out.append({"inputs": rows[:, :-1], "targets": rows[:, 1:], "loss_mask": mask})
    return out


def run_dpo(cfg):
    plan, _, state, step = setup(cfg, jax.devices()[:1])
    metrics = []
    for b in pair_batches(cfg, STEPS):
        state, m = step(state, {k: jax.device_put(a, plan.batch_sharding) for k, a in b.items()})
        metrics.append({k: float(v) for k, v in m.items()})
    return metrics


@pytest.mark.parametrize("lora", [False, True], ids=["dpo", "lora_dpo"])
def test_dpo_three_steps(saved, lora):
    name, path = saved
    metrics = run_dpo(post_config(path, "dpo", lora))
    assert all(np.isfinite(v) for m in metrics for v in m.values()), metrics
    assert abs(metrics[0]["loss"] - np.log(2)) < 1e-5  # policy == reference before the first update
    assert metrics[-1]["rewards/margins"] != 0.0


def test_grpo_three_steps(saved):
    name, path = saved
    cfg = post_config(path, "grpo")
    plan, _, state, step = setup(cfg, jax.devices()[:1])
    tok = get_tokenizer("byte")
    ro = Rollouts(cfg, plan, load_prompts(cfg.data, tok, 13), tok, plan.batch_sharding)
    metrics = []
    for s in range(STEPS):
        state, m = step(state, ro.batch(s, state))
        metrics.append({k: float(v) for k, v in m.items()})
    assert all(np.isfinite(v) for m in metrics for v in m.values()), metrics
    assert metrics[0]["kl"] == 0 and metrics[-1]["kl"] > 0
