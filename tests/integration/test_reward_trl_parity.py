"""Reward-model training against TRL at TRL's own defaults: a tiny ``LlamaForSequenceClassification``
(``num_labels=1``, ``pad_token_id`` 0) built and saved by transformers and loaded as ours; the same
right-padded preference pairs. For each case our reward objective's loss, TRL's five metrics and every
gradient tensor equal those of TRL 1.16's own ``RewardTrainer.compute_loss`` within 1e-4 relative in fp32.

TRL runs on a stand-in trainer (no dataset, tokenizer or accelerator launch) whose ``args`` is a real
``trl.RewardConfig(output_dir=..., use_cpu=True, **case)``; the batch is what TRL's own
``DataCollatorForPreference`` makes of the pairs (``[chosen; rejected]`` halves, right-padded, with the
``margin`` column when the pairs have one). Ours is configured from the same ``case`` dict (our
``posttrain`` key has TRL's name); nothing is set on either side to match the other."""

from collections import defaultdict
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")

from tiny import in_order_loader_metrics  # noqa: E402
from trl import RewardConfig, RewardTrainer  # noqa: E402
from trl.trainer.reward_trainer import DataCollatorForPreference  # noqa: E402

from jaxcolossal.config import config_from_dict  # noqa: E402
from jaxcolossal.data.preference import PreferenceData  # noqa: E402
from jaxcolossal.models import get_family  # noqa: E402
from jaxcolossal.models.hf_io import hf_tensors, load_hf  # noqa: E402
from jaxcolossal.posttrain.reward import REWARD_METRICS, Reward  # noqa: E402

VOCAB, T, PAIRS, PAD = 128, 20, 4, 0

CASES = {"defaults": ({}, False), "margin": ({}, True), "center": ({"center_rewards_coefficient": 0.01}, False)}
"""Each case: the ``RewardConfig`` keywords it changes from TRL's defaults (and the same keys of ours), and
whether the pairs carry a ``margin``."""


def tiny_reward_model(seed: int, vocab: int = VOCAB, positions: int = 64) -> "transformers.LlamaForSequenceClassification":
    """tests/integration/hf_tiny.py's tiny LLaMA as a ``LlamaForSequenceClassification`` (``num_labels=1``,
    ``pad_token_id`` 0), its weights spread from HF's near-flat init so that the rewards differ."""
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=positions,
                                   rms_norm_eps=1e-5, tie_word_embeddings=False, attn_implementation="eager",
                                   num_labels=1, pad_token_id=PAD)
    model = transformers.LlamaForSequenceClassification(cfg).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(torch.randn_like(p) * (0.05 if "norm" in name else 0.2))
    return model


def _examples(with_margin: bool) -> list[dict]:
    """``PAIRS`` tokenized pairs (``chosen_ids``/``rejected_ids`` of mixed lengths, no pad id inside), with a
    ``margin`` each when asked."""
    rng = np.random.default_rng(0)
    out = []
    for i in range(PAIRS):
        ex = {k: rng.integers(1, VOCAB, rng.integers(5, T)).tolist() for k in ("chosen_ids", "rejected_ids")}
        if with_margin:
            ex["margin"] = float(rng.uniform(-1.0, 2.0))
        out.append(ex)
    return out


class _Accel:
    device = torch.device("cpu")

    def gather(self, x):
        return x

    gather_for_metrics = gather


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("reward_parity")
    model = tiny_reward_model(0)
    model.save_pretrained(str(tmp / "rm"))
    cfg_m, params = load_hf(tmp / "rm")
    return SimpleNamespace(tmp=tmp, model=model, cfg_m=cfg_m, params=params)


def _trl(w, case, examples):
    """TRL's loss, logged metrics and gradient (HF names) at ``RewardConfig(**case)`` on the collated pairs."""
    args = RewardConfig(output_dir=str(w.tmp / "trl"), use_cpu=True, **case)  # use_cpu: no GPU here
    fake = SimpleNamespace(args=args, model=w.model.train(), accelerator=_Accel(), _total_train_tokens=0,
                           _tp_size=1, _metrics={"train": defaultdict(list), "eval": defaultdict(list)})
    inputs = DataCollatorForPreference(pad_token_id=PAD)(examples)
    w.model.zero_grad()
    loss = RewardTrainer.compute_loss(fake, w.model, inputs)
    loss.backward()
    grads = {n: p.grad.numpy().copy() for n, p in w.model.named_parameters()}
    return float(loss), {k: v[-1] for k, v in fake._metrics["train"].items()}, grads


def _ours(w, case, examples):
    """Our loss, metrics and gradient (HF names) on the same pairs, interleaved and padded with 0."""
    cfg = config_from_dict({"training": {"objective": "reward", "seq_len": T},
                            "data": {"format": "preference", "corpus": "pairs.jsonl"},  # a name: nothing is read
                            "posttrain": dict(case)})
    assert cfg.model.num_labels == 1 and w.cfg_m.num_labels == 1
    obj = Reward(get_family(w.cfg_m), cfg)
    rows = np.full((2 * PAIRS, T), PAD, np.int32)
    for i, ex in enumerate(examples):
        rows[2 * i, : len(ex["chosen_ids"])], rows[2 * i + 1, : len(ex["rejected_ids"])] = ex["chosen_ids"], \
            ex["rejected_ids"]
    margin = np.repeat(np.asarray([ex.get("margin", 0.0) for ex in examples], np.float32), 2)
    margin = jnp.asarray(np.broadcast_to(margin[:, None], rows.shape))

    def f(p):
        s, stats = obj(p, jnp.asarray(rows), jnp.asarray(rows), w.cfg_m, lambda x, a: x, False,
                       mask=jnp.ones(rows.shape, jnp.float32), margin=margin)
        return s / PAIRS, stats

    (loss, stats), g = jax.value_and_grad(f, has_aux=True)(w.params)
    metrics = {k: float(v) for k, v in obj.metrics(stats, jnp.float32(PAIRS)).items()}
    return float(loss), metrics | _loader_metrics(rows, examples), hf_tensors(g, w.cfg_m)


def _loader_metrics(rows, examples) -> dict:
    """The training loader's metrics after step 0 (:meth:`PairLoader.step_metrics`; the reward loader's base)
    when that step draws the test's pairs in order, each row's length recorded as :mod:`.preference` records it."""
    lengths = {k: np.asarray([len(ex[f"{k}_ids"]) for ex in examples]) for k in ("chosen", "rejected")}
    masks = np.zeros((PAIRS, T - 1), np.float32)
    data = PreferenceData(rows[0::2], rows[1::2], masks, masks, chosen_lengths=lengths["chosen"],
                          rejected_lengths=lengths["rejected"])
    return in_order_loader_metrics(data, PAIRS)


def _rel(a, b):
    return abs(a - b) / max(abs(b), 1e-12)


@pytest.mark.parametrize("name", list(CASES))
def test_reward_equals_trl_at_its_defaults(world, name):
    case, with_margin = CASES[name]
    examples = _examples(with_margin)
    t_loss, t_metrics, t_grads = _trl(world, case, examples)
    o_loss, o_metrics, o_grads = _ours(world, case, examples)
    assert set(t_metrics) == set(REWARD_METRICS) | {"num_tokens"} == set(o_metrics), sorted(t_metrics)
    assert set(o_grads) == set(t_grads), sorted(set(o_grads) ^ set(t_grads))
    assert _rel(o_loss, t_loss) < 1e-4, (o_loss, t_loss)
    for k in t_metrics:  # a metric near 0 is held to 1e-6 absolute instead
        assert _rel(o_metrics[k], t_metrics[k]) < 1e-4 or abs(o_metrics[k] - t_metrics[k]) < 1e-6, (k, o_metrics,
                                                                                                      t_metrics)
    g_worst = max(float(np.linalg.norm(np.asarray(o_grads[n], np.float64) - want) / np.linalg.norm(want))
                  for n, want in t_grads.items())
    m_worst = max(_rel(o_metrics[k], t_metrics[k]) for k in REWARD_METRICS if abs(t_metrics[k]) > 1e-6)
    print(f"\n{name}: loss {o_loss:.6g} vs TRL {t_loss:.6g} (rel {_rel(o_loss, t_loss):.1e}); worst metric rel "
          f"{m_worst:.1e}; worst per-tensor gradient rel {g_worst:.1e}")
    assert g_worst < 1e-4
