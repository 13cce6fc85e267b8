"""DPO against TRL: a tiny LLaMA (policy) and another (reference) saved by transformers, the same
preference pairs; our DPO objective's loss, TRL's six metrics and the policy gradient equal those of
TRL's own ``DPOTrainer._compute_loss`` (trl 1.16, its fused LM head patched in as ``DPOTrainer.__init__``
does, called on a stand-in trainer so that no dataset, tokenizer or accelerator launch is needed),
within 1e-4 relative in fp32, for the sigmoid and IPO losses."""

from collections import defaultdict
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")

from hf_tiny import tiny_llama  # noqa: E402
from trl import DPOTrainer  # noqa: E402
from trl.trainer.utils import add_fused_lm_head  # noqa: E402

from jaxcolossal.config import config_from_dict  # noqa: E402
from jaxcolossal.models import get_family  # noqa: E402
from jaxcolossal.models.hf_io import load_hf  # noqa: E402
from jaxcolossal.posttrain.dpo import DPO_METRICS, Dpo  # noqa: E402

VOCAB, T, PAIRS, BETA = 128, 24, 4, 0.3


def _llama(seed):
    return tiny_llama(seed, VOCAB)


def _pairs():
    """Right-padded rows [2P, T] (TRL's [chosen; rejected] halves) and their completion masks."""
    rng = np.random.default_rng(0)
    ids, comp = np.zeros((2 * PAIRS, T), np.int64), np.zeros((2 * PAIRS, T), np.int64)
    for r in range(2 * PAIRS):
        p, c = rng.integers(3, 8), rng.integers(4, T - 8)
        ids[r, : p + c] = rng.integers(1, VOCAB, p + c)
        comp[r, p: p + c] = 1
    return ids, comp


class _Accel:
    device = torch.device("cpu")

    def gather(self, x):
        return x

    gather_for_metrics = gather

    def unwrap_model(self, m):
        return m


def _trl(policy, ref, ids, comp, loss_type):
    """TRL's loss, metrics and gradient (HF names)."""
    add_fused_lm_head(policy, outputs=("log_probs", "entropy", "mean_logits", "is_top1"))
    add_fused_lm_head(ref)
    fake = SimpleNamespace(model=policy.train(), ref_model=ref.eval(), accelerator=_Accel(), aux_loss_enabled=False,
                           ld_alpha=None, precompute_ref_logps=False, f_divergence_type="reverse_kl",
                           loss_types=[loss_type], loss_weights=[1.0], beta=BETA, label_smoothing=0.0,
                           _metrics={"train": defaultdict(list), "eval": defaultdict(list)}, _total_train_tokens=0,
                           _tp_size=1, use_weighting=False, rpo_alpha=None, args=SimpleNamespace(gradient_checkpointing_kwargs=None))
    inputs = {"input_ids": torch.from_numpy(ids), "attention_mask": torch.from_numpy((ids > 0) | (comp > 0)).long(),
              "completion_mask": torch.from_numpy(comp)}
    policy.zero_grad()
    loss = DPOTrainer._compute_loss(fake, policy, inputs, return_outputs=False)
    loss.backward()
    grads = {n: p.grad.numpy().copy() for n, p in policy.named_parameters()}
    return float(loss), {k: fake._metrics["train"][k][-1] for k in DPO_METRICS}, grads


def _ours(pol_dir, ref_dir, ids, comp, loss_type):
    cfg_m, params = load_hf(pol_dir)
    _, ref = load_hf(ref_dir)
    cfg = config_from_dict({"model": {}, "training": {"objective": "dpo", "seq_len": T - 1},
                            "data": {"format": "preference", "corpus": "pairs.jsonl"},  # a name: nothing is read
                            "posttrain": {"beta": BETA, "loss_type": loss_type}})
    obj = Dpo(get_family(cfg_m), cfg)
    order = np.stack([np.arange(PAIRS), np.arange(PAIRS) + PAIRS], 1).reshape(-1)  # interleave the pairs
    rows, mask = jnp.asarray(ids[order], jnp.int32), jnp.asarray(comp[order][:, 1:], jnp.float32)

    def f(p):
        s, stats = obj(p, rows[:, :-1], rows[:, 1:], cfg_m, mask=mask, shard=lambda x, a: x, vocab_parallel=False,
                       reference=ref)
        return s / PAIRS, stats
    (loss, stats), g = jax.value_and_grad(f, has_aux=True)(params)
    return float(loss), {k: float(v) / PAIRS for k, v in stats.items()}, get_family(cfg_m).params_to_hf(g, cfg_m)


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_dpo_equals_trl(tmp_path, loss_type):
    policy, ref = _llama(0), _llama(1)
    policy.save_pretrained(str(tmp_path / "pol"))
    ref.save_pretrained(str(tmp_path / "ref"))
    ids, comp = _pairs()
    t_loss, t_metrics, t_grads = _trl(policy, ref, ids, comp, loss_type)
    o_loss, o_metrics, o_grads = _ours(tmp_path / "pol", tmp_path / "ref", ids, comp, loss_type)
    rel = lambda a, b: abs(a - b) / max(abs(b), 1e-12)  # noqa: E731
    assert rel(o_loss, t_loss) < 1e-4, (o_loss, t_loss)
    for k in DPO_METRICS:
        assert rel(o_metrics[k], t_metrics[k]) < 1e-4 or abs(o_metrics[k] - t_metrics[k]) < 1e-6, (k, o_metrics, t_metrics)
    worst = 0.0
    for name, want in t_grads.items():
        got = np.asarray(o_grads[name], np.float64)
        worst = max(worst, float(np.linalg.norm(got - want) / np.linalg.norm(want)))
    m_worst = max(rel(o_metrics[k], t_metrics[k]) for k in DPO_METRICS if abs(t_metrics[k]) > 1e-6)
    print(f"{loss_type}: loss {o_loss:.6g} vs TRL {t_loss:.6g} (rel {rel(o_loss, t_loss):.1e}); worst metric rel "
          f"{m_worst:.1e}; worst per-tensor gradient relative error {worst:.2e}; {o_metrics}")
    assert worst < 1e-4
