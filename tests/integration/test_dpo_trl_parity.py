"""DPO against TRL at TRL's own defaults: a tiny LLaMA (policy) and another (reference) saved by transformers,
the same preference pairs; for every one of trl 1.16's 15 DPO loss types (and the label-smoothing ones at
ε = 0.1, and MPO's weighted mix) our DPO objective's loss, every metric TRL logs but its running token count,
and every policy gradient tensor
equal those of TRL's own ``DPOTrainer._compute_loss`` within 1e-4 relative in fp32.

TRL runs on a stand-in trainer (no dataset, tokenizer or accelerator launch): its attributes come from a real
``trl.DPOConfig(output_dir=..., use_cpu=True, **case)`` through the very lines of ``DPOTrainer.__init__`` that derive them
(``self.beta = args.beta`` ... the ``exo_pair`` check, executed from TRL's source), and its fused LM head is
patched in as ``__init__`` does. Ours is configured from the same ``case`` dict (our ``posttrain`` keys have
TRL's names); nothing is set on either side to match the other.

``exo_pair`` at TRL's defaults (``label_smoothing=0``) cannot run under TRL's own code: its ``__init__`` raises
ValueError; :func:`test_exo_pair_at_trl_defaults_is_refused_by_both` checks that ours refuses it too."""

import inspect
import textwrap
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
from tiny import in_order_loader_metrics  # noqa: E402
from trl import DPOConfig, DPOTrainer  # noqa: E402
from trl.trainer import dpo_trainer as trl_dpo_module  # noqa: E402
from trl.trainer.utils import add_fused_lm_head  # noqa: E402

from jaxcolossal.config import ConfigError, config_from_dict  # noqa: E402
from jaxcolossal.config.derived import DPO_LOSS_TYPES  # noqa: E402
from jaxcolossal.data.preference import PreferenceData  # noqa: E402
from jaxcolossal.models import get_family  # noqa: E402
from jaxcolossal.models.hf_io import load_hf  # noqa: E402
from jaxcolossal.posttrain.dpo import DPO_METRICS, TOKEN_METRICS, Dpo  # noqa: E402

VOCAB, T, PAIRS = 128, 24, 4

LOADER_METRICS = ("num_tokens",)
"""What the loader logs beside the objective's metrics (:meth:`PairLoader.step_metrics`): TRL's running count
of the tokens trained on, here after the one step both take."""

CASES = {name: ({} if name == "sigmoid" else {"loss_type": [name]}) for name in DPO_LOSS_TYPES if name != "exo_pair"}
CASES.update({f"{name}-eps0.1": {"loss_type": [name], "label_smoothing": 0.1}
              for name in ("exo_pair", "robust", "aot", "aot_unpaired")})
CASES["mpo"] = {"loss_type": ["sigmoid", "bco_pair", "sft"], "loss_weights": [0.8, 0.2, 1.0]}
"""Each case: the ``DPOConfig`` keywords it changes from TRL's defaults (sigmoid: none), and the same keys of ours."""


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


def _init_derivation() -> str:
    """The lines of trl 1.16's ``DPOTrainer.__init__`` that turn ``args`` into the loss's attributes, from
    ``self.beta = args.beta`` up to the PEFT check after the ``exo_pair`` one, dedented to run on a stand-in."""
    lines = textwrap.dedent(inspect.getsource(DPOTrainer.__init__)).splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() == "self.beta = args.beta")
    end = next(i for i, line in enumerate(lines) if i > start and line.strip().startswith("if is_peft_model(model)"))
    block = textwrap.dedent("\n".join(lines[start:end]))
    assert "self.loss_weights = args.loss_weights or" in block and "exo_pair" in block, block
    return block


def _stand_in(args: DPOConfig, policy, ref) -> SimpleNamespace:
    """A stand-in ``DPOTrainer`` whose loss attributes ``DPOTrainer.__init__``'s own lines derive from ``args``."""
    fake = SimpleNamespace(args=args, model=policy.train(), ref_model=ref.eval(), accelerator=_Accel(),
                           aux_loss_enabled=False, _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
                           _total_train_tokens=0, _tp_size=1)
    exec(_init_derivation(), vars(trl_dpo_module), {"self": fake, "args": args, "model": policy})
    return fake


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """The two tiny LLaMAs (TRL's, with its fused heads), their saved folders loaded as ours, and the pairs."""
    tmp = tmp_path_factory.mktemp("dpo_parity")
    policy, ref = tiny_llama(0, VOCAB), tiny_llama(1, VOCAB)
    policy.save_pretrained(str(tmp / "pol"))
    ref.save_pretrained(str(tmp / "ref"))
    # the heads DPOTrainer.__init__ adds (use_weighting is False at TRL's defaults: no log_sum_sq_probs)
    add_fused_lm_head(policy, outputs=("log_probs", "entropy", "mean_logits", "is_top1"))
    add_fused_lm_head(ref)
    cfg_m, params = load_hf(tmp / "pol")
    _, ref_params = load_hf(tmp / "ref")
    return SimpleNamespace(tmp=tmp, policy=policy, ref=ref, cfg_m=cfg_m, params=params, ref_params=ref_params,
                           pairs=_pairs())


def _trl_config(w, case) -> DPOConfig:
    """TRL's ``DPOConfig`` at its defaults but ``case``'s keys. ``use_cpu``: this machine has no GPU, and the
    default ``bf16=True`` is refused without one; ``_compute_loss`` runs outside the Trainer's autocast, in fp32."""
    return DPOConfig(output_dir=str(w.tmp / "trl"), use_cpu=True, **case)


def _trl(w, case):
    """TRL's loss, logged metrics and gradient (HF names) at ``DPOConfig(**case)``."""
    fake = _stand_in(_trl_config(w, case), w.policy, w.ref)
    ids, comp = w.pairs
    inputs = {"input_ids": torch.from_numpy(ids), "attention_mask": torch.from_numpy((ids > 0) | (comp > 0)).long(),
              "completion_mask": torch.from_numpy(comp)}
    w.policy.zero_grad()
    loss = DPOTrainer._compute_loss(fake, w.policy, inputs, return_outputs=False)
    loss.backward()
    grads = {n: p.grad.numpy().copy() for n, p in w.policy.named_parameters()}
    return float(loss), {k: v[-1] for k, v in fake._metrics["train"].items()}, grads


def _config(case):
    return config_from_dict({"model": {}, "training": {"objective": "dpo", "seq_len": T - 1},
                             "data": {"format": "preference", "corpus": "pairs.jsonl"},  # a name: nothing is read
                             "posttrain": dict(case)})


def _ours(w, case):
    cfg = _config(case)
    obj = Dpo(get_family(w.cfg_m), cfg)
    ids, comp = w.pairs
    order = np.stack([np.arange(PAIRS), np.arange(PAIRS) + PAIRS], 1).reshape(-1)  # interleave the pairs
    rows, mask = jnp.asarray(ids[order], jnp.int32), jnp.asarray(comp[order][:, 1:], jnp.float32)

    def f(p):
        s, stats = obj(p, rows[:, :-1], rows[:, 1:], w.cfg_m, mask=mask, shard=lambda x, a: x, vocab_parallel=False,
                       reference=w.ref_params)
        return s / PAIRS, stats
    (loss, stats), g = jax.value_and_grad(f, has_aux=True)(w.params)
    metrics = {k: float(v) for k, v in obj.metrics(stats, jnp.float32(PAIRS)).items()}
    return float(loss), metrics | _loader_metrics(ids, comp), get_family(w.cfg_m).params_to_hf(g, w.cfg_m)


def _loader_metrics(ids, comp) -> dict:
    """The training loader's metrics after step 0 (:meth:`PairLoader.step_metrics`) when that step draws the
    test's pairs in order (the draw is the only thing replaced)."""
    data = PreferenceData(ids[:PAIRS], ids[PAIRS:], comp[:PAIRS, 1:], comp[PAIRS:, 1:])  # lengths from the masks
    return in_order_loader_metrics(data, PAIRS)


def _rel(a, b):
    return abs(a - b) / max(abs(b), 1e-12)


@pytest.mark.parametrize("name", list(CASES))
def test_dpo_equals_trl_at_its_defaults(world, name):
    case = CASES[name]
    t_loss, t_metrics, t_grads = _trl(world, case)
    o_loss, o_metrics, o_grads = _ours(world, case)
    assert set(t_metrics) == set(o_metrics), sorted(t_metrics)
    assert set(o_metrics) == set(DPO_METRICS + TOKEN_METRICS + LOADER_METRICS)
    assert _rel(o_loss, t_loss) < 1e-4, (o_loss, t_loss)
    for k in o_metrics:  # a metric near 0 (accuracies) is held to 1e-6 absolute instead
        assert _rel(o_metrics[k], t_metrics[k]) < 1e-4 or abs(o_metrics[k] - t_metrics[k]) < 1e-6, (k, o_metrics,
                                                                                                      t_metrics)
    g_worst = 0.0
    for hf_name, want in t_grads.items():
        got = np.asarray(o_grads[hf_name], np.float64)
        g_worst = max(g_worst, float(np.linalg.norm(got - want) / np.linalg.norm(want)))
    m_worst = max(_rel(o_metrics[k], t_metrics[k]) for k in o_metrics if abs(t_metrics[k]) > 1e-6)
    print(f"\n{name}: loss {o_loss:.6g} vs TRL {t_loss:.6g} (rel {_rel(o_loss, t_loss):.1e}); worst metric rel "
          f"{m_worst:.1e}; worst per-tensor gradient rel {g_worst:.1e}")
    assert g_worst < 1e-4


def test_exo_pair_at_trl_defaults_is_refused_by_both(world):
    """TRL's own ``__init__`` raises for ``exo_pair`` at ``label_smoothing=0`` (its default); ours refuses it
    before anything compiles, in one line."""
    case = {"loss_type": ["exo_pair"]}
    with pytest.raises(ValueError, match="Label smoothing must be greater than 0.0 when using 'exo_pair' loss"):
        _stand_in(_trl_config(world, case), world.policy, world.ref)
    with pytest.raises(ConfigError, match="exo_pair needs posttrain.label_smoothing > 0") as e:
        _config(case)
    assert "\n" not in str(e.value)
