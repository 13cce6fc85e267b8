"""RLOO against TRL at TRL's own defaults (``posttrain.advantage=rloo``): the advantages and the loss of
TRL 1.16's ``RLOOTrainer``, run on stand-in trainers whose attributes ``RLOOTrainer.__init__`` derives
from a real ``RLOOConfig`` (its defaults, ``use_cpu=True``, and only what a case names), on the tiny
LLaMA and batch of :mod:`test_grpo_trl_parity`.

* Advantages: TRL's own ``_generate_and_score_completions`` with its generation and reward functions
  stubbed to hand back fixed completions and rewards (one completion unscorable), so that its KL in
  the reward (``β·Σ(log π_old - log π_ref)``, β = 0.05 by default), its leave-one-out baseline and its
  ``normalize_advantages`` run as written; ours is :func:`jaxcolossal.posttrain.rollout.rloo_advantages`
  on our log-probs of the same rows. Also TRL's rollout metric ``kl``.
* Loss: TRL's own ``_compute_loss`` (the clipped ratio of each completion's summed log-probs, averaged
  over completions) against our GRPO objective with ``advantage=rloo`` through the step's gradient
  function, on- and off-policy: the loss, every metric TRL logs and every gradient tensor within 1e-4
  relative (fp32)."""

import dataclasses
import types
from collections import defaultdict, deque
from functools import partial
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")

from test_grpo_trl_parity import B, C, EOS, P, SEQ_LEN, VOCAB, _Accel, _World  # noqa: E402
from trl import RLOOConfig, RLOOTrainer  # noqa: E402

from jaxcolossal.config import config_from_dict  # noqa: E402
from jaxcolossal.config.derived import posttrain_beta  # noqa: E402
from jaxcolossal.models import get_family  # noqa: E402
from jaxcolossal.models.hf_io import load_hf  # noqa: E402
from jaxcolossal.parallel.mesh import make_mesh  # noqa: E402
from jaxcolossal.posttrain.grpo import Grpo  # noqa: E402
from jaxcolossal.posttrain.rollout import rloo_advantages, rollout_token_logps  # noqa: E402
from jaxcolossal.train.state import make_plan  # noqa: E402
from jaxcolossal.train.step import make_grad_fn  # noqa: E402

TOL = 1e-4
GENERATIONS = 2  # RLOOConfig's num_generations default; ours is set to it (our default is GRPOConfig's 8)
REWARDS = np.array([1.0, 0.0, 0.5, np.nan, 0.25, 1.0, 0.0, 0.75], np.float32)  # row 3: unscorable


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return _World(tmp_path_factory.mktemp("rloo_trl"))


def _args(case: dict) -> RLOOConfig:
    return RLOOConfig(output_dir="/tmp/rloo_trl_parity", use_cpu=True, report_to=[], **case)


class _RlooAccel(_Accel):
    process_index = 0


def _fake(w, args: RLOOConfig, policy, ref):
    """The attributes ``RLOOTrainer._generate_and_score_completions`` and ``_compute_loss`` read, derived
    from ``args`` as ``RLOOTrainer.__init__`` derives them; generation and rewards stubbed with the batch."""
    prompt_ids, prompt_mask, comp_ids, comp_mask, _, _ = w.batch
    prompts = [[int(t) for t, m in zip(ids, mask) if m] for ids, mask in zip(prompt_ids, prompt_mask)]
    completions = [[int(t) for t, m in zip(ids, mask) if m] for ids, mask in zip(comp_ids, comp_mask)]
    fake = SimpleNamespace(
        model=policy, ref_model=ref if args.beta else None, accelerator=_RlooAccel(), args=args, beta=args.beta,
        epsilon_low=args.epsilon, epsilon_high=args.epsilon_high if args.epsilon_high is not None else args.epsilon,
        num_generations=args.num_generations, normalize_advantages=args.normalize_advantages,
        reward_weights=torch.ones(1), reward_clip_range=None, reward_func_names=["fixed"],
        mask_truncated_completions=args.mask_truncated_completions, pad_to_multiple_of=None, eos_token_ids=[EOS],
        _tokenizer=SimpleNamespace(pad_token_id=0), aux_loss_enabled=False, router_aux_loss_coef=0.0,
        log_multimodal=False, _pending_extra_logs={}, _pending_metrics={},
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        _logs={"prompt": deque(), "completion": deque(), "rewards": defaultdict(deque), "advantages": deque(),
               "extra": defaultdict(deque)})
    fake._get_per_token_logps_and_entropies = types.MethodType(RLOOTrainer._get_per_token_logps_and_entropies, fake)
    fake._generate = lambda _prompts: (prompts, completions, ["c"] * B)
    fake._calculate_rewards = lambda *a: torch.from_numpy(REWARDS[:, None].copy())
    return fake


def _trl_rollout(w, case):
    """TRL's rollout output (advantages, old log-probs) and its metrics."""
    args = _args(case)
    policy, ref, _, _, _, _ = w.models(args.temperature)
    fake = _fake(w, args, policy, ref)
    out = RLOOTrainer._generate_and_score_completions(fake, [{"prompt": "p"}] * B)
    return out, {k: v[-1] for k, v in fake._metrics["train"].items()}, fake


def _config(w, case: dict):
    post = {"advantage": "rloo", "num_generations": GENERATIONS} | {k: (0.0 if v is None else v)
                                                                     for k, v in case.items()}
    cfg = config_from_dict({"model": {"max_position_embeddings": 1024},
                            "training": {"objective": "grpo", "seq_len": SEQ_LEN, "batch_size": B},
                            "posttrain": post, "data": {"format": "prompts", "corpus": str(w.corpus)}})
    return dataclasses.replace(cfg, model=dataclasses.replace(w.cfg_m, max_position_embeddings=1024))


ADV_CASES = [{}, {"beta": 0.0}, {"normalize_advantages": True}]


@pytest.mark.parametrize("case", ADV_CASES, ids=["defaults", "beta=0", "normalize_advantages"])
def test_rloo_advantages_equal_trl(world, case):
    """Our advantages from our log-probs of the rows equal TRL's rollout's, and so does its ``kl``."""
    out, metrics, _ = _trl_rollout(world, case)
    cfg = _config(world, case)
    o = world.ours(1.0)
    plan = make_plan(cfg, make_mesh(cfg.parallel, jax.devices()[:1]))
    logps = jax.jit(partial(rollout_token_logps, plan))
    args = [o["inputs"], o["targets"], o["mask"], o["segment_ids"], o["positions"]["sampler"]]
    old = np.asarray(logps(world.params, *args))
    kl = None
    beta = posttrain_beta(cfg)
    if beta:
        _, ref_params = load_hf(world.tmp / "ref")
        per_token = (old - np.asarray(logps(ref_params, *args))) * o["mask"]
        kl = per_token.sum(1)
        ours_kl = per_token.sum() / o["mask"].sum()
        assert abs(ours_kl - metrics["kl"]) <= TOL * abs(metrics["kl"]), (ours_kl, metrics["kl"])
    adv, _ = rloo_advantages(REWARDS, GENERATIONS, kl, beta, cfg.posttrain.normalize_advantages)
    want = out["advantages"].numpy()
    err = np.abs(adv - want).max() / np.abs(want).max()
    print(f"{case or 'defaults'}: beta {beta}, advantages {np.round(want, 4)}, max rel err {err:.1e}")
    assert err < TOL and want[3] == 0.0 and adv[3] == 0.0  # the unscorable row: 0
    np.testing.assert_allclose(old.sum(1), out["old_logps"].numpy(), rtol=TOL)


def _trl_loss(w, case, advantages, old_seq):
    args = _args(case)
    policy, ref, _, _, _, _ = w.models(args.temperature)
    fake = _fake(w, args, policy, ref)
    prompt_ids, prompt_mask, comp_ids, comp_mask, _, _ = w.batch
    inputs = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": comp_ids,
              "completion_mask": comp_mask, "advantages": advantages, "old_logps": old_seq}
    inputs = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in inputs.items()}
    policy.zero_grad()
    loss = RLOOTrainer._compute_loss(fake, policy, inputs)
    loss.backward()
    grads = {n: p.grad.numpy().astype(np.float64) for n, p in policy.named_parameters()}
    return float(loss.detach()), {k: v[-1] for k, v in fake._metrics["train"].items()}, grads


def _ours_loss(w, cfg, o):
    plan = make_plan(cfg, make_mesh(cfg.parallel, jax.devices()[:1]))
    grad_fn = jax.jit(partial(make_grad_fn(plan), with_stats=True))
    obj = Grpo(get_family(cfg.model), cfg)
    fields = {k: jnp.asarray(o[k]) for k in obj.batch_fields if k in o}
    loss_sum, g, _, stats = grad_fn(w.params, o["inputs"], o["targets"], np.float32(1.0), o["mask"],
                                    o["segment_ids"], o["positions"]["sampler"], fields=fields)
    n = obj.count(o["inputs"], o["mask"], fields)
    return (float(loss_sum / n), {k: float(v) for k, v in obj.metrics(stats, n).items()},
            get_family(cfg.model).params_to_hf(g, cfg.model))


@pytest.mark.parametrize("case", [{}, {"num_iterations": 2}, {"num_iterations": 2, "epsilon_high": 0.28}],
                         ids=["defaults", "off-policy", "off-policy,epsilon_high=0.28"])
def test_rloo_loss_equals_trl(world, case):
    """The loss, TRL's metrics and the gradient within 1e-4 (old log-probs: the policy's on-policy, off
    it by the batch's noise off-policy, where both clips act)."""
    o = world.ours(1.0)
    _, _, _, old_lp, pol_lp, _ = world.models(1.0)
    off = case.get("num_iterations", 1) > 1
    comp_mask = world.batch[3]
    old_seq = ((old_lp if off else pol_lp) * comp_mask).sum(1).astype(np.float32)
    advantages = world.batch[4]
    t_loss, t_metrics, t_grads = _trl_loss(world, case, advantages, old_seq)
    if off:
        assert t_metrics["clip_ratio/low_mean"] > 0 and t_metrics["clip_ratio/high_mean"] > 0, t_metrics
    cfg = _config(world, case)
    o_loss, o_metrics, o_grads = _ours_loss(world, cfg, o)
    assert set(o_metrics) == set(t_metrics), (o_metrics, t_metrics)
    assert abs(o_loss - t_loss) <= TOL * abs(t_loss), (o_loss, t_loss)
    for k, v in t_metrics.items():
        assert abs(o_metrics[k] - v) <= TOL * abs(v) + 1e-6, (k, o_metrics, t_metrics)
    worst = max(float(np.linalg.norm(np.asarray(o_grads[n], np.float64) - g) / np.linalg.norm(g))
                for n, g in t_grads.items())
    print(f"{case or 'defaults'}: loss {t_loss:.6g} rel err {abs(o_loss - t_loss) / abs(t_loss):.1e}, worst grad "
          f"{worst:.1e}, TRL metrics {t_metrics}")
    assert worst < TOL, worst
