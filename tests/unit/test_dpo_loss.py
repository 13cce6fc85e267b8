"""DPO's loss variants and the config's refusals (jaxcolossal.posttrain.dpo, jaxcolossal.config.objective_checks)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcolossal.config import ConfigError, config_from_dict, field_docs
from jaxcolossal.config.derived import dpo_loss_types, dpo_loss_weights
from jaxcolossal.config.schema import DPO_ONLY_KEYS, GRPO_ONLY_KEYS
from jaxcolossal.posttrain.dpo import LOSSES, PairTerms, dpo_loss


def _terms(**over):
    c, r, rc, rr = (jnp.array(v, jnp.float32) for v in ([-3.0, -5.0], [-4.0, -2.0], [-3.5, -4.0], [-3.0, -3.0]))
    return PairTerms(c, r, rc, rr, jnp.array([2.0, 4.0]), jnp.array([3.0, 1.0]), **{"beta": 0.5, **over})


def test_sigmoid_has_no_label_smoothing_and_the_metrics_are_trls():
    t = _terms(label_smoothing=0.2)  # read by robust/exo_pair/aot only (TRL 1.16): sigmoid is plain DPO
    loss, m = dpo_loss(t, ("sigmoid",))
    d = 0.5 * ((t.chosen - t.ref_chosen) - (t.rejected - t.ref_rejected))
    np.testing.assert_allclose(loss, -jax.nn.log_sigmoid(d), rtol=1e-6)
    np.testing.assert_allclose(m["rewards/margins"], d, rtol=1e-6)
    assert m["rewards/accuracies"].tolist() == [1.0, 0.0]


def test_ipo_averages_over_response_tokens():
    t = PairTerms(*(jnp.array([v]) for v in (-6.0, -9.0, -4.0, -3.0, 2.0, 3.0)), beta=0.25)
    loss, _ = dpo_loss(t, ("ipo",))
    np.testing.assert_allclose(loss, [((-2.0 / 2) - (-6.0 / 3) - 2.0) ** 2], rtol=1e-6)


def test_weighted_losses_sum_and_aot_sorts_over_the_pairs():
    t = _terms(label_smoothing=0.1)
    mix, _ = dpo_loss(t, ("sigmoid", "bco_pair"), (0.8, 0.2))
    np.testing.assert_allclose(mix, 0.8 * LOSSES["sigmoid"](t) + 0.2 * LOSSES["bco_pair"](t), rtol=1e-6)
    swapped = t._replace(chosen=t.chosen[::-1], rejected=t.rejected[::-1])  # the policy's pairs reordered only
    aot, _ = dpo_loss(t, ("aot",))
    np.testing.assert_allclose(jnp.sort(dpo_loss(swapped, ("aot",))[0]), jnp.sort(aot), rtol=1e-6)
    assert abs(float(dpo_loss(swapped, ("sigmoid",))[0].sum() - dpo_loss(t, ("sigmoid",))[0].sum())) > 0.1


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
    ({"posttrain__label_smoothing": 0.1}, "posttrain.label_smoothing=0.1 is read only by the loss types exo_pair, "
                                          "robust, aot, aot_unpaired, none of which posttrain.loss_type=auto lists"),
    ({"posttrain__loss_type": "ipo,hinge", "posttrain__label_smoothing": 0.1}, "none of which"),
    ({"posttrain__loss_type": "exo_pair"}, "exo_pair needs posttrain.label_smoothing > 0"),
    ({"posttrain__loss_type": "robust", "posttrain__label_smoothing": 0.5}, "must be in [0, 0.5)"),
    ({"posttrain__label_smoothing": 1.0, "posttrain__loss_type": "aot"}, "posttrain.label_smoothing=1"),
    ({"posttrain__loss_type": "sigmoid,dapo"}, "posttrain.loss_type=sigmoid,dapo: dapo is not a DPO loss"),
    ({"posttrain__loss_type": "sigmoid,"}, "(empty) is not a DPO loss"),
    ({"posttrain__loss_type": "sigmoid,sft", "posttrain__loss_weights": "1"}, "has 1 weights for 2 loss types"),
    ({"posttrain__loss_weights": "x"}, "posttrain.loss_weights='x': expected comma-separated numbers"),
    ({"posttrain__loss_weights": "inf"}, "each weight must be a finite number"),
    ({"posttrain__discopop_tau": 0.1}, "posttrain.discopop_tau=0.1 is read only by the discopop loss"),
    ({"posttrain__discopop_tau": 0.0, "posttrain__loss_type": "discopop"}, "posttrain.discopop_tau=0.0"),
    ({"parallel__pipeline_parallel_size": 2}, "runs GPipe's schedule (the objective's head is differentiated through "
                                              "the forward ticks): set parallel.pipeline_schedule=gpipe, not 1f1b"),
    ({"parallel__pipeline_parallel_size": 2, "parallel__pipeline_schedule": "gpipe"},
     "the objective's microbatches are the pipeline's 4; set training.gradient_accumulation_steps=4"),
    ({"parallel__pipeline_parallel_size": 2, "parallel__pipeline_schedule": "gpipe",
      "training__gradient_accumulation_steps": 4, "model__lora": {"rank": 4}, "posttrain__reference": "lora_base"},
     "does not run with LoRA"),
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
    assert dpo_loss_types(_cfg()) == ("sigmoid",) and dpo_loss_weights(_cfg()) == (1.0,)


def test_loss_type_is_trls_list_with_its_weights():
    """A YAML list or comma-separated names, with weights as a list or string (TRL's MPO example)."""
    listed = _cfg(posttrain__loss_type=["sigmoid", "bco_pair", "sft"], posttrain__loss_weights=[0.8, 0.2, 1.0])
    spelt = _cfg(posttrain__loss_type="sigmoid, bco_pair,sft", posttrain__loss_weights="0.8,0.2,1")
    for cfg in (listed, spelt):
        assert dpo_loss_types(cfg) == ("sigmoid", "bco_pair", "sft") and dpo_loss_weights(cfg) == (0.8, 0.2, 1.0)
    assert dpo_loss_weights(_cfg(posttrain__loss_type="ipo,hinge")) == (1.0, 1.0)
    eps = _cfg(posttrain__loss_type="exo_pair,aot", posttrain__label_smoothing=1e-3)
    assert eps.posttrain.label_smoothing == 1e-3


def test_dpo_keys_are_refused_in_a_grpo_run():
    raw = {"model": {}, "training": {"objective": "grpo", "batch_size": 8},
           "data": {"format": "prompts", "corpus": "x.jsonl"}}
    for key, value in (("loss_weights", "1"), ("discopop_tau", 0.1)):
        with pytest.raises(ConfigError, match=f"posttrain.{key}=.* is a DPO key"):
            config_from_dict({**raw, "posttrain": {key: value}})
    with pytest.raises(ConfigError, match="posttrain.loss_type=grpo,dapo is not a GRPO loss"):
        config_from_dict({**raw, "posttrain": {"loss_type": "grpo,dapo"}})
