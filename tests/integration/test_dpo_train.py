"""DPO through the one train step (training.objective=dpo): ZeRO-2 over dp 4 × tp 2 equals one device (for
every TRL loss type: its loss and gradient), and LoRA's DPO uses the base without adapters as its reference (no second copy in the state)."""
import functools
import os
from functools import partial

import jax
import numpy as np
import pytest
from tiny import TINY_MODEL, TINY_TRAINING, assert_params_match, resumed_and_uninterrupted, setup, worst_leaf_rel

from jaxcolossal.config import config_from_dict
from jaxcolossal.config.derived import DPO_LOSS_TYPES, LABEL_SMOOTHING_LOSSES
from jaxcolossal.parallel.mesh import make_mesh
from jaxcolossal.plan import plan_dry_run
from jaxcolossal.posttrain.dpo import DPO_METRICS
from jaxcolossal.train.optimizer import build_optimizer
from jaxcolossal.train.state import init_state, make_plan
from jaxcolossal.train.step import make_grad_fn

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def dpo_config(parallel=None, model=None, posttrain=None, precision=None):
    return config_from_dict({**({"precision": {precision: True}} if precision else {}),"model": {**TINY_MODEL, **(model or {})},
                             "training": {**TINY_TRAINING, "objective": "dpo", "learning_rate": 1e-3},
                             "data": {"format": "preference", "corpus": "unused.jsonl"},
                             "posttrain": {"beta": 0.5, **(posttrain or {})},
                             "parallel": parallel or {"data_parallel_size": 1}})


def pair_batches(cfg, steps, seed=0):
    """Interleaved pair rows (2i chosen, 2i+1 rejected) sharing a prompt, with response-only masks."""
    rng = np.random.default_rng(seed)
    t, v = cfg.training, cfg.model.vocab_size
    out = []
    for _ in range(steps):
        rows = rng.integers(1, v, (t.batch_size, t.seq_len + 1)).astype(np.int32)
        mask = np.zeros((t.batch_size, t.seq_len), np.float32)
        for i in range(0, t.batch_size, 2):
            p = rng.integers(4, 10)
            rows[i + 1, :p] = rows[i, :p]
            for r in (i, i + 1):
                mask[r, p - 1: p - 1 + rng.integers(5, t.seq_len - p)] = 1
        out.append((rows, mask))
    return out


def run_dpo(cfg, devices=None, steps=3):
    plan, tx, state, step = setup(cfg, devices)
    metrics = []
    for rows, mask in pair_batches(cfg, steps):
        batch = {"inputs": rows[:, :-1], "targets": rows[:, 1:], "loss_mask": mask}
        state, m = step(state, {k: jax.device_put(a, plan.batch_sharding) for k, a in batch.items()})
        metrics.append({k: float(v) for k, v in m.items()})
    return state, metrics, plan


@pytest.mark.parametrize("zero", [2, 1, 3])
def test_dpo_zero_dp4_tp2_equals_one_device(zero):
    """ZeRO-2 is the acceptance's layout; ZeRO-1 and ZeRO-3 go through the same objective."""
    one, m1, _ = run_dpo(dpo_config(), jax.devices()[:1])
    par, m8, _ = run_dpo(dpo_config({"data_parallel_size": 4, "tensor_parallel_size": 2, "zero_stage": zero}))
    for a, b in zip(m8, m1):
        for k in ("loss",) + DPO_METRICS:
            # the rewards are β × differences of sequence log-probs of size ~150: fp32 summation order
            # moves them by ~1e-6 absolute, which is large relative to a margin near 0.03
            np.testing.assert_allclose(a[k], b[k], rtol=2e-5, atol=1e-5, err_msg=k)
    assert m1[0]["rewards/accuracies"] == 0.0 and abs(m1[0]["loss"] - np.log(2)) < 1e-6  # policy == reference at step 0
    assert m1[-1]["rewards/margins"] != 0.0
    assert_params_match(jax.device_get(par.params), jax.device_get(one.params))
    assert_params_match(jax.device_get(par.reference), jax.device_get(one.reference))


LAYOUTS = {"one device": None, "ZeRO-2 dp4 x tp2": {"data_parallel_size": 4, "tensor_parallel_size": 2, "zero_stage": 2},
           "ZeRO-1 dp8": {"data_parallel_size": 8, "zero_stage": 1}}


@functools.cache
def _policy_and_reference(layout):
    """The layout's initial params (the reference) and a policy moved off them (each weight plus 2% noise drawn on
    the host, so that the log-ratios are not 0), built once per layout: the losses share them."""
    cfg = dpo_config(LAYOUTS[layout])
    plan = make_plan(cfg, make_mesh(cfg.parallel, jax.devices()[:1] if LAYOUTS[layout] is None else None))
    state = init_state(plan, build_optimizer(cfg.training, plan), key=jax.random.key(0))
    rng = np.random.default_rng(1)
    params = jax.tree.map(lambda p: jax.device_put(np.asarray(p) * (1 + 0.02 * rng.standard_normal(p.shape)).astype(
        p.dtype), p.sharding), state.params)
    return params, state.reference


def dpo_loss_and_grads(layout, posttrain):
    """One step's mean loss and fp32 gradient (host numpy) on ``layout`` through the step's gradient function."""
    cfg = dpo_config(LAYOUTS[layout], posttrain=posttrain)
    plan = make_plan(cfg, make_mesh(cfg.parallel, jax.devices()[:1] if LAYOUTS[layout] is None else None))
    params, reference = _policy_and_reference(layout)
    rows, mask = pair_batches(cfg, 1)[0]
    batch = jax.device_put({"inputs": rows[:, :-1], "targets": rows[:, 1:], "loss_mask": mask}, plan.batch_sharding)
    loss_sum, grads = jax.jit(partial(make_grad_fn(plan), reference=reference))(
        params, batch["inputs"], batch["targets"], np.float32(1.0), batch["loss_mask"])
    return float(loss_sum) / (cfg.training.batch_size // 2), jax.device_get(grads)


FAST_LOSSES = ("ipo", "bco_pair", "sft")
"""README's suite runs these (a length-normalised loss, a batch-coupled one, the NLL over the chosen
tokens); the other losses' cases are marked slow."""


@pytest.mark.parametrize("loss_type", [n if n in FAST_LOSSES else pytest.param(n, marks=pytest.mark.slow)
                                       for n in DPO_LOSS_TYPES if n != "sigmoid"])  # sigmoid: the test above
def test_each_dpo_loss_zero2_dp4_tp2_equals_one_device(loss_type):
    """Each TRL loss type (the label-smoothing ones at ε = 0.1): loss and every gradient leaf within 1e-5 relative.
    aot's sort and sft's token mean span the whole microbatch under ZeRO-2 (the layer-wise reduction), as on one
    device."""
    post = {"loss_type": loss_type, "label_smoothing": 0.1 if loss_type in LABEL_SMOOTHING_LOSSES else 0.0}
    one_loss, one = dpo_loss_and_grads("one device", post)
    par_loss, par = dpo_loss_and_grads("ZeRO-2 dp4 x tp2", post)
    loss_rel = abs(par_loss - one_loss) / abs(one_loss)
    worst = worst_leaf_rel(par, one)
    print(f"\n{loss_type}: loss {par_loss:.6g} vs {one_loss:.6g} (rel {loss_rel:.1e}); worst gradient leaf {worst}")
    assert loss_rel <= 1e-5 and worst[1] <= 1e-5


def test_sft_term_spans_the_microbatch_over_per_shard_gradients():
    """ZeRO-1 over dp 8 takes each data shard's gradient apart (no layer-wise reduction): sft's mean NLL is
    still over all the microbatch's chosen tokens (the step's ``microbatch_chosen_tokens``), so the loss
    and gradient equal one device's within 1e-5."""
    post = {"loss_type": "sigmoid,sft"}
    one_loss, one = dpo_loss_and_grads("one device", post)
    par_loss, par = dpo_loss_and_grads("ZeRO-1 dp8", post)
    assert abs(par_loss - one_loss) <= 1e-5 * abs(one_loss), (par_loss, one_loss)
    for a, b in zip(jax.tree.leaves(par), jax.tree.leaves(one)):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert np.linalg.norm(a - b) <= 1e-5 * np.linalg.norm(b)


def test_lora_dpo_reference_is_the_base():
    state, m, plan = run_dpo(dpo_config(model={"lora": {"rank": 4}}, posttrain={"reference": "lora_base"}),
                             jax.devices()[:1], steps=2)
    assert state.reference is None and state.frozen is not None  # no second copy of the weights
    assert abs(m[0]["loss"] - np.log(2)) < 1e-6  # adapters start at B = 0: the policy is the base
    assert m[1]["rewards/margins"] != 0.0


DPO_JOB = ["training.objective=dpo", "data.format=preference", f"data.corpus={ROOT}/configs/data/dpo_tiny.jsonl",
           "data.tokenizer=byte", "training.seq_len=64", "posttrain.beta=0.1"]
"""The small main job turned into DPO on the example's pairs (configs/dpo_tiny.yaml's data)."""


def test_dpo_resume_is_bit_exact(tmp_path):
    full, resumed, losses = resumed_and_uninterrupted(tmp_path, DPO_JOB + ["checkpoint.save_every=3"])
    assert losses[0] == losses[1] and len(losses[0]) == 6
    for a, b in ((full["state"].master, resumed["state"].master), (full["state"].reference, resumed["state"].reference),
                 (full["state"].opt_state, resumed["state"].opt_state)):
        jax.tree.map(np.testing.assert_array_equal, jax.device_get(a), jax.device_get(b))
    assert full["state"].reference is not None


def test_the_dry_run_shows_the_reference_copy_or_none_under_lora():
    full = plan_dry_run(dpo_config({"data_parallel_size": 1}), 1).text
    assert "DPO        reference = a frozen copy of the initial params in fp32" in full
    lora = plan_dry_run(dpo_config({"data_parallel_size": 1}, model={"lora": {"rank": 4}},
                                   posttrain={"reference": "lora_base"}), 1).text
    assert "no second copy of the weights (0 B)" in lora



def test_bf16_dpo_trains():
    cfg = dpo_config({"data_parallel_size": 2, "tensor_parallel_size": 2, "zero_stage": 2}, precision="bf16")
    state, m, _ = run_dpo(cfg, jax.devices()[:4], steps=3)
    assert all(r["nonfinite"] == 0 for r in m) and m[-1]["rewards/margins"] != 0.0
    assert jax.tree.leaves(state.reference)[0].dtype == np.dtype("bfloat16")  # the compute dtype
