"""A reward model's export: a causal LM of each family that transformers has a sequence-classification class
for (tests/integration/hf_zoo.py's tiny models) becomes a reward model as ``model.init_from`` makes one
(``lm_head`` dropped, ``score`` drawn from normal(0, initializer_range)); ``save_hf`` writes its
``*ForSequenceClassification``, which ``AutoModelForSequenceClassification.from_pretrained`` loads with no
missing or unexpected keys and whose scores of right-padded rows equal ours within 1e-5; ``load_hf`` reads
the folder back as the same params (``score`` included)."""
import dataclasses

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from hf_zoo import VOCAB, build  # noqa: E402
from tiny import assert_params_match  # noqa: E402

from jaxcolossal.config import ConfigError  # noqa: E402
from jaxcolossal.models import get_family  # noqa: E402
from jaxcolossal.models.hf_io import load_hf, save_hf  # noqa: E402
from jaxcolossal.models.score_head import SEQCLS_ARCHITECTURES, pooled_scores, with_score_params  # noqa: E402

PAD = 0

NAMES = ("llama3.2", "qwen2.5", "qwen3", "mistral-nemo", "mixtral", "phi4-mini", "olmo2", "gemma2", "gemma3",
         "deepseek-v3", "gpt-oss")
"""Zoo entries of every exported ``model_type`` with a sequence-classification class but GPT-2 (not in the zoo)."""


def padded_rows(b=4, t=16, seed=0):
    """int32 ``[b, t]`` tokens in [2, VOCAB), right-padded with ``PAD`` at mixed lengths (one row unpadded)."""
    rng = np.random.default_rng(seed)
    x = rng.integers(2, VOCAB, (b, t)).astype(np.int32)
    for r, n in enumerate([t, 5, 11, 1][:b]):
        x[r, n:] = PAD
    return x


def ours(cfg, params, x):
    """Our scores ``[b]``: the family's hidden states pooled at the last non-pad token through the score head."""
    h = get_family(cfg).hidden_states(params, jnp.asarray(x), cfg)
    return np.asarray(pooled_scores(h, params["score"], jnp.asarray(x), PAD))[:, 0]


@pytest.mark.parametrize("name", NAMES)
def test_export_loads_as_sequence_classification_with_equal_scores(name, tmp_path):
    build(name).save_pretrained(tmp_path / "lm")
    cfg, params = load_hf(tmp_path / "lm")
    cfg = dataclasses.replace(cfg, num_labels=1)
    params = jax.tree.map(np.asarray, with_score_params(params, cfg, jax.random.key(0)))
    assert "lm_head" not in params and params["score"].shape == (cfg.hidden_size, 1)
    save_hf(tmp_path / "rm", cfg, params, special_tokens={"pad_token_id": PAD})
    model, info = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "rm",
                                                                                    output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert type(model).__name__ in SEQCLS_ARCHITECTURES.values() and model.config.num_labels == 1
    x = padded_rows()
    with torch.no_grad():
        want = model.float().eval()(torch.from_numpy(x.astype(np.int64))).logits[:, 0].numpy()
    got = ours(cfg, params, x)
    diff = float(np.max(np.abs(got - want)))
    print(f"\n{name}: {type(model).__name__}, max |score diff| {diff:.1e} (scores up to {np.max(np.abs(want)):.3g})")
    assert diff <= 1e-5 * max(1.0, float(np.max(np.abs(want))))
    cfg2, back = load_hf(tmp_path / "rm")
    assert cfg2.num_labels == 1 and "lm_head" not in back
    assert_params_match(back, params)


def test_a_score_head_export_needs_a_pad_id(tmp_path):
    build("llama3.2").save_pretrained(tmp_path / "lm")
    cfg, params = load_hf(tmp_path / "lm")
    cfg = dataclasses.replace(cfg, num_labels=1)
    with pytest.raises(ConfigError, match="needs pad_token_id"):
        save_hf(tmp_path / "rm", cfg, with_score_params(params, cfg, jax.random.key(0)))
