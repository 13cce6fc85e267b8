"""The same seed gives the same initial weights on every mesh layout.

A run that is restarted on another layout (more data-parallel ranks, a ZeRO stage, tensor or
pipeline parallelism, bf16) or with another vocabulary padding must start from the same model.
Each layout's initial state is gathered to the host, its vocabulary padding stripped, and
compared bit for bit with a single-device run that has no padding; the padded embedding rows
and LM-head columns must be zero.

The vocabulary (100 tokens) with ``vocab_pad_multiple=8`` pads to 104 rows with tp=1, 112 with
tp=2 and 128 with tp=4, so tensor parallelism changes the padded shape; with
``vocab_pad_multiple=1`` and tp=2 it is not padded but still split over tp.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

from jaxcolossal.config import config_from_dict
from jaxcolossal.parallel.mesh import make_mesh
from jaxcolossal.train.optimizer import build_optimizer
from jaxcolossal.train.state import init_state, make_plan

SEED = 1234
VOCAB = 100

# llama keeps grouped-query attention (8 heads, 4 kv heads) and untied embeddings; gpt2 ties
# its LM head to wte, as GPT-2 does. Both divide by tp=4.
MODELS = {
    "llama": dict(type="llama", num_layers=2, hidden_size=64, num_attention_heads=8, num_key_value_heads=4,
                  intermediate_size=128, max_position_embeddings=64, vocab_size=VOCAB),
    "gpt2": dict(type="gpt2", num_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=4,
                 intermediate_size=128, max_position_embeddings=64, vocab_size=VOCAB, tie_word_embeddings=True),
}
EMBED = {"llama": "embed_tokens", "gpt2": "wte"}
TRAINING = dict(batch_size=16, seq_len=32, learning_rate=1e-3, warmup_steps=1, max_steps=10)

# name: (parallel section, precision or None, number of devices, vocab_pad_multiple, padded vocabulary)
LAYOUTS = {
    "one_device_padded": ({"data_parallel_size": 1}, None, 1, 8, 104),
    "bf16_dp8_zero1": ({"data_parallel_size": 8, "zero_stage": 1}, "bf16", 8, 8, 104),
    "dp8_zero3": ({"data_parallel_size": 8, "zero_stage": 3}, None, 8, 8, 104),
    "tp2_dp4_zero1_unpadded": ({"tensor_parallel_size": 2, "data_parallel_size": 4, "zero_stage": 1}, None, 8, 1, 100),
    "bf16_tp4_dp2_zero3": ({"tensor_parallel_size": 4, "data_parallel_size": 2, "zero_stage": 3}, "bf16", 8, 8, 128),
    "pp2_tp2_dp2": ({"pipeline_parallel_size": 2, "tensor_parallel_size": 2, "data_parallel_size": 2}, None, 8, 8, 112),
}


def _initial_state(family: str, parallel: dict, precision: str | None, n_devices: int, pad_multiple: int):
    raw = {"model": {**MODELS[family], "vocab_pad_multiple": pad_multiple}, "training": TRAINING,
           "parallel": parallel}
    if precision:
        raw["precision"] = {precision: True}
    cfg = config_from_dict(raw)
    plan = make_plan(cfg, make_mesh(cfg.parallel, jax.devices()[:n_devices]))
    state = init_state(plan, build_optimizer(cfg.training, plan), key=jax.random.key(SEED))
    return plan, state


@functools.lru_cache(maxsize=None)
def _reference(family: str) -> dict:
    """fp32 params of the single-device run without vocabulary padding, on the host."""
    plan, state = _initial_state(family, {"data_parallel_size": 1}, None, 1, pad_multiple=1)
    assert plan.vocab == VOCAB
    return jax.device_get(state.params)


def _strip_vocab_padding(params: dict, family: str) -> tuple[dict, list[np.ndarray]]:
    """(params with the vocabulary cut to ``VOCAB``, the padded rows/columns that were cut)."""
    params = dict(params)
    emb = EMBED[family]
    pads = [params[emb][VOCAB:]]
    params[emb] = params[emb][:VOCAB]
    if "lm_head" in params:
        pads.append(params["lm_head"][:, VOCAB:])
        params["lm_head"] = params["lm_head"][:, :VOCAB]
    return params, pads


def _assert_same_weights(got: dict, want: dict, family: str, what: str, cast=None) -> None:
    got, pads = _strip_vocab_padding(got, family)
    got_leaves = jax.tree_util.tree_leaves_with_path(got)
    want_leaves = jax.tree_util.tree_leaves_with_path(want)
    assert [p for p, _ in got_leaves] == [p for p, _ in want_leaves]
    for (path, g), (_, w) in zip(got_leaves, want_leaves):
        w = np.asarray(w if cast is None else w.astype(cast))
        assert g.dtype == w.dtype, (what, jax.tree_util.keystr(path), g.dtype, w.dtype)
        np.testing.assert_array_equal(g, w, err_msg=f"{what} {jax.tree_util.keystr(path)} differs from the "
                                                    "single-device unpadded initialisation")
    for pad in pads:
        np.testing.assert_array_equal(np.asarray(pad, np.float32), 0.0, err_msg=f"{what}: padded vocabulary not zero")


# every layout for llama; gpt2 (tied head, wte) on the ones that change the padding or the stage split
CASES = [("llama", name) for name in LAYOUTS] + \
    [("gpt2", name) for name in ("one_device_padded", "bf16_tp4_dp2_zero3", "pp2_tp2_dp2")]


@pytest.mark.parametrize("family,layout", CASES, ids=[f"{f}-{n}" for f, n in CASES])
def test_same_seed_same_initial_weights_on_every_layout(family, layout):
    parallel, precision, n_devices, pad_multiple, padded = LAYOUTS[layout]
    want = _reference(family)
    plan, state = _initial_state(family, parallel, precision, n_devices, pad_multiple)
    assert plan.vocab == padded
    if plan.mixed:  # the fp32 master is the model; the compute params are its cast
        _assert_same_weights(jax.device_get(state.master), want, family, f"{layout} master")
        _assert_same_weights(jax.device_get(state.params), want, family, f"{layout} params",
                             cast=plan.compute_dtype)
    else:
        assert state.master is None
        _assert_same_weights(jax.device_get(state.params), want, family, f"{layout} params")
