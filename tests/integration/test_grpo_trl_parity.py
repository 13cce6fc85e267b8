"""GRPO against TRL at TRL's own defaults: a tiny LLaMA saved by transformers, fixed left-padded prompts,
right-padded completions, advantages, reference and old log-probs; our GRPO objective's loss, every
metric TRL logs and the policy gradient equal those of TRL's own ``GRPOTrainer._compute_loss`` (trl 1.16,
its fused LM head patched in as ``GRPOTrainer.__init__`` does, called on a stand-in trainer whose
attributes ``GRPOTrainer.__init__`` derives from a real ``GRPOConfig``, so that no dataset, reward
function, generation or accelerator launch is needed), within 1e-4 relative in fp32.

Each case is a dict of settings under TRL's names: ``GRPOConfig(**case)`` on TRL's side (plus
``use_cpu=True``, the device, without which ``GRPOConfig`` refuses a machine with no GPU), and the same
keys on ours (``posttrain.*``, ``training.gradient_accumulation_steps``); every other setting is each
side's default. No case sets a TRL option to match a choice of ours. The cases: all eight loss types ×
β ∈ {0, 0.04} × on/off-policy (``num_iterations=2``: old log-probs unlike the policy's, so that both
clips act); ``use_bias_correction_kl=False``; GSPO (``importance_sampling_level=sequence``); ``delta``;
``top_entropy_quantile``; temperature 0.7; gradient accumulation 2 for every loss type. Ours is
computed through the real step's gradient function (:func:`jaxcolossal.train.step.make_grad_fn`, its
batch fields and microbatches) on one device, and for one microbatch also as the objective called
directly.

Positions: TRL's ``_get_per_token_logps_and_entropies`` passes ``input_ids`` and ``attention_mask`` only,
so transformers' LLaMA numbers the positions ``0..P+C-1`` *including* the left pads; our sampler (like
HF ``generate``) counts them from each row's first real token. RoPE only sees position differences
within a row and the pads are never attended, so the two conventions give the same log-probs up to
rounding: the direct calls check both against TRL.

The worst relative errors are printed with ``-s``; the figures are in the docstring of
:func:`test_grpo_equals_trl`."""

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
from trl import GRPOConfig, GRPOTrainer
from trl.trainer.utils import add_fused_lm_head

from jaxcolossal.config import config_from_dict
from jaxcolossal.models import get_family
from jaxcolossal.models.hf_io import load_hf
from jaxcolossal.models.layers.logprobs import no_shard
from jaxcolossal.parallel.mesh import make_mesh
from jaxcolossal.posttrain.grpo import Grpo
from jaxcolossal.posttrain.loss_terms import policy_token_logps
from jaxcolossal.train.state import make_plan
from jaxcolossal.train.step import make_grad_fn

VOCAB, P, C, PROMPTS, GENERATIONS, EOS = 128, 6, 10, 4, 2, 2
B, T = PROMPTS * GENERATIONS, P + C - 1  # rows; our row's inputs (prompt + completion less its last token)
SEQ_LEN = 600  # our training.seq_len: room for max_completion_length's default (512); the rows are T wide
TOL = 1e-4


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

    def pad_across_processes(self, x, dim=0, pad_index=0):
        return x

    def autocast(self):
        return nullcontext()


def _trl_args(case: dict) -> GRPOConfig:
    """TRL's own config: its defaults, changed only where the case names a setting."""
    return GRPOConfig(output_dir="/tmp/grpo_trl_parity", use_cpu=True, report_to=[], **case)


def _fake_trainer(model, args: GRPOConfig):
    """The attributes ``GRPOTrainer._compute_loss`` reads, derived from ``args`` as ``GRPOTrainer.__init__``
    derives them (trl 1.16), and its helper methods bound to the stand-in."""
    fake = SimpleNamespace(
        model=model, accelerator=_Accel(), args=args, loss_type=args.loss_type, beta=args.beta,
        epsilon_low=args.epsilon, epsilon_high=args.epsilon_high if args.epsilon_high is not None else args.epsilon,
        top_entropy_quantile=args.top_entropy_quantile, off_policy_mask_threshold=args.off_policy_mask_threshold,
        importance_sampling_level=args.importance_sampling_level, use_vllm=args.use_vllm,
        vllm_importance_sampling_correction=args.vllm_importance_sampling_correction,
        current_gradient_accumulation_steps=args.gradient_accumulation_steps,
        max_completion_length=args.max_completion_length, temperature=args.temperature,
        entropy_coef=args.entropy_coef, use_adaptive_entropy=args.use_adaptive_entropy,
        _entropy_bonus_enabled=args.entropy_coef != 0.0 or args.use_adaptive_entropy,
        aux_loss_enabled=False, router_aux_loss_coef=0.0,  # a dense LLaMA: no router
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)})
    for name in ("_get_per_token_logps_and_entropies", "get_high_entropy_mask", "get_off_policy_mask"):
        setattr(fake, name, types.MethodType(getattr(GRPOTrainer, name), fake))
    fake.get_gamma_weights = GRPOTrainer.get_gamma_weights
    return fake


def _trl_logps(model, args, prompt_ids, prompt_mask, comp_ids, comp_mask, entropy=True):
    """TRL's per-token completion log-probs and entropies [B, C] (0 on the completion's pads; entropies
    ``None`` without ``entropy``), no gradient."""
    fake = _fake_trainer(model, args)
    with torch.no_grad():
        lp, ent, _ = fake._get_per_token_logps_and_entropies(
            model, torch.cat([torch.from_numpy(prompt_ids), torch.from_numpy(comp_ids)], 1),
            torch.cat([torch.from_numpy(prompt_mask), torch.from_numpy(comp_mask)], 1), C, compute_entropy=entropy)
    return lp.numpy().astype(np.float32), None if ent is None else ent.numpy().astype(np.float32)


class _World:
    """The HF models (saved once; each temperature's copies patched with TRL's fused head as
    ``GRPOTrainer.__init__`` patches them), our imported params and the batch in both layouts."""

    def __init__(self, tmp):
        self.tmp = tmp
        tiny_llama(0, VOCAB).save_pretrained(str(tmp / "pol"))
        tiny_llama(1, VOCAB).save_pretrained(str(tmp / "ref"))
        self.batch = _batch()
        self.cfg_m, self.params = load_hf(tmp / "pol")
        self.corpus = tmp / "prompts.jsonl"
        self.corpus.write_text('{"prompt": "1 + 1 =", "answer": "2"}\n')
        self._models = {}

    def models(self, temperature: float):
        """``(policy, reference, ref_logps [B, C], old_logps [B, C])`` at ``temperature`` (TRL's)."""
        if temperature not in self._models:
            args = _trl_args({"temperature": temperature})
            policy = transformers.AutoModelForCausalLM.from_pretrained(str(self.tmp / "pol")).float()
            ref = transformers.AutoModelForCausalLM.from_pretrained(str(self.tmp / "ref")).float()
            add_fused_lm_head(policy, temperature=temperature, outputs=("log_probs", "entropy"))
            add_fused_lm_head(ref, temperature=temperature)
            policy.train()
            ref.eval()
            prompt_ids, prompt_mask, comp_ids, comp_mask, _, noise = self.batch
            ref_lp, _ = _trl_logps(ref, args, prompt_ids, prompt_mask, comp_ids, comp_mask, entropy=False)
            pol_lp, pol_ent = _trl_logps(policy, args, prompt_ids, prompt_mask, comp_ids, comp_mask)
            self._models[temperature] = policy, ref, ref_lp, (pol_lp + noise) * comp_mask, pol_lp, pol_ent
        return self._models[temperature]

    def ours(self, temperature: float) -> dict:
        """Our layout: one row = the left-padded prompt then the right-padded completion, less its last token."""
        prompt_ids, prompt_mask, comp_ids, comp_mask, advantages, _ = self.batch
        _, _, ref_lp, old_lp, _, _ = self.models(temperature)
        tokens = np.concatenate([prompt_ids, comp_ids], 1)
        real = np.concatenate([prompt_mask, comp_mask], 1)[:, :-1]
        mask = np.zeros((B, T), np.float32)
        mask[:, P - 1:] = comp_mask  # target j is token j+1: completion token i is target P-1+i

        def at_completion(a):  # [B, C] -> [B, T], zero on the prompt
            out = np.zeros((B, T), np.float32)
            out[:, P - 1:] = a
            return out

        positions = {"trl": np.broadcast_to(np.arange(T, dtype=np.int32), (B, T)).copy(),  # HF's: pads counted
                     "sampler": np.maximum(np.cumsum(real, 1) - 1, 0).astype(np.int32)}  # from the first real token
        return {"inputs": tokens[:, :-1].astype(np.int32), "targets": tokens[:, 1:].astype(np.int32), "mask": mask,
                "segment_ids": real.astype(np.int32), "positions": positions,
                "advantages": np.repeat(advantages[:, None], T, 1), "ref_logps": at_completion(ref_lp),
                "old_logps": at_completion(old_lp)}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return _World(tmp_path_factory.mktemp("grpo_trl"))


def _trl(w, case: dict):
    """TRL's loss, logged metrics and gradient (HF names) over the step: with gradient accumulation
    ``k`` its rows split into ``k`` microbatches, as its sampler hands them out, each loss already
    divided for the accumulation and the gradients summed; the metrics are the mean of the
    microbatches' entries, as ``GRPOTrainer.log`` averages them."""
    args = _trl_args(case)
    policy, _, ref_lp, old_lp, _, _ = w.models(args.temperature)
    fake = _fake_trainer(policy, args)
    prompt_ids, prompt_mask, comp_ids, comp_mask, advantages, _ = w.batch
    whole = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": comp_ids,
             "completion_mask": comp_mask, "advantages": advantages, "ref_per_token_logps": ref_lp,
             "old_per_token_logps": old_lp}
    if args.num_iterations == 1 and args.steps_per_generation <= args.gradient_accumulation_steps:
        del whole["old_per_token_logps"]  # on-policy: TRL uses the policy's own log-probs, detached
    if args.beta == 0.0:
        del whole["ref_per_token_logps"]
    k = args.gradient_accumulation_steps
    steps = args.steps_per_generation // k  # optimizer steps per generation: this step is the first
    policy.zero_grad()
    total = 0.0
    for rows in np.split(np.arange(B // steps), k):
        inputs = {name: torch.from_numpy(np.ascontiguousarray(a[rows])) for name, a in whole.items()}
        inputs["num_items_in_batch"] = torch.tensor(float(comp_mask.sum()))  # spans the generation batch
        loss = GRPOTrainer._compute_loss(fake, policy, inputs)
        loss.backward()
        total += float(loss.detach())
    grads = {n: p.grad.numpy().astype(np.float64) for n, p in policy.named_parameters()}
    metrics = {name: float(np.mean(v)) for name, v in fake._metrics["train"].items()}
    return total, metrics, grads


_TRAINING_KEYS = {"gradient_accumulation_steps"}


def _step_rows(case: dict) -> int:
    """The rows of the step the case trains: the generation's ``B`` over its optimizer steps."""
    return B * case.get("gradient_accumulation_steps", 1) // case.get("steps_per_generation",
                                                                    case.get("gradient_accumulation_steps", 1))


def _config(w, case: dict):
    """Ours from the same settings (the same names; TRL's ``None`` is our 0)."""
    post = {k: (0.0 if v is None else v) for k, v in case.items() if k not in _TRAINING_KEYS}
    training = {"objective": "grpo", "seq_len": SEQ_LEN, "batch_size": _step_rows(case)}
    training |= {k: v for k, v in case.items() if k in _TRAINING_KEYS}
    cfg = config_from_dict({"model": {"max_position_embeddings": 1024}, "training": training, "posttrain": post,
                            "data": {"format": "prompts", "corpus": str(w.corpus)}})  # a path: nothing is read
    # the model transformers saved, its position limit raised past our seq_len (default RoPE: no change to the math)
    return dataclasses.replace(cfg, model=dataclasses.replace(w.cfg_m, max_position_embeddings=1024))


def _ours_direct(w, cfg, o):
    """The objective called directly on the whole batch: ``{convention: (loss, metrics, grads)}``."""
    obj = Grpo(get_family(cfg.model), cfg)

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


def _ours_step(w, cfg, o):
    """Through the step's gradient function on one device (its batch fields, microbatches and count), on the
    step's rows of the generation (its first ``batch_size``), with the loader's ``tokens_per_step``: the
    generation's completion tokens over its optimizer steps."""
    plan = make_plan(cfg, make_mesh(cfg.parallel, jax.devices()[:1]))
    grad_fn = jax.jit(partial(make_grad_fn(plan), with_stats=True))
    obj = Grpo(get_family(cfg.model), cfg)
    n_rows = cfg.training.batch_size
    o = {k: (v[:n_rows] if isinstance(v, np.ndarray) else {c: p[:n_rows] for c, p in v.items()}) for k, v in o.items()}
    o["tokens_per_step"] = np.full(o["inputs"].shape, w.batch[3].sum() * n_rows / B, np.float32)
    fields = {k: jnp.asarray(o[k]) for k in obj.batch_fields}
    loss_sum, g, _, stats = grad_fn(w.params, o["inputs"], o["targets"], np.float32(1.0), o["mask"],
                                    o["segment_ids"], o["positions"]["sampler"], fields=fields)
    n = obj.count(o["inputs"], o["mask"], fields)
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


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_logps_equal_trl(world, temperature):
    """Per-token completion log-probs and entropies through our chunked path equal TRL's fused head's
    at the temperature, under both position conventions."""
    w, o = world, world.ours(temperature)
    _, _, _, _, pol_lp, pol_ent = w.models(temperature)
    f = jax.jit(lambda p, pos: policy_token_logps(get_family(w.cfg_m), p, o["inputs"], o["targets"], o["mask"],
                                                  w.cfg_m, no_shard, False, o["segment_ids"], pos,
                                                  temperature=temperature, extras=("entropy",)))
    for conv, positions in o["positions"].items():
        lp, more = f(w.params, positions)
        lp, ent = np.asarray(lp)[:, P - 1:], np.asarray(more["entropy"])[:, P - 1:]
        err = np.abs(lp - pol_lp).max() / np.abs(pol_lp).max()
        ent_err = np.abs((ent - pol_ent) * w.batch[3]).max() / np.abs(pol_ent).max()
        print(f"temperature {temperature}, positions {conv}: log-prob err {err:.1e}, entropy err {ent_err:.1e}")
        assert err < TOL and ent_err < TOL, (conv, err, ent_err)


LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
OFF = {"num_iterations": 2}  # off-policy: old log-probs unlike the policy's
GRID = [{"loss_type": lt, "beta": beta} | (OFF if off else {})
        for lt in LOSS_TYPES for beta in (0.0, 0.04) for off in (False, True)]
OPTIONS = [{"loss_type": "dapo", "beta": 0.04, "use_bias_correction_kl": False} | OFF,
           {"loss_type": "grpo", "beta": 0.04, "importance_sampling_level": "sequence", "epsilon": 0.03} | OFF,  # GSPO
           {"loss_type": "luspo", "importance_sampling_level": "sequence", "epsilon": 0.03} | OFF,
           {"loss_type": "dapo", "beta": 0.04, "delta": 1.1} | OFF,
           {"loss_type": "dapo", "epsilon_high": 0.28} | OFF,  # DAPO's clip-higher
           {"loss_type": "dapo", "beta": 0.04, "top_entropy_quantile": 0.3} | OFF,
           {"loss_type": "grpo", "top_entropy_quantile": 0.5},
           {"loss_type": "dapo", "beta": 0.04, "temperature": 0.7} | OFF,
           {"temperature": 0.7}]
ACCUMULATION = [{"loss_type": lt, "beta": 0.04, "gradient_accumulation_steps": 2} | OFF for lt in LOSS_TYPES]
ACCUMULATION += [{"loss_type": lt, "steps_per_generation": 2, "num_generations": 2} for lt in ("dapo", "vespo")]
"""With ``steps_per_generation=2`` one generation feeds two optimizer steps (the first is checked): the
token-normalised losses divide by the generation's tokens over its steps, as TRL's ``num_items_in_batch``."""
CASES = GRID + OPTIONS + ACCUMULATION + [{}]  # {}: every setting at its default
FAST = [{}] + [c for c in GRID if c.get("beta") and c.get("num_iterations") and c["loss_type"] in
               ("cispo", "vespo")] + [OPTIONS[i] for i in (1, 5, 7)]
"""The cases README's suite runs (two of the new loss types, GSPO, the entropy mask, the temperature, the
defaults); the rest is marked slow (``python -m pytest -m slow tests/integration/test_grpo_trl_parity.py``)."""


def _label(case):
    return ",".join(f"{k}={v}" for k, v in case.items()) or "defaults"


def _clips_act(case) -> bool:
    """Whether the case's TRL metrics must show both clips acting (off-policy clipped losses; GSPO's
    sequence ratios with a narrow epsilon)."""
    return (case.get("num_iterations", 1) > 1 and case.get("loss_type", "dapo") in ("grpo", "dapo", "bnpo", "dr_grpo",
                                                                                    "luspo")
            and (case.get("importance_sampling_level", "token") == "token" or case.get("epsilon")) and
            not case.get("delta") and not (case.get("loss_type") == "luspo" and "epsilon" not in case))


@pytest.mark.parametrize("case", [c if c in FAST else pytest.param(c, marks=pytest.mark.slow) for c in CASES],
                         ids=[_label(c) for c in CASES])
def test_grpo_equals_trl(world, case):
    """Loss, TRL's logged metrics and every gradient tensor within 1e-4 relative (fp32)."""
    want = _trl(world, case)
    if _clips_act(case):
        assert want[1]["clip_ratio/low_mean"] > 0 and want[1]["clip_ratio/high_mean"] > 0, want[1]  # both clips act
    cfg = _config(world, case)
    o = world.ours(cfg.posttrain.temperature)
    label = _label(case)
    if cfg.training.gradient_accumulation_steps == 1 and "steps_per_generation" not in case:  # one microbatch
        for conv, got in _ours_direct(world, cfg, o).items():
            errs = _compare(f"{label} direct/{conv}", got, want)
            print(f"{label} direct, positions {conv}: rel errors loss {errs[0]:.1e} grad {errs[1]:.1e} "
                  f"metrics {errs[2]:.1e}")
    errs = _compare(f"{label} step", _ours_step(world, cfg, o), want)
    print(f"{label} step: loss {want[0]:.6g}; rel errors loss {errs[0]:.1e} grad {errs[1]:.1e} metrics "
          f"{errs[2]:.1e}; TRL metrics {want[1]}")
