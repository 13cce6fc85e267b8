"""The KV-cached sampler's decode loop with the flash-decoding kernel, compiled by XLA's GPU compiler for
8 compile-only H200s (tp 2 × fsdp 4 under ZeRO-3, bf16 params in the training layout).

``decode_kernel`` left at ``None`` turns the kernel on for this GPU mesh
(:func:`jaxcolossal.models.layers.decode_attention.kernel_choice`): the decode loop then runs the Triton
kernel once per layer per step, on each device's own rows and kv heads (the ``shard_map``), and the prefill
runs XLA's attention; ``decode_kernel=False`` compiles no Triton call. LLaMA, Gemma 2 (soft-cap, scale,
windows) and GPT-OSS (sinks, windows): every option the kernel takes goes through Triton and XLA:GPU.
"""

import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcolossal.aot import hlo, target
from jaxcolossal.config import ParallelConfig, config_from_dict
from jaxcolossal.generate import Sampling, make_generator, training_param_specs
from jaxcolossal.models import get_family, param_layout
from jaxcolossal.parallel.mesh import make_mesh
from jaxcolossal.parallel.sharding import is_shape, logical_to_spec, rules_for

TRITON = 'custom_call_target="__gpu$xla.gpu.triton"'
TRIP = re.compile(r'known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"')
BASE = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
        "attention_head_dim": 16, "intermediate_size": 64, "max_position_embeddings": 64}
FAMILIES = {
    "llama": {},
    "gemma2": {"type": "gemma", "query_pre_attn_scalar": 12.0, "sliding_window": 8, "attn_logit_softcapping": 5.0,
               "layer_types": "sliding_attention,full_attention", "tie_word_embeddings": True},
    "gpt_oss": {"type": "gpt_oss", "num_attention_heads": 8, "num_experts": 4, "num_experts_per_tok": 2, "attention_sinks": True,
                "attention_bias": "all", "sliding_window": 8, "layer_types": "sliding_attention,full_attention",
                "router_aux_loss_coef": 0.0},  # 8 heads: ZeRO-3 splits the sinks [2 layers, 8] over fsdp 4
}
ROWS, WIDTH, NEW = 8, 9, 24  # 33 cache slots: two blocks of 32, the second moved back to end at slot 33


def _compiled_hlo(name: str, decode_kernel) -> tuple[str, object]:
    """The sampler for family ``name`` compiled for 8 H200s: (its HLO text, the model config)."""
    if not target.gpu_compiler_available():
        pytest.fail("XLA's GPU compiler is not installed: pip install -e \".[gpu-compile]\"", pytrace=False)
    cfg = config_from_dict({"model": {**BASE, **FAMILIES[name]}, "training": {"seq_len": 32}}).model
    parallel = ParallelConfig(tensor_parallel_size=2, zero_stage=3)
    mesh = make_mesh(parallel, target.compile_only_devices("h200", 8))
    rules = rules_for(parallel)
    specs = training_param_specs(cfg, mesh, 3, rules)
    _, shapes, _ = param_layout(cfg, 2)
    params = jax.tree.map(lambda s, sp: jax.ShapeDtypeStruct(tuple(s), jnp.bfloat16, sharding=NamedSharding(mesh, sp)),
                          shapes, specs, is_leaf=is_shape)
    fn = make_generator(get_family(cfg), cfg, NEW, Sampling(temperature=1.0), eos_id=1, mesh=mesh, param_specs=specs,
                        rules=rules, decode_kernel=decode_kernel)
    rows = NamedSharding(mesh, logical_to_spec(("batch", None), rules))
    key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype, sharding=NamedSharding(mesh, P()))
    lowered = fn.lower(params, jax.ShapeDtypeStruct((ROWS, WIDTH), jnp.int32, sharding=rows),
                       jax.ShapeDtypeStruct((ROWS, WIDTH), jnp.bool_, sharding=rows), key)
    return lowered.compile().as_text(), cfg


def _executions(comps: dict, name: str, stack: tuple = ()) -> int:
    """Triton calls that one run of computation ``name`` executes (loops inside multiplied by their trip counts)."""
    if name in stack or name not in comps:
        return 0
    n = 0
    for line in comps[name]:
        n += TRITON in line
        trip = TRIP.search(line)
        mult = int(trip.group(1)) if (" while(" in line and trip) else 1
        n += sum(mult * _executions(comps, c, stack + (name,)) for c in hlo.callees(line))
    return n


@pytest.mark.parametrize("name", list(FAMILIES))
def test_the_decode_loop_runs_the_triton_kernel_once_per_layer_on_each_devices_shard(name):
    text, cfg = _compiled_hlo(name, None)
    comps, entry = hlo.computations(text)
    loops = [line for line in comps[entry] if " while(" in line]
    decode = [re.search(r"body=%?([\w.\-]+)", line).group(1) for line in loops if not TRIP.search(line)]
    assert len(decode) == 1  # the decode loop: its trip count depends on the rows' ends
    assert _executions(comps, decode[0]) == cfg.num_layers  # one Triton kernel per layer per decoded token
    assert _executions(comps, entry) == cfg.num_layers  # and none in the prefill
    calls = [line for line in text.splitlines() if TRITON in line]
    # the kernel's k cache operand: this device's rows (8 over fsdp 4) and kv heads (2 over tp 2), every slot
    assert all(f"bf16[{ROWS // 4},{WIDTH + NEW},{cfg.num_key_value_heads // 2},{cfg.head_dim}]" in c for c in calls)


def test_decode_kernel_false_compiles_xla_attention():
    text, _ = _compiled_hlo("llama", False)
    assert TRITON not in text
