"""The pipeline's forward for an objective (:func:`jaxcolossal.parallel.pipeline_executor.make_pipeline_hidden`):
on pp 2 × dp 4, left-padded rows with their segment ids and positions (GRPO's layout), the final-norm hidden
states and the gradient of a function of them equal the family's plain forward on one device."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from tiny import TINY_MODEL, TINY_TRAINING

from jaxcolossal.config import config_from_dict
from jaxcolossal.models import get_family
from jaxcolossal.models.layers.logprobs import no_shard
from jaxcolossal.parallel.mesh import DATA_AXES, make_mesh
from jaxcolossal.parallel.pipeline_executor import make_pipeline_hidden
from jaxcolossal.train.state import make_plan


def _rows(b: int, t: int, vocab: int):
    """Left-padded rows: tokens, segment ids (0 on the pads) and positions from each row's first real token."""
    rng = np.random.default_rng(0)
    pads = rng.integers(0, t // 2, b)
    seg = (np.arange(t)[None] >= pads[:, None]).astype(np.int32)
    pos = np.maximum(np.arange(t)[None] - pads[:, None], 0).astype(np.int32)
    tokens = np.where(seg == 1, rng.integers(1, vocab, (b, t)), 0).astype(np.int32)
    return tokens, seg, pos


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_pipeline_hidden_equals_the_plain_forward(family):
    heads = {"num_key_value_heads": TINY_MODEL["num_attention_heads"]} if family == "gpt2" else {}
    cfg = config_from_dict({"model": {**TINY_MODEL, "type": family, "num_layers": 4, **heads},
                            "training": {**TINY_TRAINING, "gradient_accumulation_steps": 2},
                            "parallel": {"pipeline_parallel_size": 2, "data_parallel_size": 4,
                                         "pipeline_schedule": "gpipe", "num_microbatches": 2}})
    plan = make_plan(cfg, make_mesh(cfg.parallel))
    fam = get_family(cfg.model)
    params = fam.init_params(cfg.model, jax.random.key(0), 1)
    tokens, seg, pos = _rows(16, 12, cfg.model.vocab_size)
    weight = jnp.asarray(np.random.default_rng(1).normal(size=(16, 12, cfg.model.hidden_size)), jnp.float32)
    hidden = make_pipeline_hidden(plan)
    rows = NamedSharding(plan.mesh, P(DATA_AXES))

    def piped(p):
        x = hidden(p, *(jax.device_put(a, rows) for a in (tokens,)), None, jax.device_put(seg, rows),
                   jax.device_put(pos, rows))
        h = fam.final_norm(p, x, cfg.model)
        return jnp.sum(h * seg[..., None] * weight), h

    def plain(p):
        h = fam.hidden_states(p, tokens, cfg.model, no_shard, False, seg, pos)
        return jnp.sum(h * seg[..., None] * weight), h

    (v_pp, h_pp), g_pp = jax.jit(jax.value_and_grad(piped, has_aux=True))(params)
    (v_1, h_1), g_1 = jax.jit(jax.value_and_grad(plain, has_aux=True))(params)
    real = seg == 1
    np.testing.assert_allclose(np.asarray(h_pp)[real], np.asarray(h_1)[real], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(float(v_pp), float(v_1), rtol=1e-5)
    # per leaf, relative to the leaf (GPT-2's key bias has a zero gradient: softmax ignores a shift of every key)
    flat_pp, flat_1 = jax.tree_util.tree_leaves_with_path(jax.device_get(g_pp)), jax.tree.leaves(jax.device_get(g_1))
    for (path, a), b in zip(flat_pp, flat_1):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert np.linalg.norm(a - b) <= 1e-5 * np.linalg.norm(b) + 1e-6, jax.tree_util.keystr(path)
