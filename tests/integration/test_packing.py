"""Packing with ``data.packing_mask``: a window holding several documents gives each document the
same per-token losses as running it alone (attention stays in the document, positions restart,
the target that crosses a boundary is masked), for LLaMA and GPT-2; and the main job trains packed.

Tolerance (fp32): per-token losses rtol 1e-5 / atol 1e-6.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxcolossal.config import ConfigError, config_from_dict, load_config
from jaxcolossal.data.loader import packing_fields
from jaxcolossal.models import get_family
from jaxcolossal.train.loop import train

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LENGTHS = (7, 12, 9)


def test_packing_fields():
    f = packing_fields([0, 7, 19], starts=[0, 5], seq_len=8)
    np.testing.assert_array_equal(f["segment_ids"][0], [0, 0, 0, 0, 0, 0, 0, 1])
    np.testing.assert_array_equal(f["positions"][0], [0, 1, 2, 3, 4, 5, 6, 0])
    np.testing.assert_array_equal(f["loss_mask"][0], [1, 1, 1, 1, 1, 1, 0, 1])  # target 7 starts doc 1
    np.testing.assert_array_equal(f["positions"][1], [5, 6, 0, 1, 2, 3, 4, 5])  # starts inside doc 0
    np.testing.assert_array_equal(f["segment_ids"][1], [0, 0, 1, 1, 1, 1, 1, 1])


def _per_token(family, params, cfg, tokens, **kw):
    logits = family.forward(params, jnp.asarray(tokens[None, :-1]), cfg, **kw)[0, :, : cfg.vocab_size]
    return np.asarray(optax.softmax_cross_entropy_with_integer_labels(logits, jnp.asarray(tokens[1:])))


@pytest.mark.parametrize("family_name", ["llama", "gpt2"])
def test_packed_documents_equal_documents_alone(family_name):
    extra = {"num_key_value_heads": 4} if family_name == "gpt2" else {}
    cfg = config_from_dict({"model": {"type": family_name, "num_layers": 2, "hidden_size": 64,
                                      "num_attention_heads": 4, "intermediate_size": 128,
                                      "max_position_embeddings": 64, **extra}, "training": {"seq_len": 32}}).model
    family = get_family(cfg)
    params = family.init_params(cfg, jax.random.key(0))
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 256, n).astype(np.int32) for n in LENGTHS]
    row = np.concatenate(docs)
    starts = np.cumsum([0, *LENGTHS[:-1]])
    f = packing_fields(starts, [0], len(row) - 1)
    packed = _per_token(family, params, cfg, row, segment_ids=jnp.asarray(f["segment_ids"]),
                        positions=jnp.asarray(f["positions"]))
    unpacked = _per_token(family, params, cfg, row)  # without the mask the documents leak into each other
    for d, (doc, s) in enumerate(zip(docs, starts)):
        alone = _per_token(family, params, cfg, doc)
        np.testing.assert_allclose(packed[s: s + len(doc) - 1], alone, rtol=1e-5, atol=1e-6, err_msg=f"doc {d}")
        assert d == 0 or not np.allclose(unpacked[s: s + len(doc) - 1], alone, rtol=1e-3)
    assert np.all(f["loss_mask"][0][starts[1:] - 1] == 0)  # the targets that cross a boundary


def test_packing_mask_config_checks():
    with pytest.raises(ConfigError, match="packing_mask=true needs model.attention_impl xla or flash"):
        config_from_dict({"data": {"packing_mask": True}, "model": {"attention_impl": "cudnn"}})


def test_main_job_trains_packed(tmp_path):
    cfg = load_config(os.path.join(ROOT, "configs/llama_tiny.yaml"), [
        "model.num_layers=2", "model.hidden_size=64", "model.intermediate_size=128", "training.seq_len=64",
        "training.batch_size=16", "training.eval_batches=2", "training.sample_tokens=0", "logging.progress_bar=false",
        "training.eval_every=0", "training.max_steps=12", "data.max_corpus_bytes=400000", "data.packing_mask=true",
        f"data.cache_dir={tmp_path}/cache", f"logging.run_dir={tmp_path}/run"])
    out = train(cfg)
    assert out["val_loss_end"] < out["val_loss_start"]
