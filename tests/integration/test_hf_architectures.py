"""Every Hugging Face architecture we read, against transformers on a tiny model it created and saved
with the real model's distinctive keys (tests/integration/hf_zoo.py):

* logits equal transformers' fp32 logits within 1e-5 of max |logit|, on one device and on tp 2 × fsdp 4
  (ZeRO-3: the params sharded over fsdp, gathered layer by layer), and for a mixture of experts on
  ep 2 × tp 2 (the experts split over ep, tokens exchanged all-to-all; ZeRO-1 over the data group of 4);
* batched greedy generation of left-padded prompts of mixed lengths is token-equal to ``generate``;
* ``save_hf`` writes a folder that ``AutoModelForCausalLM`` loads with no missing or unexpected keys
  and whose logits are equal.
"""
import dataclasses

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from hf_zoo import VOCAB, ZOO, build, logits  # noqa: E402
from tiny import assert_params_match, run_steps, tiny_config  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402

from jaxcolossal.config import config_from_dict, prefetches_weights  # noqa: E402
from jaxcolossal.generate import generate  # noqa: E402
from jaxcolossal.models import get_family  # noqa: E402
from jaxcolossal.models.hf_io import load_hf, read_special_tokens, save_hf  # noqa: E402
from jaxcolossal.parallel.mesh import make_mesh  # noqa: E402
from jaxcolossal.train.state import make_plan  # noqa: E402

REL = 1e-5
"""Logits within REL × max |logit| of transformers' (fp32 both)."""


def tokens(b=2, t=16, seed=0):
    return np.random.default_rng(seed).integers(2, VOCAB, (b, t)).astype(np.int32)


def rel_err(got, want):
    return float(np.max(np.abs(got[..., :VOCAB] - want)) / np.max(np.abs(want)))


@pytest.fixture(scope="module", params=sorted(ZOO))
def saved(request, tmp_path_factory):
    """``(name, transformers model, folder)`` of each zoo entry, saved once per module."""
    name = request.param
    model = build(name)
    path = tmp_path_factory.mktemp(name)
    model.save_pretrained(path)
    return name, model, path


def test_logits_one_device(saved):
    name, model, path = saved
    cfg, params = load_hf(path)
    x = tokens()
    got = np.asarray(get_family(cfg).forward(params, jnp.asarray(x), cfg))
    err = rel_err(got, logits(model, x))
    print(f"{name}: max |logit diff| / max |logit| = {err:.2e}")
    assert err < REL


def sharded_logits(cfg, params, x, parallel):
    """The family's forward under the training layout of ``parallel`` (params placed by the plan's specs)."""
    run = config_from_dict({"model": {**_model_dict(cfg)}, "training": {"batch_size": x.shape[0], "seq_len": x.shape[1]},
                            "parallel": parallel})
    plan = make_plan(run, make_mesh(run.parallel))
    specs = plan.specs.params
    placed = jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(plan.mesh, s)), params, specs)
    fwd = jax.jit(lambda p, t: plan.family.forward(p, t, run.model, plan.sharder, True))
    return np.asarray(fwd(placed, jax.device_put(x, plan.batch_sharding)))


def _model_dict(cfg):
    d = dataclasses.asdict(cfg)
    d.pop("lora")
    return d


def test_logits_tp2_fsdp4_zero3(saved):
    name, model, path = saved
    cfg, params = load_hf(path, tp=2)
    x = tokens(b=4)
    got = sharded_logits(cfg, params, x, {"data_parallel_size": 4, "tensor_parallel_size": 2, "zero_stage": 3})
    err = rel_err(got, logits(model, x))
    print(f"{name} tp2 x fsdp4 ZeRO-3: {err:.2e}")
    assert err < REL


def test_logits_ep2_tp2_experts(saved):
    name, model, path = saved
    cfg, params = load_hf(path, tp=2)
    if not cfg.moe:
        pytest.skip("dense: no experts to split")
    x = tokens(b=4)
    got = sharded_logits(cfg, params, x, {"data_parallel_size": 4, "expert_parallel_size": 2,
                                          "tensor_parallel_size": 2, "zero_stage": 1})
    err = rel_err(got, logits(model, x))
    print(f"{name} ep2 x tp2 ZeRO-1: {err:.2e}")
    assert err < REL


def test_export_loads_clean_with_equal_logits(saved, tmp_path):
    name, model, path = saved
    cfg, params = load_hf(path)
    save_hf(tmp_path / "out", cfg, params, special_tokens=read_special_tokens(path))  # as convert_hf.py does
    back, info = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "out"), output_loading_info=True, attn_implementation="eager")
    for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
        assert not info.get(k), (k, info[k])
    assert type(back).__name__ == type(model).__name__
    x = tokens()
    assert rel_err(logits(back.eval(), x), logits(model, x)) < REL


def test_greedy_generation_equals_transformers(saved):
    """Left-padded prompts of 3, 7 and 12 tokens, 10 new tokens, greedy; no eos (eos stops: test_generate_hf).
    The reference is loaded afresh: transformers' dynamic RoPE keeps the longest sequence its module has
    seen (``max_seq_len_cached``), so the earlier tests' 16-token forwards would change its frequencies."""
    name, _, path = saved
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), attn_implementation="eager").eval()
    cfg, params = load_hf(path)
    prompts = [list(tokens(1, n, seed=n)[0]) for n in (3, 7, 12)]
    ours = generate(get_family(cfg), cfg, params, prompts, 10).tokens
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=10,
                             min_new_tokens=10, eos_token_id=None, pad_token_id=0)
    np.testing.assert_array_equal(ours, out[:, width:].numpy())


def test_per_layer_windows_train_under_zero3_prefetch_as_on_one_device():
    """Sliding and full layers (per-layer windows carried by the layer scan) through ZeRO-3's prefetching
    scan (``parallel.overlap`` with ``remat=full``) over dp 4 × tp 2: 3 steps equal one device
    (:func:`tiny.assert_params_match`'s tolerance; loss and grad norm rtol 1e-5)."""
    model = {"sliding_window": 4, "layer_types": "sliding_attention,full_attention", "remat": "full"}
    one, m1, _ = run_steps(tiny_config(model=model), jax.devices()[:1])
    par, m8, plan = run_steps(tiny_config({"data_parallel_size": 4, "tensor_parallel_size": 2, "zero_stage": 3},
                                          model=model))
    assert prefetches_weights(plan.cfg)  # the prefetching scan, with the windows as per-layer constants
    for a, b in zip(m8, m1):
        np.testing.assert_allclose([a["loss"], a["grad_norm"]], [b["loss"], b["grad_norm"]], rtol=1e-5)
    assert_params_match(jax.device_get(par.params), jax.device_get(one.params))
