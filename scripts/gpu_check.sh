#!/usr/bin/env bash
# One prepared GPU check for a single H200 / H100, bounded to under 9.5 minutes in all.
#
#     bash scripts/gpu_check.sh                 # results in ./gpu_results
#     OUT=/tmp/res BUDGET_S=420 bash scripts/gpu_check.sh
#
# NOT YET RUN ON A GPU: this script was written and checked on a CPU-only machine (its flag probe
# and its CPU fallbacks were exercised; nothing that needs CUDA was). Treat its first run as the
# first measurement, and read docs/performance.md for what to compare the numbers with.
#
# It writes to $OUT (default ./gpu_results): gpu_check.log (everything printed), env.txt, the
# accepted XLA flags, one <name>.txt / <name>.json per benchmark, bench_optimizer.txt, and
# summary.md (the benchmark table). Steps, each bounded by `timeout` and by what is left of the
# overall budget (BUDGET_S, default 540 s); a failed step is recorded and the next one runs:
#   1. environment: nvidia-smi, jax version and devices;
#   2. XLA GPU flags recommended by NVIDIA's JAX-Toolbox, each probed first so that
#      a flag this jaxlib does not know is dropped instead of aborting the run;
#   3. cuDNN attention probe: jax.nn.dot_product_attention(implementation='cudnn'), forward and
#      backward, bf16, causal, GQA, at the head dims used below; falls back to XLA attention;
#   4. scripts/benchmark.py: LLaMA ~1B (Llama-3.2-1B shape) without and with full remat, and with
#      full remat on the old LM-head path (all logits materialized), LLaMA ~3B (Llama-3.2-3B shape)
#      with full remat; seq 4096, bf16, one GPU;
#   5. scripts/bench_optimizer.py (fused AdamW Pallas kernel vs optax, GB/s vs HBM peak);
#   6. scripts/bench_offload.py (step time with each offload setting / none, host<->device GB/s);
#   7. scripts/bench_overlap.py (ZeRO-3 weight prefetch on / off: step-time ratio and memory, LLaMA ~1B);
#   8. scripts/bench_decode.py (the sampler's decode step on the Llama-3-8B shape: time and MBU);
#   4b (after the benchmarks): flash attention's Triton kernels vs cuDNN at seq 8k and 32k, TFLOPS.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2

OUT=${OUT:-./gpu_results}
BUDGET_S=${BUDGET_S:-540}
PY=${PYTHON:-python}
SEQ=${SEQ:-4096}
MODEL_1B=${MODEL_1B:-llama_1b}
MODEL_3B=${MODEL_3B:-llama_3b}
BENCH_ARGS=${BENCH_ARGS:---warmup 3 --steps 10}  # e.g. a CPU rehearsal (docs/performance.md):
OPT_ARGS=${OPT_ARGS:-}                           # SEQ=64 MODEL_1B=tiny MODEL_3B=tiny OPT_ARGS="--scale 0.001"
OVERLAP_MODEL=${OVERLAP_MODEL:-llama_1b}               # tiny for a CPU rehearsal
OFFLOAD_ARGS=${OFFLOAD_ARGS:-}                   # e.g. "--hidden 128 --layers 2 --seq 64" (CPU rehearsal)
DECODE_MODEL=${DECODE_MODEL:-llama3_8b}          # tiny for a CPU rehearsal
DECODE_ARGS=${DECODE_ARGS:-}                     # e.g. "--batch 4 --prompt 32 --new 16 --hbm-gbs 50" (CPU rehearsal)
mkdir -p "$OUT"
exec > >(tee -a "$OUT/gpu_check.log") 2>&1
START=$SECONDS
FAILED=()
NOTES=()

export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}   # one GPU
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.9}
export CUDA_DEVICE_MAX_CONNECTIONS=1                      # Hopper, as Colossal-AI sets at import
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-1}
unset JAX_PLATFORMS

left() { echo $(( BUDGET_S - (SECONDS - START) )); }

# step NAME MAX_SECONDS CMD...: run under timeout (capped by the budget left), tee to $OUT/NAME.txt
step() {
  local name=$1 max=$2; shift 2
  local t; t=$(left); t=$(( t - 5 )); (( t > max )) && t=$max
  if (( t < 30 )); then
    echo "### $name: SKIPPED (only $(left) s of the ${BUDGET_S} s budget left)"; FAILED+=("$name(skipped)"); return 1
  fi
  echo "### $name (timeout ${t} s): $*"
  local t0=$SECONDS
  timeout --signal=TERM --kill-after=10 "$t" "$@" 2>&1 | tee "$OUT/$name.txt"
  local rc=$?
  echo "### $name: rc=$rc in $(( SECONDS - t0 )) s"
  (( rc == 0 )) || FAILED+=("$name(rc=$rc)")
  return $rc
}

echo "=== gpu_check $(date -u +%FT%TZ) on $(hostname); budget ${BUDGET_S} s; results in $OUT"

# ---------------------------------------------------------------- 1. environment
{
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv 2>&1 || echo "nvidia-smi unavailable"
  "$PY" -c "import jax, jaxlib, sys; print('python', sys.version.split()[0], 'jax', jax.__version__, 'jaxlib', jaxlib.__version__); print(jax.devices())" 2>&1
  "$PY" -m pip list 2>/dev/null | grep -iE "^(jax|jaxlib|jax-cuda|flax|optax|nvidia-cudnn)" || true
} | tee "$OUT/env.txt"

# ---------------------------------------------------------------- 2. XLA flags, probed
# Each group lists alternative spellings; the first one this jaxlib accepts is kept.
FLAG_GROUPS=(
  "--xla_gpu_enable_latency_hiding_scheduler=true"
  "--xla_gpu_enable_while_loop_double_buffering=true"
  "--xla_gpu_all_gather_combine_threshold_bytes=536870912"
  "--xla_gpu_reduce_scatter_combine_threshold_bytes=536870912"
  "--xla_gpu_all_reduce_combine_threshold_bytes=536870912"
  "--xla_gpu_pipeline_all_gather=on --xla_gpu_enable_pipelined_all_gather=true"
  "--xla_gpu_pipeline_reduce_scatter=on --xla_gpu_enable_pipelined_reduce_scatter=true"
  "--xla_gpu_pipeline_all_reduce=on --xla_gpu_enable_pipelined_all_reduce=true"
  "--xla_gpu_enable_pipelined_p2p=true"
)
probe() {  # probe "FLAGS" [platform]: does a JAX process start with these XLA_FLAGS?
  XLA_FLAGS="$1" JAX_PLATFORMS="${2:-}" timeout 120 "$PY" -c "import jax; jax.devices()" >/dev/null 2>&1
}
ACCEPTED=""
for group in "${FLAG_GROUPS[@]}"; do
  ok=""
  for f in $group; do  # the flag parser is the same on every platform: probe on the CPU, fast
    if probe "$ACCEPTED $f" cpu; then ok=$f; break; fi
    echo "flag not accepted by this jaxlib: $f"
  done
  [[ -n $ok ]] && ACCEPTED="$ACCEPTED $ok"
done
ACCEPTED=${ACCEPTED# }
if ! probe "$ACCEPTED"; then  # confirm with the GPU plugin; if it disagrees, keep its accepted subset
  echo "the GPU backend rejected the combined flags; probing them one at a time on the GPU"
  kept=""
  for f in $ACCEPTED; do probe "$kept $f" && kept="$kept $f" || echo "GPU backend rejected: $f"; done
  ACCEPTED=${kept# }
fi
export XLA_FLAGS="${XLA_FLAGS:+$XLA_FLAGS }$ACCEPTED"
echo "XLA_FLAGS=$XLA_FLAGS" | tee "$OUT/xla_flags.txt"

# ---------------------------------------------------------------- 3. cuDNN attention probe
ATTN=xla
if step cudnn_probe 120 "$PY" - <<'EOF'
import jax, jax.numpy as jnp
for q_heads, kv_heads, head_dim in ((32, 8, 64), (24, 8, 128)):  # Llama-3.2-1B and -3B
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(k1, (1, 1024, q_heads, head_dim), jnp.bfloat16)
    k = jax.random.normal(k2, (1, 1024, kv_heads, head_dim), jnp.bfloat16)
    v = jax.random.normal(k3, (1, 1024, kv_heads, head_dim), jnp.bfloat16)
    f = lambda q, k, v, impl: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=impl)
    loss = lambda impl: jax.jit(jax.value_and_grad(lambda q, k, v: f(q, k, v, impl).astype(jnp.float32).sum(),
                                                   argnums=(0, 1, 2)))(q, k, v)
    (lc, gc), (lx, gx) = loss("cudnn"), loss("xla")
    err = max(float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)))) for a, b in zip(gc, gx))
    print(f"cudnn attention heads {q_heads}/{kv_heads} dim {head_dim}: loss {float(lc):.3f} vs xla {float(lx):.3f}, "
          f"max |dgrad| {err:.3e}")
print("CUDNN_OK")
EOF
then grep -q CUDNN_OK "$OUT/cudnn_probe.txt" && ATTN=cudnn
else  # not a failure of the check: the benchmarks fall back to XLA attention
  unset 'FAILED[${#FAILED[@]}-1]'; NOTES+=("cuDNN attention unavailable (see cudnn_probe.txt): XLA attention used")
fi
echo "attention implementation for the benchmarks: $ATTN"

# ---------------------------------------------------------------- 4. benchmarks (one GPU, seq 4096, bf16)
B1_NONE=4; B1_FULL=8; B3_FULL=4
[[ $ATTN == xla ]] && { B1_NONE=1; B1_FULL=4; B3_FULL=2; }  # XLA attention keeps [b, h, t, t] scores
bench() {  # bench NAME MAX_SECONDS ARGS...
  local name=$1 max=$2; shift 2
  # shellcheck disable=SC2086
  step "$name" "$max" "$PY" scripts/benchmark.py --plan dp=1 --seq "$SEQ" --precision bf16 --attention "$ATTN" \
       $BENCH_ARGS --out "$OUT/$name.json" "$@"
}
bench llama_1b_remat_none 150 --model "$MODEL_1B" --remat none --batch-per-dp "$B1_NONE"
bench llama_1b_remat_full 150 --model "$MODEL_1B" --remat full --batch-per-dp "$B1_FULL"
# the same with the old LM-head path (all fp32 logits materialized, model.loss_chunk_tokens=0): the
# fused, chunked head's effect on peak memory and MFU (scripts/lean_step.py measures it on the CPU)
bench llama_1b_remat_full_full_logits 150 --model "$MODEL_1B" --remat full --batch-per-dp "$B1_FULL" \
      --set model.loss_chunk_tokens=0 model.embedding_impl=one_hot
bench llama_3b_remat_full 200 --model "$MODEL_3B" --remat full --batch-per-dp "$B3_FULL"

# ---------------------------------------------------------------- 4b. flash attention (Pallas/Triton) vs cuDNN
# causal, GQA 32/8 heads, head dim 128, bf16, batch 1, seq 8k and 32k: forward+backward time, TFLOPS
# (causal FLOPs: 2·2·b·h·t²·d/2 forward, ×3.5 with the backward), and the output difference
step flash_attention 100 env ATTN="$ATTN" "$PY" - <<'EOF'
import os, time
import jax, jax.numpy as jnp
from jaxcolossal.models.layers.flash_attention import flash_attention
impls = {"flash": lambda q, k, v: flash_attention(q, k, v, causal=True, block_q=64, block_k=64)}
if os.environ.get("ATTN") == "cudnn":
    impls["cudnn"] = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
for t in (8192, 32768):
    b, h, kv, d = 1, 32, 8, 128
    ks = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(ks[0], (b, t, h, d), jnp.bfloat16)
    k, v = (jax.random.normal(x, (b, t, kv, d), jnp.bfloat16) for x in ks[1:])
    flops = 3.5 * 2 * b * h * t * t * d
    outs = {}
    for name, f in impls.items():
        g = jax.jit(jax.value_and_grad(lambda q, k, v: f(q, k, v).astype(jnp.float32).sum(), argnums=(0, 1, 2)))
        jax.block_until_ready(g(q, k, v))
        t0 = time.perf_counter()
        for _ in range(3):
            jax.block_until_ready(g(q, k, v))
        dt = (time.perf_counter() - t0) / 3
        outs[name] = jax.jit(f)(q, k, v)
        print(f"seq {t}: {name}: fwd+bwd {dt * 1e3:.1f} ms, {flops / dt / 1e12:.1f} TFLOPS", flush=True)
    if len(outs) == 2:
        diff = float(jnp.max(jnp.abs(outs["flash"].astype(jnp.float32) - outs["cudnn"].astype(jnp.float32))))
        print(f"seq {t}: max |flash - cudnn| = {diff:.3e}")
EOF

# ---------------------------------------------------------------- 5. fused AdamW vs optax
# shellcheck disable=SC2086
step bench_optimizer 120 "$PY" scripts/bench_optimizer.py $OPT_ARGS

# ---------------------------------------------------------------- 6. offload: step-time ratios and host<->device GB/s
# shellcheck disable=SC2086
step bench_offload 150 "$PY" scripts/bench_offload.py --devices 1 --layers 4 --hidden 2048 --seq 1024 --batch 4 \
     --steps 3 --rounds 2 $OFFLOAD_ARGS

# ---------------------------------------------------------------- 7. ZeRO-3 weight prefetch (parallel.overlap) on / off
# one GPU gathers nothing under ZeRO-3: this records the prefetch's own cost (the ratio, the memory)
step bench_overlap 120 "$PY" scripts/bench_overlap.py --model "$OVERLAP_MODEL" --seq "$SEQ" --batch-per-dp 2 \
     --precision bf16 --rounds 5 --warmup 2

# ---------------------------------------------------------------- 8. the sampler's decode step: time and MBU
# the Llama-3-8B shape (random bf16 weights, 16 GB), 32 rows of a 512-token prompt, 64 new tokens: the step's
# time and MBU (weights + KV cache bytes read per step / step time / HBM bandwidth); the flash-decoding kernel
# shellcheck disable=SC2086
step bench_decode 150 "$PY" scripts/bench_decode.py --model "$DECODE_MODEL" $DECODE_ARGS

# ---------------------------------------------------------------- summary
"$PY" - "$OUT" <<'EOF' | tee "$OUT/summary.md"
import glob, json, os, sys
sys.path.insert(0, "scripts")
from benchmark import HEADER, markdown_row
out = sys.argv[1]
rows, notes = [], []
for path in sorted(glob.glob(os.path.join(out, "*.json"))):
    try:
        r = json.loads(open(path).read().strip().splitlines()[-1])
    except (ValueError, IndexError):
        continue
    rows.append(markdown_row(r, r.get("model_name", "?")))
    notes.append(f"- {os.path.basename(path)}: step {r['step_s_median']:.3f} s (median of {r['steps']}), "
                 f"compile {r['compile_s']:.0f} s, loss {r['loss_first']:.3f} -> {r['loss_last']:.3f}, {r.get('date', '')}")
print(HEADER)
print("|" + "---|" * (HEADER.count("|") - 1))
print("\n".join(rows) if rows else "(no benchmark finished)")
print()
print("\n".join(notes))
EOF
for n in "${NOTES[@]}"; do echo "note: $n"; done
echo "=== done in $(( SECONDS - START )) s; failed or skipped: ${FAILED[*]:-none}"
(( ${#FAILED[@]} == 0 ))
