"""scripts/xla_buffers.py reads a compiled program's temporary arena back from XLA's dump: its size
equals ``memory_analysis().temp_size_in_bytes`` and the buffers live at its peak fit in it."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROGRAM = """
import jax, jax.numpy as jnp
def step(x, w):
    def layer(h, wi):
        return jnp.tanh(h @ wi), None
    return jax.lax.scan(layer, x, w)[0].sum()
x = jnp.ones((64, 256)); w = jnp.ones((4, 256, 256))
c = jax.jit(jax.grad(step, argnums=1)).lower(x, w).compile()
print(c.memory_analysis().temp_size_in_bytes)
"""


def test_the_arena_and_its_peak_are_read_from_the_dump(tmp_path):
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": f"--xla_dump_to={tmp_path} --xla_dump_hlo_pass_re=NONE"}
    out = subprocess.run([sys.executable, "-c", PROGRAM], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    temp = int(out.stdout.split()[-1])
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    try:
        import xla_buffers  # heavy: from scripts/, on sys.path only around this import
    finally:
        sys.path.pop(0)
    arena_path, range_path = xla_buffers.find_dump(str(tmp_path), "jit_step")
    size, buffers = xla_buffers.live_buffers(arena_path, range_path)
    assert size == temp
    peak = max(xla_buffers.occupied(buffers, t) for t in range(max(b for *_, b in buffers) + 1))
    assert 0 < peak <= size
    assert xla_buffers.main([str(tmp_path), "--min-mib", "0"]) == 0
    assert xla_buffers.main([str(tmp_path / "missing")]) == 2
    assert xla_buffers.main([str(tmp_path), "--at", "-1"]) == 2
