"""What fills a compiled step's temporary memory at its peak, read from XLA's buffer assignment.

    XLA_FLAGS="--xla_dump_to=/tmp/dump --xla_dump_hlo_pass_re=NONE" \\
        python scripts/plan_vs_compiler.py --rows 17          # compile one layout, dumping its buffers
    python scripts/xla_buffers.py /tmp/dump                  # the arena, its peak and what is live there
    python scripts/xla_buffers.py /tmp/dump --min-mib 1 --at 443

XLA places every temporary buffer of a program at an offset in one preallocated arena (the
``preallocated-temp`` allocation of ``*-buffer-assignment.txt``; its size is
``memory_analysis().temp_size_in_bytes``), and ``*-live-range.txt`` gives each buffer's live
range in the program's schedule. This script joins the two: at each point of the schedule, the
bytes of the arena that live buffers occupy (buffers that share an offset are counted once), the
point where that is largest, how much of the arena is then unoccupied (the allocator's packing
waste), and the buffers live there, by offset. It is how docs/planner.md's memory model was read
off the compiler. The "Live ranges at N (peak)" list that XLA writes in the live-range file is not
this peak: it leaves out buffers that the arena holds (on XLA:CPU, loop-carried ones), so it
reads lower than the arena.

A diagnosis tool, not part of the library: the dump formats are XLA's and may change.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import sys

MIB = 2**20
VALUE = re.compile(r" value: <\d+ (\S+)(?: \(phi\))? @\d+> \(size=(\d+),offset=(\d+)\): (.*)")
RANGE = re.compile(r"\s+(\S+):(\d+)-(\d+)$")


def read_arena(path: str) -> tuple[int, list[tuple[str, int, int, str]]]:
    """The temp arena's size and its values ``(name, bytes, offset, shape)`` from a
    ``*-buffer-assignment.txt``. Raises ValueError when the file has no preallocated temp."""
    size, values, inside = None, [], False
    with open(path) as f:
        for line in f:
            if line.startswith("allocation"):
                inside = "preallocated-temp" in line
                if inside:
                    size = int(line.split("size ")[1].split(",")[0])
            elif inside and (m := VALUE.match(line)):
                values.append((m.group(1), int(m.group(2)), int(m.group(3)), m.group(4)))
    if size is None:
        raise ValueError(f"{path}: no preallocated-temp allocation")
    return size, values


def read_ranges(path: str) -> dict[str, tuple[int, int]]:
    """``{buffer name: (first, last)}`` schedule positions from a ``*-live-range.txt``."""
    ranges, inside = {}, False
    with open(path) as f:
        for line in f:
            if line.strip() == "BufferLiveRange:":
                inside = True
            elif inside and (m := RANGE.match(line)):
                ranges[m.group(1)] = (int(m.group(2)), int(m.group(3)))
            elif inside and "Live ranges at" in line:
                break
    return ranges


def live_buffers(arena_path: str, range_path: str) -> tuple[int, list[tuple[str, int, int, str, int, int]]]:
    """The arena's size and its values with live ranges: ``(name, bytes, offset, shape, first, last)``
    (values without a range, such as tuples of pointers, are left out)."""
    size, values = read_arena(arena_path)
    ranges = read_ranges(range_path)
    by_base: dict[str, list[tuple[int, int]]] = {}
    for k, r in ranges.items():
        by_base.setdefault(k.split("{")[0], []).append(r)
    out = []
    for name, nbytes, offset, shape in values:
        r = ranges.get(name) or ranges.get(name + "{}") or ranges.get(name.replace("{}", ""))
        if r is None and name in by_base:
            r = (min(a for a, _ in by_base[name]), max(b for _, b in by_base[name]))
        if r is not None:
            out.append((name, nbytes, offset, shape, r[0], r[1]))
    return size, out


def occupied(buffers, t: int) -> int:
    """Bytes of the arena covered by the buffers live at ``t`` (overlapping offsets counted once)."""
    total, end = 0, -1
    for lo, hi in sorted((o, o + n) for _, n, o, _, a, b in buffers if a <= t <= b):
        if hi > end:
            total += hi - max(lo, end)
            end = hi
    return total


def find_dump(directory: str, module: str) -> tuple[str, str]:
    """The buffer-assignment and live-range files of the largest dumped module whose name holds
    ``module``. Raises FileNotFoundError when there is none."""
    found = [f for f in glob.glob(os.path.join(directory, "*-buffer-assignment.txt")) if module in os.path.basename(f)]
    found = [f for f in found if os.path.exists(f[: -len("buffer-assignment.txt")] + "live-range.txt")]
    if not found:
        raise FileNotFoundError(f"no *{module}*-buffer-assignment.txt with its live-range file in {directory}: "
                                "compile with XLA_FLAGS=--xla_dump_to=DIR")
    best = max(found, key=lambda f: read_arena(f)[0] if _has_temp(f) else -1)
    return best, best[: -len("buffer-assignment.txt")] + "live-range.txt"


def _has_temp(path: str) -> bool:
    with open(path) as f:
        return any("preallocated-temp" in line for line in f)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dump", help="the --xla_dump_to directory")
    ap.add_argument("--module", default="jit_step", help="a part of the module's name (default: jit_step)")
    ap.add_argument("--at", type=int, help="list the buffers live at this schedule position (default: the peak)")
    ap.add_argument("--min-mib", type=float, default=0.1, help="list buffers of at least this size (MiB)")
    a = ap.parse_args(argv)
    if not os.path.isdir(a.dump):
        print(f"error: {a.dump} is not a directory: compile with XLA_FLAGS=--xla_dump_to={a.dump}", file=sys.stderr)
        return 2
    try:
        arena_path, range_path = find_dump(a.dump, a.module)
        size, buffers = live_buffers(arena_path, range_path)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    last = max((b for *_, b in buffers), default=0)
    usage = [occupied(buffers, t) for t in range(last + 1)]
    peak = max(range(last + 1), key=usage.__getitem__)
    print(f"{os.path.basename(arena_path)}")
    print(f"arena {size / MIB:.2f} MiB; occupied at its peak (schedule position {peak}) {usage[peak] / MIB:.2f} MiB; "
          f"unoccupied {(size - usage[peak]) / MIB:.2f} MiB ({size / max(usage[peak], 1) - 1:+.1%})")
    if a.at is not None and not 0 <= a.at <= last:
        print(f"error: --at {a.at}: the schedule has positions 0 to {last}", file=sys.stderr)
        return 2
    t = peak if a.at is None else a.at
    live = sorted((x for x in buffers if x[4] <= t <= x[5]), key=lambda x: x[2])
    print(f"live at {t}: {occupied(buffers, t) / MIB:.2f} MiB in {len(live)} buffers; those of {a.min_mib} MiB or more:")
    print("| offset MiB | MiB | buffer | live | shape |\n|---|---|---|---|---|")
    for name, nbytes, offset, shape, lo, hi in live:
        if nbytes >= a.min_mib * MIB:
            print(f"| {offset / MIB:.2f} | {nbytes / MIB:.2f} | {name} | {lo}-{hi} | {shape[:70]} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
