"""``parallel.overlap`` on against off, read from XLA's GPU schedule, side by side in one run.

    python scripts/gpu_overlap.py                                    # the 1B and 7B presets on 8 H200
    python scripts/gpu_overlap.py --fleet h100x16 --presets llama_1b --set parallel.zero_stage=3

For each preset (``configs/bench/<name>.yaml``) and each layout of ``--layouts``, it compiles the
real train step for the fleet with XLA's GPU compiler (no GPU needed; :mod:`jaxcolossal.aot`),
once with ``parallel.overlap=false`` and once with ``true``, and prints per row: the collectives'
time per step at link bandwidth, the share of it that the compute XLA scheduled between each
async start and done hides (at the matmul peak), the exposed time, the compiled peak memory, and
the ratio on/off of the exposed time. The exposure model and its limits: :mod:`jaxcolossal.aot.gpu_schedule`.
A compiled estimate, not a timing: nothing runs.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

LAYOUTS = {  # name: overrides on top of the preset
    "preset": [],
    "zero3": ["parallel.zero_stage=3", "parallel.data_parallel_size=-1"],
    "tp2-sp": ["parallel.tensor_parallel_size=2", "parallel.sequence_parallelism_mode=split_gather",
               "parallel.data_parallel_size=-1"],
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fleet", default="h200x8", help="TARGETxCOUNT (default h200x8)")
    ap.add_argument("--presets", default="llama_1b,llama2_7b", help="configs/bench presets, comma-separated")
    ap.add_argument("--layouts", default="preset,zero3", help=f"comma-separated, of {', '.join(LAYOUTS)}")
    ap.add_argument("--set", nargs="*", default=[], help="more overrides for every row")
    a = ap.parse_args(argv)
    from jaxcolossal.aot import fleet, target  # heavy: jax and XLA's GPU compiler tools, after argparse
    target.prepare_environment()
    from jaxcolossal.config import load_config  # heavy: after target.prepare_environment() above
    gpu, n = target.parse_fleet(a.fleet)
    bad = [x for x in a.layouts.split(",") if x not in LAYOUTS]
    if bad:
        ap.error(f"--layouts: unknown {bad}; known: {', '.join(LAYOUTS)}")
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "configs", "bench")
    print(f"{n} × {gpu.description}: parallel.overlap off | on, per step, compiled (no GPU)")
    print("| preset | layout | overlap | collectives | hidden | exposed | peak memory | exposed on/off |")
    print("|---|---|---|---|---|---|---|---|")
    for preset in a.presets.split(","):
        for layout in a.layouts.split(","):
            rows = {}
            for overlap in (False, True):
                cfg = load_config(os.path.join(root, f"{preset}.yaml"),
                                  LAYOUTS[layout] + a.set + [f"parallel.overlap={str(overlap).lower()}"])
                rows[overlap] = fleet.compile_for(cfg, gpu, n, keep_hlo=False)
            for overlap, fc in rows.items():
                e = fc.exposure
                ratio = (f"{e.exposed_s / rows[False].exposure.exposed_s:.2f}"
                         if overlap and rows[False].exposure.exposed_s else "")
                print(f"| {preset} | {layout} | {'on' if overlap else 'off'} | {e.time_s * 1e3:,.1f} ms | "
                      f"{e.hidden_fraction:.1%} | {e.exposed_s * 1e3:,.1f} ms | {fc.peak / 2**30:,.2f} GiB | {ratio} |",
                      flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
