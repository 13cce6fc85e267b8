"""GRPO's rollout programs compiled for a GPU fleet without its GPUs (``--compile-for`` on a GRPO config).

A GRPO iteration runs, beside the train step that :func:`jaxcolossal.aot.fleet.compile_for` compiles,
the rollout phase's programs (:mod:`jaxcolossal.posttrain.rollout`), built here as a run builds them
and compiled by XLA's GPU compiler over the same compile-only devices:

* ``reshard``: the policy's params from the training layout into the decode layout
  (:mod:`jaxcolossal.parallel.decode_layout`; ``posttrain.rollout_layout=decode`` only);
* ``sampler``: the KV-cached sampler (:func:`jaxcolossal.generate.make_generator`) on the decode layout
  (or the training one), the whole batch's prompts and ``max_completion_length`` new tokens;
* ``log-probs``: the old policy's / the reference's per-token log-probs
  (:func:`jaxcolossal.posttrain.rollout.rollout_token_logps`; with μ > 1 or β > 0).

Per program: the per-device peak, the peak of the phase with the resident train state beside it (the
step's arguments: params, master weights, optimizer state, the reference), the collectives, and for
the sampler those of one decode step (:func:`jaxcolossal.aot.hlo.decode_loop_collectives`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcolossal.aot import hlo
from jaxcolossal.config import Config
from jaxcolossal.config.derived import (grpo_generation_batch, grpo_prompt_length, posttrain_beta, rollout_reshards,
                                         rollout_tp)
from jaxcolossal.generate import Sampling, make_generator
from jaxcolossal.parallel.decode_layout import decode_mesh, make_reshard
from jaxcolossal.parallel.sharding import RULES, logical_to_spec
from jaxcolossal.posttrain.rollout import rollout_token_logps


@dataclass(frozen=True)
class RolloutProgram:
    """One compiled rollout program, bytes per device: ``memory`` (``argument``, ``output``, ``temp``,
    ``peak``), ``phase_peak`` (its peak with the resident train state beside it: the state + what the
    program holds that the state does not), ``collectives`` (per kind, :func:`hlo.collective_totals`,
    a loop without a known trip count once) and ``per_decode_step`` (the sampler's decode loop, one
    iteration; ``{}`` for the others)."""

    name: str
    memory: dict
    phase_peak: int
    collectives: dict
    per_decode_step: dict


def _memory(compiled) -> dict:
    ma = compiled.memory_analysis()
    m = {k: int(getattr(ma, f"{k}_size_in_bytes", 0) or 0) for k in ("argument", "output", "alias", "temp")}
    m["peak"] = m["argument"] + m["output"] - m["alias"] + m["temp"]
    return m


def _program(name: str, compiled, resident: int, resident_args: bool) -> RolloutProgram:
    """``resident_args``: the program's arguments are the resident state's (the training layout's params),
    so the phase adds only its outputs and temporaries."""
    m, text = _memory(compiled), compiled.as_text()
    phase = resident + (m["peak"] - m["argument"] if resident_args else m["peak"])
    return RolloutProgram(name, m, phase, hlo.collective_totals(text),
                          hlo.decode_loop_collectives(text) if name == "sampler" else {})


def _rows(mesh, shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, logical_to_spec(("batch", None), RULES)))


def compile_sampler(cfg: Config, plan, mesh, params, options: dict):
    """The rollout's sampler for ``params`` (ShapeDtypeStructs laid out on ``mesh``), compiled with ``options``."""
    po, B = cfg.posttrain, grpo_generation_batch(cfg)
    width = grpo_prompt_length(cfg)
    fn = make_generator(plan.family, cfg.model, po.max_completion_length,
                        Sampling(temperature=po.temperature, top_k=po.top_k, top_p=po.top_p), eos_id=0, pad_id=0,
                        mesh=mesh, param_specs=jax.tree.map(lambda p: p.sharding.spec, params), fp8=cfg.precision.fp8)
    key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype, sharding=NamedSharding(mesh, P()))
    return fn.lower(params, _rows(mesh, (B, width), jnp.int32), _rows(mesh, (B, width), jnp.bool_),
                    key).compile(compiler_options=options)


def _logps(cfg: Config, plan, params, options: dict):
    fn = jax.jit(functools.partial(rollout_token_logps, plan))
    shape = (cfg.training.batch_size, cfg.training.seq_len)
    arr = lambda dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=plan.batch_sharding)  # noqa: E731
    return fn.lower(params, arr(jnp.int32), arr(jnp.int32), arr(jnp.float32), arr(jnp.int32),
                    arr(jnp.int32)).compile(compiler_options=options)


def compile_rollout(cfg: Config, plan, state, per_host: int, resident: int, options: dict) -> list[RolloutProgram]:
    """GRPO's rollout programs (module docstring) for ``plan``'s compile-only mesh: ``state``, the abstract
    train state (its ``model_params``: the policy, LoRA's base and adapters merged as a run merges them);
    ``per_host``, the devices a host holds (the default ``rollout_tp``'s cap); ``resident``, the train
    state's bytes per device (the step's arguments); ``options``, XLA's GPU compiler options."""
    params, out = state.model_params, []
    gen_mesh, gen_params = plan.mesh, params
    tp = rollout_tp(cfg, plan.mesh.size, per_host)
    if rollout_reshards(cfg, plan.mesh.shape, tp):
        gen_mesh = decode_mesh(plan.mesh, tp)
        reshard, specs = make_reshard(params, gen_mesh)
        out.append(_program("reshard", reshard.lower(params).compile(compiler_options=options), resident, True))
        gen_params = jax.tree.map(lambda p, s: jax.ShapeDtypeStruct(p.shape, p.dtype, sharding=NamedSharding(gen_mesh, s)),
                                  params, specs, is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct))
    out.append(_program("sampler", compile_sampler(cfg, plan, gen_mesh, gen_params, options), resident,
                        gen_mesh is plan.mesh))
    if cfg.posttrain.num_iterations > 1 or posttrain_beta(cfg) > 0:
        out.append(_program("log-probs", _logps(cfg, plan, params, options), resident, True))
    return out

