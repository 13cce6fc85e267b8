"""DPO's loss variants and the config's refusals (jaxcolossal.posttrain.dpo, jaxcolossal.config.objective_checks)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcolossal.config import ConfigError, config_from_dict, field_docs
from jaxcolossal.config.schema import DPO_ONLY_KEYS, GRPO_ONLY_KEYS
from jaxcolossal.posttrain.dpo import dpo_loss


def test_sigmoid_label_smoothing_is_conservative_dpo():
    c, r, rc, rr = (jnp.array(v, jnp.float32) for v in ([-3.0, -5.0], [-4.0, -2.0], [-3.5, -4.0], [-3.0, -3.0]))
    ones = jnp.ones(2)
    eps, beta = 0.2, 0.5
    loss, m = dpo_loss(c, r, rc, rr, ones, ones, beta, "sigmoid", eps)
    d = beta * ((c - rc) - (r - rr))
    want = -(1 - eps) * jax.nn.log_sigmoid(d) - eps * jax.nn.log_sigmoid(-d)
    np.testing.assert_allclose(loss, want, rtol=1e-6)
    np.testing.assert_allclose(m["rewards/margins"], d, rtol=1e-6)
    assert m["rewards/accuracies"].tolist() == [1.0, 0.0]
    plain, _ = dpo_loss(c, r, rc, rr, ones, ones, beta, "sigmoid", 0.0)
    np.testing.assert_allclose(plain, -jax.nn.log_sigmoid(d), rtol=1e-6)


def test_ipo_averages_over_response_tokens():
    loss, _ = dpo_loss(jnp.array([-6.0]), jnp.array([-9.0]), jnp.array([-4.0]), jnp.array([-3.0]), jnp.array([2.0]),
                       jnp.array([3.0]), 0.25, "ipo")
    np.testing.assert_allclose(loss, [((-2.0 / 2) - (-6.0 / 3) - 2.0) ** 2], rtol=1e-6)


def _cfg(**over):
    raw = {"model": {}, "training": {"objective": "dpo"}, "data": {"format": "preference", "corpus": "x.jsonl"}}
    for key, v in over.items():
        sec, k = key.split("__")
        raw.setdefault(sec, {})[k] = v
    return config_from_dict(raw)


@pytest.mark.parametrize("over, words", [
    ({"posttrain__beta": 0.0}, "posttrain.beta=0.0: must be > 0"),
    ({"posttrain__beta": -1.0}, "posttrain.beta=-1.0"),
    ({"data__format": "chat"}, "training.objective=dpo with data.format=chat"),
    ({"posttrain__reference": "lora_base"}, "needs LoRA"),
    ({"posttrain__loss_type": "ipo", "posttrain__label_smoothing": 0.1}, "IPO has no label smoothing"),
    ({"parallel__pipeline_parallel_size": 2}, "does not run with parallel.pipeline_parallel_size > 1"),
    ({"posttrain__num_generations": 4}, "posttrain.num_generations=4 is a GRPO key, which a DPO run "
                                        "(training.objective=dpo) never reads: remove it"),
    ({"posttrain__reward_funcs": "format"}, "posttrain.reward_funcs='format' is a GRPO key"),
])
def test_refusals(over, words):
    with pytest.raises(ConfigError) as e:
        _cfg(**over)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_the_objective_only_keys_are_the_ones_their_docs_mark():
    """GRPO_ONLY_KEYS / DPO_ONLY_KEYS (refused in the other objective's run) are the posttrain keys whose
    docs start with "GRPO" / "DPO:"."""
    docs = {k.split(".", 1)[1]: d for k, d in field_docs().items() if k.startswith("posttrain.")}
    assert sorted(GRPO_ONLY_KEYS) == sorted(k for k, d in docs.items() if d.startswith("GRPO"))
    assert sorted(DPO_ONLY_KEYS) == sorted(k for k, d in docs.items() if d.startswith("DPO:"))


def test_valid_dpo_config():
    cfg = _cfg(posttrain__beta=0.5, posttrain__loss_type="ipo")
    assert cfg.training.objective == "dpo" and cfg.posttrain.beta == 0.5
