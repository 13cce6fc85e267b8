"""The reference model of DPO (issue 52, items 1 and 3): ``posttrain.precompute_ref_log_probs`` (TRL's
``precompute_ref_log_probs``) gives the frozen-copy run's steps, metrics, held-out evaluation and params
under ZeRO-3 over 8 devices (and every other ZeRO stage, and LoRA), holds no reference in the state, and a
resume reads the stored values instead of running the pass again; ``posttrain.ref_model`` (TRL's
``ref_model``) makes another model's weights the reference of DPO and of GRPO with β > 0."""
import json
import os

import jax
import numpy as np
import pytest
from test_dpo_train import DPO_JOB, ROOT, dpo_config
from test_grpo_train import grpo_config
from tiny import SMALL_MAIN_JOB

from jaxcolossal.checkpoint import CheckpointManager, step_dirs
from jaxcolossal.config import ConfigError, load_config
from jaxcolossal.data import get_tokenizer
from jaxcolossal.data.loader import PairLoader
from jaxcolossal.data.preference import PreferenceData
from jaxcolossal.data.prompts import load_prompts
from jaxcolossal.models import param_layout
from jaxcolossal.models.hf_io import load_hf, save_hf
from jaxcolossal.parallel.mesh import make_mesh
from jaxcolossal.plan import plan_dry_run
from jaxcolossal.posttrain.dpo import DPO_METRICS
from jaxcolossal.posttrain.ref_model import check_ref_model, load_ref_model
from jaxcolossal.posttrain.rollout import Rollouts
from jaxcolossal.train import ref_logps
from jaxcolossal.train.evaluate import evaluate_only
from jaxcolossal.train.loop import train
from jaxcolossal.train.optimizer import build_optimizer, lr_schedule
from jaxcolossal.train.start import initial_state
from jaxcolossal.train.state import init_state, make_plan
from jaxcolossal.train.step import make_objective_eval_step, make_train_step

ZERO3_8 = {"data_parallel_size": 8, "zero_stage": 3}


def random_pairs(cfg, n=40, seed=0):
    """``n`` preference pairs of random tokens sharing a prompt, with response-only masks."""
    rng = np.random.default_rng(seed)
    t, v = cfg.training.seq_len, cfg.model.vocab_size
    chosen = rng.integers(1, v, (n, t + 1)).astype(np.int32)
    rejected = rng.integers(1, v, (n, t + 1)).astype(np.int32)
    cm, rm = np.zeros((n, t), np.float32), np.zeros((n, t), np.float32)
    for i in range(n):
        p = rng.integers(4, 10)
        rejected[i, :p] = chosen[i, :p]
        cm[i, p - 1: p - 1 + rng.integers(5, t - p)] = 1
        rm[i, p - 1: p - 1 + rng.integers(5, t - p)] = 1
    return PreferenceData(chosen, rejected, cm, rm)


def run(cfg, steps=3, devices=None, evaluate=True):
    """The held-out evaluation of 2 batches (``evaluate``), then ``steps`` loop-like steps of ``cfg`` on the
    pair loader (the pass first with precompute): ``(state, [per-step metrics], held-out [(loss, metrics)])``."""
    plan = make_plan(cfg, make_mesh(cfg.parallel, devices))
    tx = build_optimizer(cfg.training, plan)
    state = initial_state(cfg, plan, tx)
    train_part, held = random_pairs(cfg).split(0.2)
    loader = PairLoader(train_part, cfg.training.batch_size, 0, mesh=plan.mesh, batch_spec=plan.batch_sharding.spec)
    evals = loader.eval_batches(*held.rows(np.arange(len(held))), cfg.training.batch_size, 2)
    evals = ref_logps.ref_logps_phase(cfg, plan, state, loader, evals, resumed=False)
    step_fn, metrics = make_train_step(plan, tx, lr_schedule(cfg.training)), []
    reference = state.frozen if cfg.posttrain.reference == "lora_base" else state.reference
    ev = make_objective_eval_step(plan)
    held_out = [ev(state.model_params, reference, *b) for b in evals] if evaluate else []
    for s in range(steps):
        state, m = step_fn(state, loader.batch(s))
        metrics.append({k: float(v) for k, v in m.items()})
    return state, metrics, [(float(v), {k: float(x) for k, x in d.items()}) for v, d in held_out]


def worst(a, b):
    """The largest absolute difference between two runs' per-step metrics (the loss and TRL's six)."""
    return max(abs(x[k] - y[k]) for x, y in zip(a, b) for k in ("loss", "grad_norm") + DPO_METRICS)


def test_precompute_equals_the_frozen_copy_zero3_over_8_devices():
    """The acceptance: loss and metrics per step, the held-out evaluation and the final params within 1e-6."""
    frozen, m_frozen, e_frozen = run(dpo_config(ZERO3_8))
    pre, m_pre, e_pre = run(dpo_config(ZERO3_8, posttrain={"precompute_ref_log_probs": True}))
    print(f"\nZeRO-3 x 8: worst per-step metric difference {worst(m_pre, m_frozen):.2e}; losses "
          f"{[m['loss'] for m in m_pre]} vs {[m['loss'] for m in m_frozen]}")
    assert pre.reference is None and frozen.reference is not None  # no reference weights held
    assert worst(m_pre, m_frozen) <= 1e-6 and m_pre[-1]["rewards/margins"] != 0
    for (v1, d1), (v2, d2) in zip(e_pre, e_frozen):
        assert abs(v1 - v2) <= 1e-6 and all(abs(d1[k] - d2[k]) <= 1e-6 for k in d1)
    diff = jax.tree.map(lambda a, b: float(np.max(np.abs(np.asarray(a) - np.asarray(b)))),
                        jax.device_get(pre.params), jax.device_get(frozen.params))
    assert max(jax.tree.leaves(diff)) <= 1e-6


@pytest.mark.parametrize("layout", [{"data_parallel_size": 4, "tensor_parallel_size": 2, "zero_stage": z}
                                    for z in (0, 1, 2)], ids=["zero0", "zero1", "zero2"])
def test_precompute_equals_the_frozen_copy_at_every_zero_stage(layout):
    _, m_frozen, _ = run(dpo_config(layout), steps=2, evaluate=False)
    _, m_pre, _ = run(dpo_config(layout, posttrain={"precompute_ref_log_probs": True}), steps=2, evaluate=False)
    assert worst(m_pre, m_frozen) <= 1e-6


def test_precompute_under_lora_runs_the_base_without_adapters():
    """TRL's adapter-off pass: the LoRA base's log-probs, the same steps as the base as the in-step reference."""
    lora = {"lora": {"rank": 4}}
    one = jax.devices()[:1]
    _, m_base, _ = run(dpo_config(model=lora, posttrain={"reference": "lora_base"}), 2, one, evaluate=False)
    pre, m_pre, _ = run(dpo_config(model=lora, posttrain={"reference": "lora_base", "precompute_ref_log_probs": True}),
                        2, one, evaluate=False)
    assert worst(m_pre, m_base) <= 1e-6 and abs(m_pre[0]["loss"] - np.log(2)) < 1e-6 and pre.reference is None


def _job(tmp_path, name, *extra):
    return load_config(f"{ROOT}/configs/llama_tiny.yaml", SMALL_MAIN_JOB + DPO_JOB + [
        f"logging.run_dir={tmp_path / name}/run", f"checkpoint.dir={tmp_path / 'ckpt'}",
        f"data.cache_dir={tmp_path}/cache", "posttrain.precompute_ref_log_probs=true", *extra])


def test_a_resume_reads_the_stored_values_and_runs_no_pass(tmp_path):
    """Two steps (the pass, the store, a checkpoint without reference arrays), then two more resumed: the
    values are read back, the pass does not run again, the steps go on from the stored values; ``--eval-only``
    repeats the last held-out evaluation from the stored held-out values."""
    passes = ref_logps.PASSES[0]
    train(_job(tmp_path, "a", "training.max_steps=2"))
    assert ref_logps.PASSES[0] == passes + 1
    store = tmp_path / "ckpt" / "ref_logps"
    meta = json.loads((store / "meta.json").read_text())
    with np.load(store / "ref_logps.npz") as z:
        assert z["train"].shape == (meta["pairs"], 2) and np.all(z["train"] < 0) and z["held_out"].shape[0] == 2
    assert not any("reference" in p for p in os.listdir(tmp_path / "ckpt" / "2" / "state"))  # nothing checkpointed
    mtime = os.path.getmtime(store / "ref_logps.npz")
    out = train(_job(tmp_path, "b", "training.max_steps=4", "training.resume=true"))
    log = (tmp_path / "b" / "run" / "train.log").read_text()
    assert ref_logps.PASSES[0] == passes + 1 and os.path.getmtime(store / "ref_logps.npz") == mtime
    assert f"reference log-probs: read from {store} for {meta['pairs']} training pairs" in log
    assert "computed for" not in log and step_dirs(str(tmp_path / "ckpt"))[-1] == 4
    assert out["state"].reference is None
    logged = [r["val_loss"] for r in map(json.loads, open(tmp_path / "b" / "run" / "metrics.jsonl"))
              if r.get("step") == 4 and "val_loss" in r][-1]
    assert evaluate_only(_job(tmp_path, "b", "training.max_steps=4"))["val_loss"] == logged
    assert ref_logps.PASSES[0] == passes + 1


def test_a_resume_with_other_data_or_no_store_is_refused(tmp_path):
    cfg = _job(tmp_path, "a")
    loader = PairLoader(random_pairs(cfg), 16, 0)
    meta = ref_logps.fingerprint(cfg, loader, [])
    with pytest.raises(ConfigError, match="holds no stored reference log-probs") as e:
        ref_logps.stored_ref_logps(str(tmp_path / "none"), meta)
    assert "\n" not in str(e.value)
    ref_logps.save_ref_logps(str(tmp_path / "s"), {"train": np.zeros((40, 2)), "held_out": np.zeros((0, 8))}, meta)
    other = ref_logps.fingerprint(cfg, PairLoader(random_pairs(cfg, seed=1), 16, 0), [])
    with pytest.raises(ConfigError, match=r"belong to other data or another reference \(pairs_sha256"):
        ref_logps.stored_ref_logps(str(tmp_path / "s"), other)
    assert ref_logps.stored_ref_logps(str(tmp_path / "s"), meta)["train"].shape == (40, 2)


def test_the_dry_run_shows_the_reference_bytes_saved():
    frozen = plan_dry_run(dpo_config(ZERO3_8), 8).text
    pre = plan_dry_run(dpo_config(ZERO3_8, posttrain={"precompute_ref_log_probs": True}), 8).text
    line = next(x for x in pre.splitlines() if x.startswith("DPO "))
    copy = next(x for x in frozen.splitlines() if x.startswith("DPO ")).split(": ")[1].split(" per device")[0]
    print(f"\nfrozen copy: {next(x for x in frozen.splitlines() if x.startswith('DPO '))}\nprecompute:  {line}")
    assert "no frozen copy in the state (0 B; " + copy + " per device saved)" in line
    assert "stored 8 B per pair (2 fp32)" in line


# ----------------------------------------------------------------------------- posttrain.ref_model


def _hf_folder(cfg, path):
    """Another tiny model of ``cfg``'s architecture (other weights: key 7) as a Hugging Face folder."""
    plan = make_plan(cfg, make_mesh(cfg.parallel, jax.devices()[:1]))
    save_hf(path, cfg.model, jax.device_get(plan.init_model(jax.random.key(7))))
    return str(path)


@pytest.fixture(scope="module")
def other_model(tmp_path_factory):
    """The DPO policy's architecture."""
    return _hf_folder(dpo_config(), tmp_path_factory.mktemp("ref") / "hf")


def test_ref_model_is_the_reference_of_dpo(other_model):
    """One step's loss with ``ref_model`` equals our objective called with that model's params as
    ``reference``, and differs from the default (the initial policy: log 2)."""
    cfg = dpo_config(ZERO3_8, posttrain={"ref_model": other_model})
    state, m, _ = run(cfg, steps=1, evaluate=False)
    default = run(dpo_config(ZERO3_8), steps=1, evaluate=False)[1]
    one = dpo_config(posttrain={"ref_model": other_model})
    plan = make_plan(one, make_mesh(one.parallel, jax.devices()[:1]))
    policy = init_state(plan, build_optimizer(one.training, plan), key=jax.random.key(one.training.seed))
    train_part, _ = random_pairs(one).split(0.2)
    batch = PairLoader(train_part, one.training.batch_size, 0).batch(0)
    _, ref_params = load_hf(other_model, vocab_pad_multiple=one.model.vocab_pad_multiple)
    ev = make_objective_eval_step(plan)
    want, _ = ev(policy.params, jax.tree.map(np.asarray, ref_params), batch["inputs"], batch["targets"],
                 batch["loss_mask"])
    print(f"\nref_model loss {m[0]['loss']:.7f}, objective with its params {float(want):.7f}, default "
          f"{default[0]['loss']:.7f}")
    assert abs(m[0]["loss"] - float(want)) <= 1e-5 and abs(default[0]["loss"] - np.log(2)) < 1e-6
    assert abs(m[0]["loss"] - default[0]["loss"]) > 1e-3


def test_ref_model_with_precompute_equals_its_frozen_copy(other_model):
    _, m_frozen, _ = run(dpo_config(ZERO3_8, posttrain={"ref_model": other_model}), steps=2, evaluate=False)
    _, m_pre, _ = run(dpo_config(ZERO3_8, posttrain={"ref_model": other_model, "precompute_ref_log_probs": True}),
                      steps=2, evaluate=False)
    assert worst(m_pre, m_frozen) <= 1e-6


def test_a_grpo_step_with_ref_model(tmp_path):
    """GRPO (β > 0) with ``ref_model``: its weights are the state's reference, the steps run, and the KL is
    > 0 from the first step (the initial policy's is 0 there: test_grpo_train)."""
    ref = _hf_folder(grpo_config(), tmp_path / "hf")
    cfg = grpo_config(posttrain={"ref_model": ref})
    plan = make_plan(cfg, make_mesh(cfg.parallel, jax.devices()[:1]))
    tx = build_optimizer(cfg.training, plan)
    state = initial_state(cfg, plan, tx)
    _, want = load_hf(ref, vocab_pad_multiple=cfg.model.vocab_pad_multiple)
    np.testing.assert_array_equal(np.asarray(state.reference["embed_tokens"]), want["embed_tokens"])
    ro = Rollouts(cfg, plan, load_prompts(cfg.data, get_tokenizer("byte"), 9), get_tokenizer("byte"),
                  plan.batch_sharding)
    step_fn = make_train_step(plan, tx, lr_schedule(cfg.training))
    state, m = step_fn(state, ro.batch(0, state))
    print(f"\nGRPO with ref_model: step 1 loss {float(m['loss']):.5f}, kl {float(m['kl']):.4f}")
    assert int(m["nonfinite"]) == 0 and float(m["kl"]) > 0.01


def test_ref_model_from_a_checkpoint_folder(tmp_path):
    """One of our runs' ``checkpoint.dir``: its newest step's weights (the fp32 master of a bf16 run), the
    vocabulary re-padded for this run's tp."""
    src = dpo_config(model={"vocab_size": 250}, precision="bf16")
    plan = make_plan(src, make_mesh(src.parallel, jax.devices()[:1]))
    state = init_state(plan, build_optimizer(src.training, plan), key=jax.random.key(3))
    ckpt = CheckpointManager(str(tmp_path / "ckpt"), config=src.to_dict(), async_save=False)
    ckpt.save(5, state)
    ckpt.close()
    cfg = dpo_config(model={"vocab_size": 250}, posttrain={"ref_model": str(tmp_path / "ckpt")})
    got = load_ref_model(cfg, tp=2)
    want = jax.device_get(state.master)
    shapes = param_layout(cfg.model, 2)[1]
    assert jax.tree.map(np.shape, got) == jax.tree.map(tuple, shapes, is_leaf=lambda x: isinstance(x, tuple))
    np.testing.assert_array_equal(got["embed_tokens"][:250], want["embed_tokens"][:250])
    assert not got["embed_tokens"][250:].any()
    np.testing.assert_array_equal(got["layers"]["wq"], want["layers"]["wq"])
    with pytest.raises(ConfigError, match=r"model.vocab_size=256 \(the reference has 250\)"):
        check_ref_model(dpo_config(model={"vocab_size": 256}, posttrain={"ref_model": str(tmp_path / "ckpt")}))


def test_ref_model_refusals(other_model, tmp_path):
    with pytest.raises(ConfigError, match="neither a Hugging Face folder"):
        check_ref_model(dpo_config(posttrain={"ref_model": str(tmp_path)}))
    with pytest.raises(ConfigError, match="model.num_layers=3 .the reference has 2."):
        check_ref_model(dpo_config(model={"num_layers": 3}, posttrain={"ref_model": other_model}))
    with pytest.raises(ConfigError, match="set posttrain.reference=frozen"):
        dpo_config(model={"lora": {"rank": 4}}, posttrain={"ref_model": other_model, "reference": "lora_base"})
    with pytest.raises(ConfigError, match="GRPO with beta 0 keeps no reference model"):
        grpo_config(posttrain={"ref_model": other_model, "beta": 0.0})
    with pytest.raises(ConfigError, match="posttrain.precompute_ref_log_probs=True is a DPO key"):
        grpo_config(posttrain={"precompute_ref_log_probs": True})
