"""Heterogeneous memory (issue 11): optimizer state and ZeRO-3 compute params in pinned host memory.

Equivalence: every offload setting trains exactly as the run without it — fp32 and bf16, losses
equal and final master weights **bit-identical** (XLA's CPU backend runs the same fused update
whether the leaf lives in host or device memory; ``compute_on("device_host")`` is the same CPU).
Memory: per-device bytes by memory kind, read from each shard's ``sharding.memory_kind``, against
docs/offload.md's formulas within 2%."""

import os
import subprocess
import sys

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from tiny import assert_params_match, random_batches, run_steps, tiny_config

from jaxcolossal import Booster, GeminiPlugin, LowLevelZeroPlugin
from jaxcolossal.checkpoint import CheckpointManager
from jaxcolossal.config import ConfigError, ModelConfig, config_from_dict, load_config
from jaxcolossal.memory.budget import device_need, formula_bytes
from jaxcolossal.memory.placement import DEVICE, HOST, bytes_by_kind
from jaxcolossal.models import LlamaForCausalLM
from jaxcolossal.parallel.mesh import make_mesh, platform
from jaxcolossal.parallel.sharding import shard_bytes
from jaxcolossal.train.loop import train
from jaxcolossal.train.nvme import nvme_tier
from jaxcolossal.train.optimizer import build_optimizer, lr_schedule
from jaxcolossal.train.state import abstract_state, init_state, make_plan
from jaxcolossal.train.step import make_eval_step, make_train_step

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS = 3


def _cfg(parallel, precision="bf16", offload=None, model=None, training=None):
    cfg = tiny_config(parallel, precision, model=model, training={"max_grad_norm": 1.0, **(training or {})})
    for k, v in (offload or {}).items():
        setattr(cfg.offload, k, v)
    return cfg


def _same(a, b):
    for x, y in zip(jax.tree.leaves(jax.device_get(a)), jax.tree.leaves(jax.device_get(b))):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _psi(plan):
    """Ψ: the parameters of one model-parallel rank (the formulas' unit), from the base specs."""
    return sum(jax.tree.leaves(jax.tree.map(lambda s, sp: shard_bytes(s, np.uint8, sp, plan.mesh_shape),
                                            plan.param_shapes, plan.specs.base,
                                            is_leaf=lambda x: isinstance(x, tuple))))


def _kinds(tree):
    return {x.sharding.memory_kind for x in jax.tree.leaves(tree)}


Z3 = {"data_parallel_size": 8, "zero_stage": 3}
MODES = [
    dict(offload_optim_frac=0.5, offload_param_frac=1.0),  # params streamed layer by layer in the scan
    dict(offload_optim_frac=0.5, optimizer_device="host"),
    dict(offload_optim_frac=1.0, nvme_path="{tmp}"),  # the NVMe tier (tests/integration/test_nvme.py)
]


def test_every_offload_setting_equals_no_offload_zero3_bf16(tmp_path):
    base, mb, _ = run_steps(_cfg(Z3), steps=STEPS)
    for off in MODES:
        off = {k: v.format(tmp=tmp_path) if isinstance(v, str) else v for k, v in off.items()}
        state, m, plan = run_steps(_cfg(Z3, offload=off), steps=STEPS)
        tier = nvme_tier(plan, build_optimizer(plan.cfg.training, plan))
        if tier is not None:  # the files' bytes per device: K·Ψ/N, what host memory holds without the tier
            assert tier.bytes_per_device() == formula_bytes(_psi(plan), 8, 3, "bf16", 1.0, 0.0)["optim_host"]
            state = tier.fill(state)  # the whole state, read back from the files
        assert [r["loss"] for r in m] == [r["loss"] for r in mb], off
        _same(state.master, base.master)
        _same(state.opt_state, base.opt_state)
        _same(state.params, base.params)
        if off.get("offload_optim_frac") == 1.0:
            assert _kinds(state.master) == {HOST}
        if off.get("offload_param_frac") == 1.0:
            assert _kinds(state.params) == {HOST}
            # evaluation reads the host-resident params too (the main job's validation)
            x = random_batches(plan.cfg, 1, seed=7)[0]
            xs = (jax.device_put(x[:, :-1], plan.batch_sharding), jax.device_put(x[:, 1:], plan.batch_sharding))
            assert float(make_eval_step(plan)(state.params, *xs)) == float(make_eval_step(plan)(base.params, *xs))
        assert abs(plan.placement.optim_frac - off.get("offload_optim_frac", 0)) < 0.01


@pytest.mark.parametrize("parallel,precision", [
    ({"tensor_parallel_size": 2, "data_parallel_size": 4, "zero_stage": 2}, None),
    ({"pipeline_parallel_size": 2, "data_parallel_size": 4, "zero_stage": 1}, "bf16"),
], ids=["tp2_zero2_fp32_nvme", "pp2_zero1_bf16_host"])
def test_optimizer_offload_with_tp_and_pp(parallel, precision, tmp_path):
    """tp 2 with the NVMe tier (the device-streamed update reading and writing files), pp 2 with the
    update on the host."""
    base, mb, _ = run_steps(_cfg(parallel, precision), steps=STEPS)
    pp = "pipeline_parallel_size" in parallel
    off = dict(offload_optim_frac=1.0, optimizer_device="host") if pp else dict(offload_optim_frac=1.0,
                                                                                nvme_path=str(tmp_path))
    state, m, plan = run_steps(_cfg(parallel, precision, off), steps=STEPS)
    if not pp:
        state = nvme_tier(plan, build_optimizer(plan.cfg.training, plan)).fill(state)
    assert [r["loss"] for r in m] == [r["loss"] for r in mb], off
    _same(state.opt_state, base.opt_state)
    _same(state.params, base.params)


def test_fused_adamw_updates_offloaded_leaves_on_the_host():
    """The fused optimizer's host part is its plain-JAX reference on global arrays, the device part
    its per-shard ``shard_map`` update: XLA fuses the two differently, so the master weights agree to
    Adam's ε-amplified summation noise (``assert_params_match``), not bit for bit; losses to 1e-6."""
    t = {"optimizer": "fused_adamw"}
    base, mb, _ = run_steps(_cfg(Z3, None, training=t), steps=2)
    state, m, _ = run_steps(_cfg(Z3, None, training=t, offload=dict(offload_optim_frac=0.5, optimizer_device="host")),
                            steps=2)
    np.testing.assert_allclose([r["loss"] for r in m], [r["loss"] for r in mb], rtol=1e-6)
    assert_params_match(jax.device_get(state.params), jax.device_get(base.params))


def test_activation_offload_equals_selective_remat():
    par = {"data_parallel_size": 8, "zero_stage": 1}
    base, mb, _ = run_steps(_cfg(par, None, model={"remat": "selective"}), steps=3)
    state, m, plan = run_steps(_cfg(par, None, offload={"activations": "host"}), steps=3)
    assert plan.cfg.model.remat == "offload"
    assert [r["loss"] for r in m] == [r["loss"] for r in mb]
    _same(state.params, base.params)


def _abstract_step(off):
    cfg = _cfg(Z3, offload=off)
    plan = make_plan(cfg, make_mesh(cfg.parallel))
    tx = build_optimizer(cfg.training, plan)
    state = abstract_state(plan, tx)
    t = cfg.training
    batch = {k: jax.ShapeDtypeStruct((t.batch_size, t.seq_len), np.int32, sharding=plan.batch_sharding)
             for k in ("inputs", "targets")}
    return plan, make_train_step(plan, tx, lr_schedule(t)), state, batch


def test_offloaded_update_structure_and_cuda_export():
    """HLO checks, on the lowered program (XLA's CPU backend ignores memory spaces, so the compiled
    memory analysis cannot show them): with ``optimizer_device=host`` the offloaded AdamW is a host
    computation; with ``device`` the offloaded leaves are streamed one at a time, each leaf's
    move-in chained after the previous leaf's results by an optimization barrier, so no point
    of the step needs the whole offloaded optimizer state in device memory. Every setting exports
    for CUDA (``jax.export``, platforms=["cuda"]), so a GPU lowering error shows up here."""
    plan, step, state, batch = _abstract_step(dict(offload_optim_frac=1.0, optimizer_device="host"))
    text = step.lower(state, batch).as_text()
    assert '_xla_compute_type = "host"' in text
    plan, step, state, batch = _abstract_step(dict(offload_optim_frac=1.0))
    text = step.lower(state, batch).as_text()
    n_leaves = sum(jax.tree.leaves(plan.placement.optim))
    assert n_leaves > 2 and text.count("stablehlo.optimization_barrier") == n_leaves - 1
    assert '_xla_compute_type = "host"' not in text
    for off in (dict(offload_optim_frac=0.5), dict(offload_optim_frac=1.0, optimizer_device="host",
                                                   offload_param_frac=1.0), dict(activations="host")):
        _, step, state, batch = _abstract_step(off)
        exported = jax.export.export(step, platforms=["cuda"])(state, batch)
        assert "annotate_device_placement" in exported.mlir_module(), off


def _device_puts(jaxpr, in_scan=False, out=None, scans=None):
    """(inside a scan?, operand shape, target, scans seen before it) of every ``device_put`` in
    ``jaxpr`` and its sub-jaxprs, in program order."""
    out = [] if out is None else out
    scans = [0] if scans is None else scans
    for e in jaxpr.eqns:
        if e.primitive.name == "device_put":
            out += [(in_scan, tuple(v.aval.shape), str(e.params["devices"]), scans[0]) for v in e.invars]
        for p in e.params.values():
            for sub in p if isinstance(p, (list, tuple)) else [p]:
                if isinstance(sub, (jax.extend.core.ClosedJaxpr, jax.extend.core.Jaxpr)):
                    _device_puts(getattr(sub, "jaxpr", sub), in_scan or e.primitive.name == "scan", out, scans)
        if e.primitive.name == "scan":
            scans[0] += 1
    return out


def test_offloaded_params_stream_in_one_layer_at_a_time():
    """``offload_param_frac=1`` under ZeRO-3: the stacked layer weights are not moved into device
    memory whole; the layer scan's body moves one layer's slice in (and its gradient back out).
    After the backward scan the step moves the gradients (sharded, 1/N) in to accumulate them."""
    plan, step, state, batch = _abstract_step(dict(offload_param_frac=1.0))
    puts = _device_puts(jax.make_jaxpr(step)(state, batch).jaxpr)
    is_shape = lambda x: isinstance(x, tuple) and all(isinstance(i, int) for i in x)  # noqa: E731
    stacked = {tuple(s) for s in jax.tree.leaves(plan.param_shapes["layers"], is_leaf=is_shape)}
    layer = {s[1:] for s in stacked}
    last_scan = max(p[3] for p in puts)
    assert last_scan >= 2  # the forward and the backward layer scans
    # no whole stack comes in before the backward is done (the forward scan is the first)
    assert not [p for p in puts if not p[0] and p[1] in stacked and p[3] < last_scan]
    fetched = {p[1] for p in puts if p[0] and "Device" in p[2]}
    assert layer <= fetched, (layer, fetched)  # each layer's slice does, inside the scan


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_bytes_by_memory_kind_match_the_formulas(zero):
    """docs/offload.md: device = p·Ψ(1−f̂ₚ)/N₃ + K·Ψ(1−f̂ₒ)/N₁, host = p·Ψ·f̂ₚ/N₃ + K·Ψ·f̂ₒ/N₁, within 2% with the
    fractions asked (the fractions reached are within 1% of them for this model)."""
    for frac in (0.0, 0.5, 1.0):
        off = {"offload_optim_frac": frac}
        if zero == 3:
            off["offload_param_frac"] = frac
        cfg = _cfg({"data_parallel_size": 8, "zero_stage": zero}, "bf16", off)
        plan = make_plan(cfg, make_mesh(cfg.parallel))
        tx = build_optimizer(cfg.training, plan)
        state = jax.tree.map(lambda a: jax.device_put(np.zeros(a.shape, a.dtype), a.sharding),
                             abstract_state(plan, tx))  # the arrays with the state's shardings, no compile
        got = bytes_by_kind([state.params, state.master, state.opt_state])
        psi = _psi(plan)
        want = formula_bytes(psi, 8, zero, "bf16", frac, off.get("offload_param_frac", 0.0))
        for kind, key in ((DEVICE, "device"), (HOST, "host")):
            if want[key] == 0:
                assert got[kind] <= 64, (zero, frac, kind, got)  # the step counters only
            else:
                assert abs(got[kind] - want[key]) / want[key] < 0.02, (zero, frac, kind, got, want)


def test_too_big_is_refused_before_compiling_and_auto_fits():
    cfg = _cfg(Z3, "bf16")
    mesh = make_mesh(cfg.parallel)
    plan = make_plan(cfg, mesh)
    need = device_need(plan.placement, cfg, plan.param_shapes, plan.specs, plan.mesh_shape, platform(plan.mesh))
    limit = int(need["total"] - 0.5 * need["state"])  # below the need without offload, above it with
    cfg.offload.device_memory_limit = str(limit)
    with pytest.raises(ConfigError, match=r"short by [\d,]+ bytes; offload.offload_optim_frac=[\d.]+ .*would fit"):
        make_plan(cfg, mesh)
    cfg.offload.placement_policy = "auto"
    plan = make_plan(cfg, mesh)
    assert plan.placement.any_optim and "offload auto: chose" in plan.placement_report
    assert device_need(plan.placement, cfg, plan.param_shapes, plan.specs, plan.mesh_shape, platform(plan.mesh))["total"] <= limit
    cfg.offload.device_memory_limit = "1KB"
    with pytest.raises(ConfigError, match="nothing fits"):
        make_plan(cfg, mesh)


@pytest.mark.parametrize("policy", ["auto", "static"])
def test_a_refusal_suggests_only_changes_not_already_set(policy):
    """ZeRO-3 with full remat, refused: no 'higher zero_stage', no 'model.remat=full', and a budget
    of one KiB shown as one KiB."""
    cfg = _cfg(Z3, "bf16")
    cfg.model.remat = "full"
    cfg.offload.placement_policy = policy
    cfg.offload.device_memory_limit = "1KiB"
    with pytest.raises(ConfigError) as e:
        make_plan(cfg, make_mesh(cfg.parallel))
    msg = str(e.value)
    assert "1.00 KiB" in msg and "0.00" not in msg
    assert "use more devices or a smaller microbatch (training.gradient_accumulation_steps)" in msg
    assert "zero_stage=" not in msg and "remat" not in msg
    cfg.parallel.zero_stage, cfg.model.remat = 2, "selective"
    with pytest.raises(ConfigError, match=r"parallel.zero_stage=3, model.remat=full or a smaller microbatch"):
        make_plan(cfg, make_mesh(cfg.parallel))


def test_main_job_trains_under_auto_placement(tmp_path):
    """A simulated device budget below the run's need: auto picks fractions, the dry run shows the
    plan, and training's val loss falls as without offload."""
    small = ["model.num_layers=2", "model.hidden_size=64", "model.intermediate_size=128", "training.seq_len=32",
             "training.batch_size=16", "training.eval_batches=2", "training.sample_tokens=0",
             "data.max_corpus_bytes=200000", "logging.progress_bar=false", "training.eval_every=0",
             "training.max_steps=20", "parallel.zero_stage=3", "parallel.tensor_parallel_size=1",
             f"logging.run_dir={tmp_path}/run"]
    cfg = load_config(os.path.join(ROOT, "configs/llama_tiny.yaml"), small)
    plan = make_plan(cfg, make_mesh(cfg.parallel))
    need = device_need(plan.placement, cfg, plan.param_shapes, plan.specs, plan.mesh_shape, platform(plan.mesh))
    limit = [f"offload.device_memory_limit={int(need['total'] - 0.4 * need['state'])}"]
    # the dry run plans with the GPU's memory terms, the run here with the CPU's: a budget below each
    gpu = device_need(plan.placement, cfg, plan.param_shapes, plan.specs, plan.mesh_shape, "gpu")
    gpu_limit = [f"offload.device_memory_limit={int(gpu['total'] - 0.4 * gpu['state'])}"]
    dry = subprocess.run([sys.executable, os.path.join(ROOT, "scripts/train.py"), "--config",
                          os.path.join(ROOT, "configs/llama_tiny.yaml"), "--dry-run", *small, *gpu_limit,
                          "offload.placement_policy=auto"], capture_output=True, text=True, timeout=120)
    assert dry.returncode == 0, dry.stderr
    assert "offload auto: chose offload_optim_frac=" in dry.stdout and "pinned host" in dry.stdout
    refused = subprocess.run([sys.executable, os.path.join(ROOT, "scripts/train.py"), "--config",
                              os.path.join(ROOT, "configs/llama_tiny.yaml"), "--dry-run", *small, *gpu_limit],
                             capture_output=True, text=True, timeout=120)
    assert refused.returncode == 1 and "short by" in refused.stdout, refused.stdout + refused.stderr
    with pytest.raises(ConfigError, match="short by"):
        train(load_config(os.path.join(ROOT, "configs/llama_tiny.yaml"), small + limit))
    out = train(load_config(os.path.join(ROOT, "configs/llama_tiny.yaml"), small + limit +
                            ["offload.placement_policy=auto"]))
    assert out["val_loss_end"] < out["val_loss_start"] - 0.3


def test_resume_across_offload_settings_is_bit_exact(tmp_path):
    """Save with offload on, resume with it off, and the reverse: the losses and master weights of
    the resumed steps equal the uninterrupted run's bit for bit (orbax writes and reads the
    host-resident arrays in place)."""
    on = dict(offload_optim_frac=1.0, offload_param_frac=1.0, optimizer_device="host")
    batches = random_batches(_cfg(Z3), 4)
    built = {}
    for name, off in (("off", {}), ("on", on)):
        cfg = _cfg(Z3, offload=off)
        plan = make_plan(cfg, make_mesh(cfg.parallel))
        tx = build_optimizer(cfg.training, plan)
        built[name] = (plan, init_state(plan, tx, key=jax.random.key(0)), make_train_step(plan, tx, lr_schedule(cfg.training)))

    def steps(name, state, xs):
        plan, _, fn = built[name]
        losses = []
        for x in xs:
            state, m = fn(state, {"inputs": jax.device_put(x[:, :-1], plan.batch_sharding),
                                  "targets": jax.device_put(x[:, 1:], plan.batch_sharding)})
            losses.append(float(m["loss"]))
        return state, losses

    fresh = {k: jax.tree.map(lambda x: x.copy(), v[1]) for k, v in built.items()}  # restore targets
    cm = {k: CheckpointManager(str(tmp_path / k)) for k in built}
    half, l_half = {}, {}
    for k in built:
        half[k], l_half[k] = steps(k, built[k][1], batches[:2])
        cm[k].save(2, half[k])
        cm[k].wait()
    assert l_half["on"] == l_half["off"]
    whole, l_rest = steps("off", half["off"], batches[2:])  # the uninterrupted run
    resumed_off, r_off = steps("off", cm["on"].restore(fresh["off"]), batches[2:])  # on -> off
    resumed_on, r_on = steps("on", cm["off"].restore(fresh["on"]), batches[2:])  # off -> on
    assert r_off == r_on == l_rest
    _same(resumed_off.master, whole.master)
    _same(resumed_on.master, whole.master)
    assert _kinds(resumed_on.master) == {HOST} and _kinds(resumed_on.params) == {HOST}
    assert _kinds(resumed_off.master) == {DEVICE}
    for c in cm.values():
        c.close()


def test_plugins_offload():
    cfg = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=128, max_position_embeddings=64)
    assert LowLevelZeroPlugin(stage=2, cpu_offload=True).offload.offload_optim_frac == 1.0
    for plugin in (GeminiPlugin(precision="bf16", offload_optim_frac=1.0, offload_param_frac=1.0),):
        booster = Booster(plugin=plugin)
        state, step = booster.boost(LlamaForCausalLM(cfg, rngs=nnx.Rngs(0)), optax.adamw(1e-3), batch_size=8)
        assert _kinds(state.master) == {HOST}
        x = np.random.default_rng(0).integers(0, cfg.vocab_size, (8, 17))
        state, m = step(state, booster.shard_batch({"inputs": x[:, :-1], "targets": x[:, 1:]}))
        assert np.isfinite(float(m["loss"])) and _kinds(state.master) == {HOST}
    with pytest.raises(ConfigError, match="placement_policy"):
        GeminiPlugin(placement_policy="cuda")


def test_bad_offload_values_are_refused():
    for bad, msg in [({"offload_param_frac": 0.5}, "needs parallel.zero_stage=3"),
                     ({"offload_optim_frac": -0.1}, r"must be in \[0, 1\]"),
                     ({"nvme_path": "/tmp/nvme"}, "offload_optim_frac is 0"),
                     ({"device_memory_limit": "lots"}, "expected a byte count"),
                     ({"placement_policy": "auto"}, "needs offload.device_memory_limit")]:
        with pytest.raises(ConfigError, match=msg):
            cfg = config_from_dict({"model": {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
                                              "num_key_value_heads": 2, "intermediate_size": 128},
                                    "parallel": {"data_parallel_size": 8, "zero_stage": 1}, "offload": bad})
            make_plan(cfg, make_mesh(cfg.parallel))

