"""GRPO against TRL: a tiny LLaMA saved by transformers, fixed left-padded prompts, right-padded
completions, advantages, reference and old log-probs; our GRPO objective's loss, TRL's clip-ratio and
KL metrics and the policy gradient equal those of TRL's own ``GRPOTrainer._compute_loss`` (trl 1.16,
its fused LM head patched in as ``GRPOTrainer.__init__`` does, called on a stand-in trainer so that no
dataset, reward function, generation or accelerator launch is needed), within 1e-4 relative in fp32,
for the grpo, bnpo, dr_grpo and dapo losses, with and without the KL term, and off-policy
(``num_iterations=2``: old log-probs unlike the policy's, so that both clips act) with DAPO's
clip-higher. Ours is computed twice: the objective called directly, and through the real step's
gradient function (:func:`jaxcolossal.train.step.make_grad_fn`, its batch fields) on one device.

Positions: TRL's ``_get_per_token_logps_and_entropies`` passes ``input_ids`` and ``attention_mask`` only,
so transformers' LLaMA numbers the positions ``0..P+C-1`` *including* the left pads; our sampler (like
HF ``generate``) counts them from each row's first real token. RoPE only sees position differences
within a row and the pads are never attended, so the two conventions give the same log-probs up to
rounding: both are checked against TRL.

Measured on CPU (fp32, trl 1.16, transformers 5.25, torch 2.13): the worst relative error of the loss
2.5e-6, of any gradient tensor (norm of the difference over the norm) 3.1e-6, of any metric 5.3e-7, and
of the per-token log-probs 2.3e-7, in every case and both position conventions (printed with ``-s``)."""

import dataclasses
import types
from collections import defaultdict
from contextlib import nullcontext
from functools import partial
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")

from hf_tiny import tiny_llama  # noqa: E402
from trl import GRPOTrainer
from trl.trainer.utils import add_fused_lm_head

from jaxcolossal.config import config_from_dict
from jaxcolossal.models import get_family
from jaxcolossal.models.hf_io import load_hf
from jaxcolossal.models.layers.logprobs import no_shard
from jaxcolossal.parallel.mesh import make_mesh
from jaxcolossal.posttrain.grpo import GRPO_METRICS, Grpo
from jaxcolossal.posttrain.loss_terms import policy_token_logps
from jaxcolossal.train.state import make_plan
from jaxcolossal.train.step import make_grad_fn

VOCAB, P, C, PROMPTS, GENERATIONS, EOS = 128, 6, 10, 4, 2, 2
B, T = PROMPTS * GENERATIONS, P + C - 1  # rows; our row's inputs (prompt + completion less its last token)
TOL = 1e-4


def _llama(seed):
    return tiny_llama(seed, VOCAB)


def _batch():
    """TRL's rows: prompts LEFT-padded to P (as its generation leaves them; each prompt repeated for its
    group), completions right-padded to C with the mask on up to and including the EOS (one truncated
    completion with no EOS), fixed advantages of both signs (not group-normalised, so that no loss is 0
    by symmetry), and the noise that makes the old policy differ from the current one."""
    rng = np.random.default_rng(0)
    prompt_ids, prompt_mask = np.zeros((B, P), np.int64), np.zeros((B, P), np.int64)
    for g, n in enumerate([2, 4, 6, 5]):  # real prompt lengths
        ids = rng.integers(3, VOCAB, n)
        for r in range(g * GENERATIONS, (g + 1) * GENERATIONS):
            prompt_ids[r, P - n:], prompt_mask[r, P - n:] = ids, 1
    comp_ids, comp_mask = np.zeros((B, C), np.int64), np.zeros((B, C), np.int64)
    for r, n in enumerate([3, 10, 7, 5, 9, 4, 10, 6]):  # completion lengths (EOS included)
        comp_ids[r, :n] = rng.integers(3, VOCAB, n)
        if r != 1:  # row 1: truncated at C, no EOS
            comp_ids[r, n - 1] = EOS
        comp_mask[r, :n] = 1
    advantages = np.array([1.2, -0.7, 0.4, -1.5, 0.9, -0.3, 1.1, -0.6], np.float32)
    noise = rng.uniform(-0.3, 0.3, (B, C)).astype(np.float32)
    return prompt_ids, prompt_mask, comp_ids, comp_mask, advantages, noise


class _Accel:
    device = torch.device("cpu")
    num_processes, is_main_process, sync_gradients = 1, True, True

    def gather(self, x):
        return x

    gather_for_metrics = gather

    def reduce(self, x, reduction="sum"):
        return x

    def autocast(self):
        return nullcontext()


def _fake_trainer(model, loss_type=None, beta=0.0, epsilon=0.2, epsilon_high=0.2):
    """The attributes ``GRPOTrainer._compute_loss`` and ``_get_per_token_logps_and_entropies`` read."""
    fake = SimpleNamespace(
        model=model, accelerator=_Accel(), loss_type=loss_type, beta=beta, epsilon_low=epsilon,
        epsilon_high=epsilon_high, top_entropy_quantile=1.0, off_policy_mask_threshold=None,
        importance_sampling_level="token", use_vllm=False, vllm_importance_sampling_correction=False,
        current_gradient_accumulation_steps=1, max_completion_length=C, _entropy_bonus_enabled=False,
        aux_loss_enabled=False, temperature=1.0, _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        args=SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=1))
    fake._get_per_token_logps_and_entropies = types.MethodType(GRPOTrainer._get_per_token_logps_and_entropies, fake)
    return fake


def _trl_logps(model, prompt_ids, prompt_mask, comp_ids, comp_mask):
    """TRL's per-token completion log-probs [B, C] (0 on the completion's pads), no gradient."""
    fake = _fake_trainer(model)
    with torch.no_grad():
        lp, _, _ = fake._get_per_token_logps_and_entropies(
            model, torch.cat([torch.from_numpy(prompt_ids), torch.from_numpy(comp_ids)], 1),
            torch.cat([torch.from_numpy(prompt_mask), torch.from_numpy(comp_mask)], 1), C)
    return lp.numpy().astype(np.float32)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """The HF policy (fused head patched) and reference, our imported params, the batch in both layouts."""
    tmp = tmp_path_factory.mktemp("grpo_trl")
    policy, ref = _llama(0), _llama(1)
    policy.save_pretrained(str(tmp / "pol"))
    ref.save_pretrained(str(tmp / "ref"))
    add_fused_lm_head(policy, temperature=1.0, outputs=("log_probs", "entropy"))  # as GRPOTrainer.__init__
    add_fused_lm_head(ref, temperature=1.0)
    policy.train()
    ref.eval()
    prompt_ids, prompt_mask, comp_ids, comp_mask, advantages, noise = _batch()
    ref_lp = _trl_logps(ref, prompt_ids, prompt_mask, comp_ids, comp_mask)
    old_lp = (_trl_logps(policy, prompt_ids, prompt_mask, comp_ids, comp_mask) + noise) * comp_mask
    cfg_m, params = load_hf(tmp / "pol")
    _, ref_params = load_hf(tmp / "ref")
    corpus = tmp / "prompts.jsonl"
    corpus.write_text('{"prompt": "1 + 1 =", "answer": "2"}\n')

    # our layout: one row = the left-padded prompt then the right-padded completion, less its last token
    tokens = np.concatenate([prompt_ids, comp_ids], 1)
    real = np.concatenate([prompt_mask, comp_mask], 1)[:, :-1]
    mask = np.zeros((B, T), np.float32)
    mask[:, P - 1:] = comp_mask  # target j is token j+1: completion token i is target P-1+i

    def at_completion(a):  # [B, C] -> [B, T], zero on the prompt
        out = np.zeros((B, T), np.float32)
        out[:, P - 1:] = a
        return out

    positions = {"trl": np.broadcast_to(np.arange(T, dtype=np.int32), (B, T)).copy(),  # HF's: the pads counted
                 "sampler": np.maximum(np.cumsum(real, 1) - 1, 0).astype(np.int32)}  # from the first real token
    ours = {"inputs": tokens[:, :-1].astype(np.int32), "targets": tokens[:, 1:].astype(np.int32), "mask": mask,
            "segment_ids": real.astype(np.int32), "positions": positions,
            "advantages": np.repeat(advantages[:, None], T, 1), "ref_logps": at_completion(ref_lp),
            "old_logps": at_completion(old_lp)}
    torch_inputs = {"prompt_ids": torch.from_numpy(prompt_ids), "prompt_mask": torch.from_numpy(prompt_mask),
                    "completion_ids": torch.from_numpy(comp_ids), "completion_mask": torch.from_numpy(comp_mask),
                    "advantages": torch.from_numpy(advantages),
                    "num_items_in_batch": torch.tensor(float(comp_mask.sum())),
                    "ref_per_token_logps": torch.from_numpy(ref_lp), "old_per_token_logps": torch.from_numpy(old_lp)}
    return SimpleNamespace(policy=policy, ref=ref, cfg_m=cfg_m, params=params, ref_params=ref_params,
                           corpus=str(corpus), ours=ours, torch_inputs=torch_inputs, ref_lp=ref_lp)


def _config(w, loss_type, beta, iterations, epsilon_high):
    cfg = config_from_dict({"model": {}, "training": {"objective": "grpo", "seq_len": T, "batch_size": B},
                            "data": {"format": "prompts", "corpus": w.corpus},  # a path: nothing is read
                            "posttrain": {"loss_type": loss_type, "beta": beta, "num_iterations": iterations,
                                          "epsilon": 0.2, "epsilon_high": epsilon_high,
                                          "max_completion_length": C, "num_generations": GENERATIONS}})
    return dataclasses.replace(cfg, model=w.cfg_m)


def _trl(w, loss_type, beta, iterations, epsilon_high):
    """TRL's loss, metrics and gradient (HF names)."""
    fake = _fake_trainer(w.policy, loss_type, beta, 0.2, epsilon_high or 0.2)
    inputs = dict(w.torch_inputs)
    if iterations == 1:  # on-policy: TRL uses the policy's own log-probs, detached
        del inputs["old_per_token_logps"]
    if not beta:
        del inputs["ref_per_token_logps"]
    w.policy.zero_grad()
    loss = GRPOTrainer._compute_loss(fake, w.policy, inputs)
    loss.backward()
    grads = {n: p.grad.numpy().astype(np.float64) for n, p in w.policy.named_parameters()}
    metrics = {k: fake._metrics["train"][k][-1] for k in GRPO_METRICS if k in fake._metrics["train"]}
    return float(loss.detach()), metrics, grads


def _ours_direct(w, cfg):
    """The objective called directly: ``(loss, metrics, grads)`` for each positions convention."""
    obj, o = Grpo(get_family(cfg.model), cfg), w.ours

    @jax.jit
    def f(params, positions):
        def loss(p):
            s, stats = obj(p, o["inputs"], o["targets"], cfg.model, no_shard, False, o["mask"], o["segment_ids"],
                           positions, advantages=o["advantages"], old_logps=o["old_logps"], ref_logps=o["ref_logps"])
            n = obj.count(o["inputs"], o["mask"])
            return s / n, obj.metrics(stats, n)
        return jax.value_and_grad(loss, has_aux=True)(params)

    out = {}
    for conv, positions in o["positions"].items():
        (loss, metrics), g = f(w.params, positions)
        hf_grads = get_family(cfg.model).params_to_hf(g, cfg.model)
        out[conv] = float(loss), {k: float(v) for k, v in metrics.items()}, hf_grads
    return out


def _ours_step(w, cfg):
    """Through the step's gradient function on one device (its batch fields, its count)."""
    plan = make_plan(cfg, make_mesh(cfg.parallel, jax.devices()[:1]))
    grad_fn = jax.jit(partial(make_grad_fn(plan), with_stats=True))
    o = w.ours
    obj = Grpo(get_family(cfg.model), cfg)
    fields = {k: jnp.asarray(o[k]) for k in obj.batch_fields}
    loss_sum, g, _, stats = grad_fn(w.params, o["inputs"], o["targets"], np.float32(1.0), o["mask"],
                                    o["segment_ids"], o["positions"]["sampler"], fields=fields)
    n = obj.count(o["inputs"], o["mask"])
    return (float(loss_sum / n), {k: float(v) for k, v in obj.metrics(stats, n).items()},
            get_family(cfg.model).params_to_hf(g, cfg.model))


def _rel(a, b):
    return abs(a - b) / max(abs(b), 1e-12)


def _compare(label, got, want):
    """The worst relative errors of (loss, gradient tensors, metrics); asserts each within TOL."""
    (o_loss, o_metrics, o_grads), (t_loss, t_metrics, t_grads) = got, want
    assert set(o_metrics) == set(t_metrics), (label, o_metrics, t_metrics)
    loss_err = _rel(o_loss, t_loss)
    assert loss_err < TOL, (label, o_loss, t_loss)
    m_err = 0.0
    for k, want_m in t_metrics.items():
        err = _rel(o_metrics[k], want_m) if abs(want_m) > 1e-6 else abs(o_metrics[k] - want_m)
        m_err = max(m_err, err)
        assert err < TOL, (label, k, o_metrics, t_metrics)
    g_err = 0.0
    for name, want_g in t_grads.items():
        got_g = np.asarray(o_grads[name], np.float64)
        g_err = max(g_err, float(np.linalg.norm(got_g - want_g) / np.linalg.norm(want_g)))
    assert g_err < TOL, (label, g_err)
    return loss_err, g_err, m_err


def test_token_logps_equal_trl(world):
    """Per-token completion log-probs (the reference's, through our chunked path) equal TRL's under
    both position conventions."""
    w, o = world, world.ours
    f = jax.jit(lambda p, pos: policy_token_logps(get_family(w.cfg_m), p, o["inputs"], o["targets"], o["mask"],
                                                  w.cfg_m, no_shard, False, o["segment_ids"], pos))
    for conv, positions in o["positions"].items():
        got = np.asarray(f(w.ref_params, positions))[:, P - 1:]
        err = np.abs(got - w.ref_lp).max() / np.abs(w.ref_lp).max()
        print(f"token log-probs, positions {conv}: max abs err / max |logp| {err:.1e}")
        assert err < TOL, (conv, err)


CASES = [(lt, beta, 1, 0.0) for lt in ("grpo", "bnpo", "dr_grpo", "dapo") for beta in (0.0, 0.04)]
CASES += [(lt, 0.04, 2, 0.28) for lt in ("grpo", "dapo")]  # off-policy: both clips act, clip-higher


@pytest.mark.parametrize("loss_type,beta,iterations,epsilon_high", CASES)
def test_grpo_equals_trl(world, loss_type, beta, iterations, epsilon_high):
    cfg = _config(world, loss_type, beta, iterations, epsilon_high)
    want = _trl(world, loss_type, beta, iterations, epsilon_high)
    if iterations > 1:  # the case is only worth its name if the clips act
        assert want[1]["clip_ratio/low_mean"] > 0 and want[1]["clip_ratio/high_mean"] > 0, want[1]
    label = f"{loss_type} beta={beta} iterations={iterations} epsilon_high={epsilon_high}"
    for conv, got in _ours_direct(world, cfg).items():
        errs = _compare(f"{label} direct/{conv}", got, want)
        print(f"{label} direct, positions {conv}: loss {got[0]:.6g} vs TRL {want[0]:.6g}; rel errors loss "
              f"{errs[0]:.1e} grad {errs[1]:.1e} metrics {errs[2]:.1e}; TRL metrics {want[1]}")
    errs = _compare(f"{label} step", _ours_step(world, cfg), want)
    print(f"{label} step: rel errors loss {errs[0]:.1e} grad {errs[1]:.1e} metrics {errs[2]:.1e}")
