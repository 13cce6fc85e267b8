"""GRPO through the one train step and loop (training.objective=grpo): ZeRO-2 over dp 4 × tp 2 gives the
same rollouts and the same updates as one device; a run stopped between the two steps of a rollout
(num_iterations 2) and resumed gives the same rewards and params bit for bit; the dry run counts the
rollout; refusals come before anything compiles."""
import dataclasses
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from tiny import TINY_MODEL, assert_params_match, setup

from jaxcolossal.config import ConfigError, config_from_dict, load_config
from jaxcolossal.data import get_tokenizer
from jaxcolossal.data.prompts import load_prompts
from jaxcolossal.posttrain.rollout import Rollouts
from jaxcolossal.train.loop import train

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROMPTS = f"{ROOT}/configs/data/arith_prompts.jsonl"
# a random policy rarely answers a sum; "has a digit" scores ~15% of its 4-byte completions, so most
# groups of 4 carry a signal; exact_match rides along (0 almost everywhere) to weigh two functions
REWARDS = {"reward_funcs": "format,exact_match", "reward_weights": "1.0,0.5", "format_pattern": r"\d"}


def grpo_config(parallel=None, posttrain=None):
    return config_from_dict({"model": {**TINY_MODEL, "vocab_size": 256},
                             "training": {"batch_size": 16, "seq_len": 12, "learning_rate": 1e-3, "warmup_steps": 1,
                                          "max_steps": 10, "objective": "grpo"},
                             "data": {"format": "prompts", "corpus": PROMPTS, "tokenizer": "byte"},
                             "posttrain": {"num_generations": 4, "max_completion_length": 4, "beta": 0.04,
                                           "num_iterations": 2, "epsilon_high": 0.28, **REWARDS, **(posttrain or {})},
                             "parallel": parallel or {"data_parallel_size": 1}})


def run_grpo(cfg, devices=None, steps=4):
    plan, tx, state, step_fn = setup(cfg, devices)
    prompts = load_prompts(cfg.data, get_tokenizer("byte"), 9)
    ro = Rollouts(cfg, plan, prompts, get_tokenizer("byte"), plan.batch_sharding)
    out = []
    for s in range(steps):
        batch = ro.batch(s, state)
        state, m = step_fn(state, batch)
        out.append(({k: np.asarray(v) for k, v in ro.current.host.items()},
                    {k: float(v) for k, v in m.items()} | {k: v for k, v in ro.metrics.items() if "time" not in k}))
    return state, out


def test_grpo_zero2_dp4_tp2_equals_one_device():
    one, r1 = run_grpo(grpo_config(), jax.devices()[:1])
    par, r8 = run_grpo(grpo_config({"data_parallel_size": 4, "tensor_parallel_size": 2, "zero_stage": 2}))
    for (h1, m1), (h8, m8) in zip(r1, r8):
        for k in ("inputs", "targets", "loss_mask", "advantages"):  # the same completions, rewards, advantages
            np.testing.assert_array_equal(h8[k], h1[k], err_msg=k)
        for k in ("old_logps", "ref_logps"):
            np.testing.assert_allclose(h8[k], h1[k], rtol=1e-5, atol=1e-5, err_msg=k)
        for k in ("loss", "grad_norm", "kl", "clip_ratio/region_mean", "reward", "frac_reward_zero_std"):
            np.testing.assert_allclose(m8[k], m1[k], rtol=2e-5, atol=1e-6, err_msg=k)
    assert 0 < r1[0][1]["reward"] and r1[0][1]["frac_reward_zero_std"] < 1  # the groups carry a signal
    assert r1[1][1]["kl"] > 0 and r1[0][1]["kl"] == 0  # the policy leaves the reference after one update
    assert not np.array_equal(r1[0][0]["inputs"], r1[2][0]["inputs"])  # a new rollout every 2 steps
    assert np.array_equal(r1[0][0]["inputs"], r1[1][0]["inputs"])
    assert_params_match(jax.device_get(par.params), jax.device_get(one.params))


GRPO_JOB = ["training.objective=grpo", "data.format=prompts", f"data.corpus={PROMPTS}", "data.tokenizer=byte",
            "model.vocab_size=256", "training.seq_len=12", "training.batch_size=16", "training.eval_every=0",
            "training.sample_tokens=0", "posttrain.num_generations=4", "posttrain.max_completion_length=4",
            "posttrain.beta=0.04", "posttrain.num_iterations=2"] + [f"posttrain.{k}={v}" for k, v in REWARDS.items()]
"""The main job's model and layout (8 devices, ZeRO-2 over dp 4 × tp 2) turned into GRPO on the arithmetic prompts."""


def test_grpo_resume_between_the_steps_of_a_rollout_is_bit_exact(tmp_path):
    """Stopped at step 3 of 6 with num_iterations 2: the resumed run reads step 2's rollout back."""
    def cfg(where, *extra):
        return load_config(f"{ROOT}/configs/llama_tiny.yaml", GRPO_JOB + [
            f"logging.run_dir={where}/run", f"checkpoint.dir={where}/ckpt", "checkpoint.save_every=3",
            "logging.log_every=1", *extra])
    full = train(cfg(tmp_path / "a", "training.max_steps=6"))
    train(cfg(tmp_path / "b", "training.max_steps=3"))
    assert os.path.exists(tmp_path / "b" / "ckpt" / "rollouts" / "2.npz")
    resumed = train(cfg(tmp_path / "b", "training.max_steps=6", "training.resume=true"))

    def per_step(d):
        recs = [json.loads(line) for line in open(tmp_path / d / "run" / "metrics.jsonl")]
        return {r["step"]: (r["loss"], r["reward"], r["grad_norm"]) for r in recs if "reward" in r}
    a, b = per_step("a"), per_step("b")
    assert sorted(a) == list(range(1, 7)) and all(a[s] == b[s] for s in a)
    for x, y in ((full["state"].master, resumed["state"].master), (full["state"].opt_state, resumed["state"].opt_state),
                 (full["state"].reference, resumed["state"].reference)):
        jax.tree.map(np.testing.assert_array_equal, jax.device_get(x), jax.device_get(y))


@pytest.mark.parametrize("override, message", [
    (["training.batch_size=18"], "training.batch_size=18 completions per step is not a multiple of "
                                 "posttrain.num_generations=4"),
    (["posttrain.reward_funcs=no_such_module:fn", "posttrain.reward_weights="], "posttrain.reward_funcs: cannot import 'no_such_module'"),
    (["posttrain.reward_funcs=os.path:no_such_fn", "posttrain.reward_weights="], "module 'os.path' has no function 'no_such_fn'"),
    (["posttrain.reward_funcs=exact_match,format", "posttrain.reward_weights=1"], "has 1 weights for 2 reward_funcs"),
    (["parallel.pipeline_parallel_size=2"], "training.objective=grpo with parallel.pipeline_parallel_size=2 runs "
                                            "GPipe's schedule"),
    (["posttrain.loss_type=sigmoid"], "posttrain.loss_type=sigmoid is not a GRPO loss"),
    (["posttrain.max_completion_length=13"], "leaves no room for a prompt in training.seq_len=12"),
    (["data.format=text"], "training.objective=grpo with data.format=text"),
    (["posttrain.label_smoothing=0.1"], "posttrain.label_smoothing=0.1 is a DPO key, which a GRPO run "
                                        "(training.objective=grpo) never reads: remove it"),
    (["posttrain.reward_funcs=format,exact_match,format", "posttrain.reward_weights="], "lists format twice"),
    (["training.seq_len=1024", "posttrain.max_completion_length=1000"],
     "training.seq_len=1024 (a GRPO row: the prompt + posttrain.max_completion_length=1000 tokens) exceeds "
     "model.max_position_embeddings=512"),
])
def test_grpo_refusals_before_compiling(override, message):
    with pytest.raises(ConfigError) as e:
        load_config(f"{ROOT}/configs/llama_tiny.yaml", GRPO_JOB + override)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_grpo_composes_with_lora_bf16_and_zero3():
    """LoRA with the base as GRPO's reference (no copy), bf16, ZeRO-3 over dp 2 × tp 2: the rollouts
    sample from the merged policy, the reference log-probs come from the base, and the steps are finite."""
    cfg = config_from_dict({"model": {**TINY_MODEL, "vocab_size": 256, "lora": {"rank": 4}},
                            "training": {"batch_size": 16, "seq_len": 12, "learning_rate": 1e-2, "warmup_steps": 1,
                                         "max_steps": 10, "objective": "grpo"},
                            "data": {"format": "prompts", "corpus": PROMPTS, "tokenizer": "byte"},
                            "posttrain": {"num_generations": 4, "max_completion_length": 4, "beta": 0.04,
                                          "reference": "lora_base", **REWARDS},
                            "precision": {"bf16": True},
                            "parallel": {"data_parallel_size": 2, "tensor_parallel_size": 2, "zero_stage": 3}})
    state, out = run_grpo(cfg, jax.devices()[:4], steps=3)
    assert state.reference is None and state.frozen is not None
    assert all(m["nonfinite"] == 0 for _, m in out)
    assert out[0][1]["kl"] == 0 and out[2][1]["kl"] > 0  # adapters start at B = 0: the policy is the base
    assert jax.tree.leaves(state.frozen)[0].dtype == np.dtype("bfloat16")


def test_completions_end_at_any_eos_id_of_the_init_from_folder(tmp_path):
    """``model.init_from``'s ``generation_config.json`` eos list (LLaMA 3's form) joins the tokenizer's
    eos: a completion ends at the first token that is any of its ids (the same draws as without the list
    up to there), the loss mask stops after it, and only rows without one count as clipped."""
    cfg = grpo_config(posttrain={"num_iterations": 1, "beta": 0.0})
    plan, _, state, _ = setup(cfg, jax.devices()[:1])
    prompts = load_prompts(cfg.data, get_tokenizer("byte"), 9)
    P, C = 9, cfg.posttrain.max_completion_length

    def rollout(c):
        ro = Rollouts(c, plan, prompts, get_tokenizer("byte"), plan.batch_sharding)
        host = ro.batch(0, state) and ro.current.host
        return ro, host["targets"][:, P - 1:], host["loss_mask"][:, P - 1:]

    _, free, _ = rollout(cfg)
    eos = sorted({int(free[r, 1]) for r in range(0, 16, 5)})  # ids met at the second step of some rows
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    with_list = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, init_from=str(tmp_path)))
    ro, comp, mask = rollout(with_list)
    assert ro.eos == tuple(eos)
    ends = [next((i + 1 for i, t in enumerate(row) if t in eos), C) for row in free.tolist()]
    for r, n in enumerate(ends):
        np.testing.assert_array_equal(comp[r, :n], free[r, :n])  # the same draws up to the end
        np.testing.assert_array_equal(mask[r], np.arange(C) < n)  # trained on the tokens up to the eos
    ended = [any(t in eos for t in row) for row in free.tolist()]
    assert 0 < sum(ended) < 16 and min(ends) < C
    assert ro.metrics["completions/clipped_ratio"] == pytest.approx(1 - np.mean(ended))


def trl_solution_reward(completions, solution, **kwargs):
    """A TRL-style reward over a dataset column (``solution``), as TRL's docs write one."""
    return [float(c.strip().startswith(s)) + 0.1 * any(ch.isdigit() for ch in c) for c, s in zip(completions, solution)]


def trl_conversational_reward(completions, **kwargs):
    """A TRL-style conversational reward: each completion is ``[{"role": "assistant", "content": ...}]``."""
    return [float(any(ch.isdigit() for ch in completion[0]["content"])) for completion in completions]


def test_trl_reward_functions_run_unchanged(tmp_path):
    """Issue 54's acceptance: ``fn(completions, solution, **kw)`` over text prompts with a ``solution``
    field, and a conversational reward over chat prompts, each through two real GRPO steps (rollout,
    rewards, update) unchanged; the rows' fields and the chat messages reach them as TRL passes them."""
    rows = [json.loads(line) for line in open(PROMPTS)][:32]
    text, chat = tmp_path / "text.jsonl", tmp_path / "chat.jsonl"
    text.write_text("".join(json.dumps({"prompt": r["prompt"], "solution": r["answer"]}) + "\n" for r in rows))
    chat.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": r["prompt"]}], "id": i}) + "\n"
                            for i, r in enumerate(rows)))
    for corpus, fn in ((text, "trl_solution_reward"), (chat, "trl_conversational_reward")):
        cfg = grpo_config(posttrain={"reward_funcs": f"{__name__}:{fn}", "reward_weights": "", "num_iterations": 1})
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, corpus=str(corpus)))
        _, out = run_grpo(cfg, jax.devices()[:1], steps=2)
        assert all(m["nonfinite"] == 0 for _, m in out)
        assert all(np.isfinite(m["reward"]) and f"rewards/{__name__}:{fn}/mean" in m for _, m in out), fn


def test_a_failing_reward_module_in_the_current_folder_is_one_line_and_its_traceback(tmp_path):
    """Through scripts/train.py started in the folder that holds the reward module (no PYTHONPATH): it is
    imported, and its failure (at the held-out evaluation before step 1) is one ``reward error`` line naming
    it and the step, exit 2,
    with the module's own traceback below and none of ours."""
    (tmp_path / "my_rewards.py").write_text("def fragile(completions, **kwargs):\n    total = 0\n"
                                            "    return [len(c) / total for c in completions]\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = ROOT  # the package itself (as an install would put it), not the run's folder
    r = subprocess.run([sys.executable, f"{ROOT}/scripts/train.py", "--config", f"{ROOT}/configs/llama_tiny.yaml",
                        *GRPO_JOB, "posttrain.reward_funcs=my_rewards:fragile", "posttrain.reward_weights=",
                        "posttrain.max_completion_length=1", "training.max_steps=2", "logging.progress_bar=false",
                        f"logging.run_dir={tmp_path}/run"], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 2, r.stderr[-3000:]
    err = r.stderr.splitlines()
    first = [i for i, line in enumerate(err) if line.startswith("reward error: ")]
    assert len(first) == 1, r.stderr[-3000:]
    assert err[first[0]] == ("reward error: reward function my_rewards:fragile raised at the held-out evaluation "
                             "before step 1: ZeroDivisionError: division by zero"), r.stderr[-3000:]
    below = "\n".join(err[first[0] + 1:])
    assert "my_rewards.py" in below and "in fragile" in below and "jaxcolossal" not in below, r.stderr[-3000:]


def test_rloo_advantages_run_through_the_loader_and_step():
    """``advantage=rloo`` end to end on one device: the rollout's advantages are the leave-one-out ones of the
    KL-penalised rewards (each group's sum to 0), its ``kl`` metric is logged, and the step trains."""
    cfg = grpo_config(posttrain={"advantage": "rloo", "num_iterations": 1})
    _, out = run_grpo(cfg, jax.devices()[:1], steps=2)
    for host, metrics in out:
        adv = host["advantages"][:, 0].reshape(-1, cfg.posttrain.num_generations)
        np.testing.assert_allclose(adv.sum(axis=1), 0.0, atol=1e-5)  # leave-one-out: a group's advantages sum to 0
        assert "kl" in metrics and np.isfinite(metrics["loss"]) and "clip_ratio/high_max" in metrics
    assert out[1][1]["kl"] != 0.0  # the policy moved off the reference after one update


def test_dynamic_sampling_trains_only_on_groups_with_a_signal():
    """``dynamic_sampling``: groups whose rewards are all equal are dropped and more prompts sampled, so the
    trained batch holds none (``frac_reward_zero_std`` 0) where the plain rollout holds some; the
    ``sampling/*`` metrics count the rounds and the dropped groups."""
    plain = run_grpo(grpo_config(posttrain={"num_iterations": 1}), jax.devices()[:1], steps=2)[1]
    dyn = run_grpo(grpo_config(posttrain={"num_iterations": 1, "dynamic_sampling": True}), jax.devices()[:1],
                   steps=2)[1]
    assert max(m["frac_reward_zero_std"] for _, m in plain) > 0  # the task leaves some groups without a signal
    for host, m in dyn:
        assert m["sampling/groups_filled"] == 0 and m["frac_reward_zero_std"] == 0, m
        assert m["sampling/rounds"] >= 1 and host["inputs"].shape[0] == 16
    assert sum(m["sampling/groups_dropped"] for _, m in dyn) > 0 and max(m["sampling/rounds"] for _, m in dyn) > 1
