"""Reading compiled HLO: collectives, where they sit (inside which loop) and their bytes.

Used by tests and ``scripts/zero_report.py`` to check what XLA emitted against the ZeRO formulas (docs/zero.md) —
e.g. that ZeRO-0/1 reduce gradients once per step (outside the microbatch loop) and ZeRO-2/3
keep a 1/N gradient buffer across microbatches.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

COLLECTIVES = ("all-reduce", "reduce-scatter", "all-gather", "all-to-all", "collective-permute")
_DTYPE_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "pred": 1, "s8": 1, "u8": 1, "f64": 8, "s64": 8,
                "u16": 2, "s16": 2, "f8e4m3fn": 1, "f8e5m2": 1}
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
_SHAPE = re.compile(r"\b(f32|bf16|f16|s32|u32|pred|s8|u8|f64|s64|u16|s16|f8e4m3fn|f8e5m2)\[([\d,]*)\]")
_CALLS = re.compile(r"(?:body|condition|to_apply|calls|true_computation|false_computation|branch_computations)=\{?%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")


def callees(line: str) -> list[str]:
    """The computations an HLO line calls: loop bodies and conditions, fusions, reducers, and every
    branch of a ``conditional`` (each of ``branch_computations={%a, %b, ...}``)."""
    out = _CALLS.findall(line)
    return out + [b for b in branches(line) if b not in out]


def branches(line: str) -> list[str]:
    """The branch computations of a ``conditional`` line (empty for any other line)."""
    m = _BRANCHES.search(line)
    if m:
        return [x.strip().lstrip("%") for x in m.group(1).split(",") if x.strip()]
    t, f = re.search(r"true_computation=%?([\w.\-]+)", line), re.search(r"false_computation=%?([\w.\-]+)", line)
    return [x.group(1) for x in (t, f) if x]


@dataclass(frozen=True)
class Collective:
    """One collective instruction: its kind, result shapes ``[(dtype, dims)]``, and computation."""

    kind: str
    shapes: tuple
    computation: str
    line: str

    @property
    def bytes(self) -> int:
        return sum(_DTYPE_BYTES[d] * math.prod(s) for d, s in self.shapes)

    @property
    def max_elements(self) -> int:
        return max((math.prod(s) for _, s in self.shapes), default=0)

    @property
    def group(self) -> int | None:
        """Devices in each replica group (None when the line does not say)."""
        return group_size(self.line)

    @property
    def sent(self) -> float:
        """Bytes each device sends, with the ring algorithms' counts (result ``S`` bytes, group
        ``n``): all-reduce ``2(n−1)/n·S``, all-gather and all-to-all ``(n−1)/n·S``,
        reduce-scatter ``(n−1)·S``, collective-permute ``S``. Unknown group: ``S``."""
        n, b = self.group, self.bytes
        if n is None or self.kind == "collective-permute":
            return float(b)
        return {"all-reduce": 2 * (n - 1) / n * b, "all-gather": (n - 1) / n * b, "all-to-all": (n - 1) / n * b,
                "reduce-scatter": (n - 1) * b}[self.kind]


_RG_LIST = re.compile(r"replica_groups=\{\{([\d,]*)\}")
_RG_IOTA = re.compile(r"replica_groups=\[(\d+),(\d+)\]")
_RG_MESH = re.compile(r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\S+)?\s*\{([^}]*)\}")


def group_size(line: str) -> int | None:
    """The replica-group size of a collective's HLO line, in each of XLA's three spellings:
    ``{{0,1,2,3},...}``, ``[groups,size]<=[...]`` and ``mesh['a'=8,'b'=1] {'a'}`` (with or without
    a ``device_ids=(...)`` between the mesh and the axes)."""
    m = _RG_LIST.search(line)
    if m:
        return len([x for x in m.group(1).split(",") if x])
    m = _RG_IOTA.search(line)
    if m:
        return int(m.group(2))
    m = _RG_MESH.search(line)
    if m:
        sizes = {k.strip("' "): int(v) for k, v in (kv.split("=") for kv in m.group(1).split(","))}
        return math.prod(sizes[a.strip("' ")] for a in m.group(2).split(",") if a.strip())
    return None


def computations(hlo: str) -> tuple[dict[str, list[str]], str]:
    """Split HLO text into ``{computation name: lines}`` and return the ENTRY name too."""
    comps, entry, cur = {}, None, None
    for line in hlo.splitlines():
        m = _HEADER.match(line)
        if m:
            cur = m.group(2)
            comps[cur] = []
            if m.group(1):
                entry = cur
        elif cur is not None:
            comps[cur].append(line)
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    return comps, entry


_OP = re.compile(r" (all-reduce|reduce-scatter|all-gather|all-to-all|collective-permute)(-start)?\(")


def _tuple_elements(text: str) -> list[str]:
    """The top-level elements of a tuple shape ``(a, (b, c), d)`` (the text itself if not a tuple)."""
    text = text.strip()
    if not text.startswith("("):
        return [text]
    out, depth, cur = [], 0, ""
    for ch in text[1:]:
        if ch in "({[":
            depth += 1
        elif ch in ")}]":
            if depth == 0:
                break
            depth -= 1
        if ch == "," and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += ch
    return out + [cur]


def result_shapes(line: str) -> tuple:
    """The result shapes ``((dtype, dims), ...)`` of a collective's HLO line. An async
    ``*-start`` of an all-gather, reduce-scatter, all-to-all or collective-permute returns
    ``(operands, results[, contexts])`` (XLA:GPU): its results are the second element; an
    ``all-reduce-start`` returns its results alone."""
    lhs = line.split("=", 1)[1]
    m = _OP.search(lhs)
    shape_text = lhs[: m.start()] if m else lhs
    if m and m.group(2) and m.group(1) != "all-reduce":
        parts = _tuple_elements(shape_text)
        shape_text = parts[1] if len(parts) > 1 else parts[0]
    return tuple((d, tuple(int(x) for x in s.split(",") if x)) for d, s in _SHAPE.findall(shape_text))


def collectives_in(comps: dict, name: str, seen: set | None = None) -> list[Collective]:
    """Collectives in computation ``name`` and everything it calls (loops, fusions, branches)."""
    seen = set() if seen is None else seen
    if name in seen or name not in comps:
        return []
    seen.add(name)
    out = []
    for line in comps[name]:
        for kind in COLLECTIVES:
            if f" {kind}(" in line or f" {kind}-start(" in line:
                out.append(Collective(kind, result_shapes(line), name, line.strip()))
        for callee in callees(line):
            out.extend(collectives_in(comps, callee, seen))
    return out


def while_loops(comps: dict, name: str) -> list[tuple[str, str]]:
    """``(body name, carry-shape text)`` of each while loop directly in computation ``name``."""
    loops = []
    for line in comps[name]:
        if " while(" in line:
            body = re.search(r"body=%?([\w.\-]+)", line).group(1)
            carry = line.split("=", 1)[1].split(" while(")[0]
            loops.append((body, carry))
    return loops


def top_level_collectives(comps: dict, entry: str) -> list[Collective]:
    """Collectives in the ENTRY computation outside every loop body."""
    bodies = {b for b, _ in while_loops(comps, entry)}
    out = []
    for line in comps[entry]:
        for kind in COLLECTIVES:
            if f" {kind}(" in line or f" {kind}-start(" in line:
                out.append(Collective(kind, result_shapes(line), entry, line.strip()))
        if " while(" not in line:
            for callee in callees(line):
                if callee not in bodies:
                    out.extend(collectives_in(comps, callee, set(bodies)))
    return out


_TRIP = re.compile(r'known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"')


def walk_executions(hlo_text: str):
    """Yield ``(computation name, lines, executions per step)`` for every computation reachable
    from ENTRY, loop bodies multiplied out by their ``known_trip_count`` (a loop without one
    counts once). A computation called from several places is yielded once per call site; every
    branch of a ``conditional`` is yielded as if it ran (:func:`collective_totals` and
    :func:`dot_flops` take the costliest branch instead).

    XLA's ``cost_analysis()`` counts a ``while`` body once; this is what it leaves out.
    """
    comps, entry = computations(hlo_text)

    def walk(name: str, times: int, stack: tuple):
        if name in stack or name not in comps:
            return
        yield name, comps[name], times
        for line in comps[name]:
            trip = _TRIP.search(line)
            mult = int(trip.group(1)) if (" while(" in line and trip) else 1
            for callee in callees(line):
                yield from walk(callee, times * mult, stack + (name,))

    yield from walk(entry, 1, ())


def _per_step(hlo_text: str, count, start: str | None = None) -> dict:
    """``{key: amount per step}``: ``count(computation, line) -> {key: amount}`` summed over every instruction
    reachable from ENTRY, loop bodies multiplied by their ``known_trip_count`` (once without one),
    and for a ``conditional`` the costliest branch per key (a static upper bound: one branch runs).
    ``start``: count from this computation instead of ENTRY (one execution of it)."""
    comps, entry = computations(hlo_text)

    def total(name: str, stack: tuple) -> dict:
        out: dict = {}
        if name in stack or name not in comps:
            return out
        for line in comps[name]:
            for key, v in count(name, line).items():
                out[key] = out.get(key, 0) + v
            alts = branches(line) if " conditional(" in line else []
            trip = _TRIP.search(line)
            mult = int(trip.group(1)) if (" while(" in line and trip) else 1
            for callee in callees(line):
                if callee in alts:
                    continue
                for key, v in total(callee, stack + (name,)).items():
                    out[key] = out.get(key, 0) + mult * v
            if alts:
                worst: dict = {}
                for b in alts:
                    for key, v in total(b, stack + (name,)).items():
                        worst[key] = max(worst.get(key, 0), v)
                for key, v in worst.items():
                    out[key] = out.get(key, 0) + v
        return out

    return total(start or entry, ())


def collective_totals(hlo_text: str, min_elements: int = 64, start: str | None = None) -> dict[str, dict[str, int]]:
    """Per-step totals by collective kind, loops multiplied out by their known trip counts.

    Returns ``{kind: {"count": executions per step, "elements": result elements moved per step,
    "bytes": result bytes per step, "sent": bytes each device sends per step}}`` (``sent``:
    :attr:`Collective.sent`, rounded), ignoring collectives smaller than ``min_elements``
    (scalars such as the loss). A loop without a known trip count counts once; a ``conditional``
    counts its costliest branch (per figure). ``start``: one execution of that computation instead
    of the program (:func:`decode_loop_collectives`).
    """
    def count(name: str, line: str) -> dict:
        for kind in COLLECTIVES:
            if f" {kind}(" in line or f" {kind}-start(" in line:
                c = Collective(kind, result_shapes(line), name, line.strip())
                if c.max_elements >= min_elements:
                    return {(kind, "count"): 1, (kind, "elements"): sum(math.prod(s) for _, s in c.shapes),
                            (kind, "bytes"): c.bytes, (kind, "sent"): c.sent}
        return {}

    totals: dict[str, dict[str, int]] = {}
    for (kind, key), v in _per_step(hlo_text, count, start).items():
        totals.setdefault(kind, {"count": 0, "elements": 0, "bytes": 0, "sent": 0.0})[key] = v
    for t in totals.values():
        t["sent"] = round(t["sent"])
    return totals


def decode_loop_collectives(hlo_text: str, min_elements: int = 64) -> dict[str, dict[str, int]]:
    """The collectives of one iteration of a sampler's decode loop: each ``while`` loop of the ENTRY
    computation without a known trip count (a ``lax.while_loop`` that stops at the end-of-text ids),
    its body counted once as :func:`collective_totals` counts (the nested layer scan multiplied out by
    its trip count), summed over such loops; ``{}`` when the program has none."""
    comps, entry = computations(hlo_text)
    out: dict[str, dict[str, int]] = {}
    for line in comps[entry]:
        if " while(" not in line or _TRIP.search(line):
            continue
        body = re.search(r"body=%?([\w.\-]+)", line).group(1)
        for kind, t in collective_totals(hlo_text, min_elements, start=body).items():
            acc = out.setdefault(kind, {"count": 0, "elements": 0, "bytes": 0, "sent": 0})
            for k, v in t.items():
                acc[k] += v
    return out


_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(?:\w+)\[([\d,]*)\]")
_DOT = re.compile(r"\bdot\((?:\w+\[([\d,]*)\]\S*\s+)?%?([\w.\-]+)")
_LHS_CONTRACT = re.compile(r"lhs_contracting_dims=\{([\d,]*)\}")


def _dims(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x)


_CUBLAS = ("__cublas$gemm", "__cublas$lt$matmul", "__cublas$lt$matmul$f8")
_FMHA = re.compile(r'custom_call_target="__cudnn\$fmha(\w*)"')
_TARGET = re.compile(r'custom_call_target="([^"]+)"')
_OPERANDS = re.compile(r"\b(?:dot|custom-call)\(([^)]*)\)")


def _operand_dims(shapes: dict, line: str, i: int) -> tuple[int, ...] | None:
    """The dims of a ``dot``/``custom-call`` line's ``i``-th operand (inline or by name)."""
    m = _OPERANDS.search(line)
    if not m:
        return None
    ops = [o.strip() for o in m.group(1).split("%") if o.strip()] if "[" not in m.group(1) else None
    if ops is None:  # operands printed with their shapes: f32[4,8]{1,0} %a, ...
        found = re.findall(r"\w+\[([\d,]*)\][^%]*%([\w.\-]+)", m.group(1))
        return _dims(found[i][0]) if i < len(found) else None
    return shapes.get(ops[i].rstrip(", ")) if i < len(ops) else None


def _fmha_flops(line: str) -> int:
    """FLOPs of a cuDNN fused-attention call: the forward's two matmuls ``4·b·h·tq·tk·d`` (half with
    a causal mask), the backward's five ``2.5×`` that (the scores recomputed, dP, dV, dQ, dK)."""
    inter = re.search(r'"intermediate_tensor_shape":\s*\{[^}]*?"dimensions":\s*\[([^\]]*)\]', line)
    q = re.search(r"operand_layout_constraints=\{\w+\[([\d,]*)\]", line)
    if not inter or not q:
        return 0
    bhst = math.prod(int(x.strip().strip('"')) for x in inter.group(1).split(",") if x.strip())
    fwd = 4 * bhst * _dims(q.group(1))[-1] * (0.5 if '"mask_type": "CAUSAL"' in line or '"mask_type":"CAUSAL"' in line
                                                else 1)
    return int(fwd * (2.5 if "Backward" in _FMHA.search(line).group(1) else 1))


def instruction_flops(shapes: dict, line: str) -> int:
    """Matmul FLOPs of one HLO instruction line, by itself (a fusion's or loop's callees not
    followed): a ``dot`` ``2·(result elements)·(lhs contracting dims)``; a cuBLAS GEMM custom call
    the same from its ``dot_dimension_numbers``; a cuDNN fused attention (:func:`_fmha_flops`);
    0 otherwise (elementwise work, Triton kernels). ``shapes``: ``{name: dims}`` of the
    computation's instructions.

    Raises:
        ValueError: a ``dot`` whose left operand's shape cannot be found.
    """
    if " dot(" in line:
        m, d = _INSTR.match(line), _DOT.search(line)
        lhs = _dims(d.group(1)) if d.group(1) is not None else shapes.get(d.group(2))
        if lhs is None:
            raise ValueError(f"cannot find the shape of dot operand {d.group(2)!r}")
        contract = _dims(_LHS_CONTRACT.search(line).group(1))
        return 2 * math.prod(_dims(m.group(2))) * math.prod(lhs[i] for i in contract)
    if " custom-call(" not in line:
        return 0
    target = _TARGET.search(line)
    if target and target.group(1) in _CUBLAS:
        out = _SHAPE.search(line.split("=", 1)[1])
        lhs = _operand_dims(shapes, line, 0)
        contract = re.search(r'"lhs_contracting_dimensions":\s*\[([^\]]*)\]', line)
        if out is None or lhs is None or contract is None:
            return 0
        k = math.prod(lhs[int(x.strip().strip('"'))] for x in contract.group(1).split(",") if x.strip())
        return 2 * math.prod(_dims(out.group(2))) * k
    if target and _FMHA.search(line):
        return _fmha_flops(line)
    return 0


def instruction_shapes(comps: dict) -> dict[str, dict]:
    """``{computation: {instruction name: dims}}`` of every array-valued instruction."""
    return {name: {m.group(1): _dims(m.group(2)) for m in map(_INSTR.match, lines) if m}
            for name, lines in comps.items()}


def dot_flops(hlo_text: str) -> dict[str, int]:
    """Matmul FLOPs of one execution of a compiled program, loops multiplied out by trip count.

    Each ``dot`` counts ``2 · (result elements) · (product of the lhs contracting dims)``, the
    convention of the model-FLOP formulas (:mod:`jaxcolossal.metrics`); so do XLA:GPU's cuBLAS
    GEMM custom calls, and cuDNN's fused attention its matmuls (:func:`instruction_flops`);
    elementwise work is not counted; a ``conditional`` counts its costliest branch. Returns
    ``{"flops": total, "dots": matmul executions per step}``.

    Raises:
        ValueError: a ``dot`` whose left operand's shape cannot be found.
    """
    comps, _ = computations(hlo_text)
    shapes = instruction_shapes(comps)

    def count(name: str, line: str) -> dict:
        f = instruction_flops(shapes[name], line)
        return {"flops": f, "dots": 1} if f else {}

    out = _per_step(hlo_text, count)
    return {"flops": out.get("flops", 0), "dots": out.get("dots", 0)}


_TYPED = re.compile(r"\s*(?:ROOT )?%([\w.\-]+) = (\w+)\[")
FP8_GEMM_CALL = "__cublas$lt$matmul$f8"
"""XLA:GPU's cuBLASLt FP8 GEMM custom call (Hopper and later)."""


def fp8_matmuls(hlo_text: str) -> dict[str, int]:
    """Matmul executions per step by their inputs, loops multiplied out: ``{"fp8": dots whose
    operands are FP8 (e4m3/e5m2), "cublaslt": of those, cuBLASLt FP8 GEMM calls
    (:data:`FP8_GEMM_CALL`), "fusion": of those, dots in XLA's GEMM fusions (Triton), "other":
    every other matmul}``. A ``conditional`` counts its costliest branch per key."""
    comps, _ = computations(hlo_text)
    types = {name: {m.group(1): m.group(2) for m in map(_TYPED.match, lines) if m} for name, lines in comps.items()}

    def count(name: str, line: str) -> dict:
        if " custom-call(" in line and FP8_GEMM_CALL + '"' in line:
            return {"fp8": 1, "cublaslt": 1}
        if " custom-call(" in line and ("__cublas$gemm" in line or "__cublas$lt$matmul" in line):
            return {"other": 1}
        m = re.search(r" dot\(([^)]*)\)", line)
        if not m:
            return {}
        operands = re.findall(r"%([\w.\-]+)", m.group(1))
        fp8 = any(types[name].get(o, "").startswith("f8") for o in operands)
        return {"fp8": 1, "fusion": 1} if fp8 else {"other": 1}

    out = _per_step(hlo_text, count)
    return {k: out.get(k, 0) for k in ("fp8", "cublaslt", "fusion", "other")}


_HOST_SHAPE = re.compile(r"\b(f32|bf16|f16|s32|u32|pred|s8|u8|f64|s64|u16|s16|f8e4m3fn|f8e5m2)\[([\d,]*)\]\{[^}]*S\(5\)[^}]*\}")


def _balanced(text: str, start: int) -> str:
    """The text inside the parentheses that open at ``text[start]``."""
    depth = 0
    for i in range(start, len(text)):
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        if depth == 0:
            return text[start + 1:i]
    return text[start + 1:]


def host_io_bytes(hlo_text: str) -> dict[str, int]:
    """Per-device bytes of a compiled module's arguments and results in host memory (memory space
    ``S(5)``, JAX's ``pinned_host``), read from its ``entry_computation_layout``:
    ``{"host_arguments", "host_results"}``. With ``offload.optimizer_device=device`` these are the
    bytes the step moves from host to device and back; with ``host`` the host computation reads and
    writes them in place and only gradients and compute params cross."""
    first = hlo_text.split("\n", 1)[0]
    at = first.find("entry_computation_layout={(")
    if at < 0:
        return {"host_arguments": 0, "host_results": 0}
    start = first.index("(", at)
    args = _balanced(first, start)
    rest = first[start + len(args) + 2:]
    results = _balanced(rest, rest.index("(")) if rest.startswith("->(") else rest[2:].split("}", 1)[0]
    return {"host_arguments": _host_bytes(args), "host_results": _host_bytes(results)}


def _host_bytes(part: str) -> int:
    """Bytes of the pinned-host shapes in a part of an entry computation layout."""
    return sum(_DTYPE_BYTES[d] * math.prod(_dims(s)) for d, s in _HOST_SHAPE.findall(part))


def dataflow(lines: list[str]) -> tuple[dict[str, str], dict[str, list[str]]]:
    """One computation's ``(name -> defining line, name -> operand names)`` (operands within the
    computation; called computations are not followed)."""
    defs, operands = {}, {}
    for line in lines:
        m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = [^(]*?\b[\w\-]+\((.*)", line)
        if not m:
            continue
        defs[m.group(1)] = line
        args = m.group(2).split("calls=")[0].split("to_apply=")[0]
        operands[m.group(1)] = re.findall(r"%([\w.\-]+)", args)
    return defs, operands


def _is_matmul(comps: dict, line: str) -> bool:
    if re.search(r" (dot|convolution)\(", line):
        return True
    call = re.search(r"calls=%?([\w.\-]+)", line)
    return bool(call) and any(re.search(r" (dot|convolution)\(", x) for x in comps.get(call.group(1), []))


def concurrent_matmuls(comps: dict, name: str, kind: str) -> list[int]:
    """For each ``kind`` collective (e.g. ``collective-permute``) directly in computation
    ``name``: how many matmuls there (dots, or fusions holding one) are neither its ancestors nor
    its descendants, i.e. could run while the transfer is in flight. 0 means the collective and
    the matmuls are serial (the collective waits for them or they wait for it)."""
    defs, operands = dataflow(comps[name])
    users: dict[str, list[str]] = {}
    for n, args in operands.items():
        for a in args:
            users.setdefault(a, []).append(n)

    def closure(start, edges):
        seen, todo = set(), [start]
        while todo:
            for m in edges.get(todo.pop(), []):
                if m not in seen:
                    seen.add(m)
                    todo.append(m)
        return seen

    dots = {n for n, line in defs.items() if _is_matmul(comps, line)}
    out = []
    for n, line in defs.items():
        if re.search(rf" {kind}(-start)?\(", line):
            related = closure(n, operands) | closure(n, users)
            out.append(len(dots - related - {n}))
    return out
