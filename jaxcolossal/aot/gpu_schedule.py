"""What a compiled GPU program's schedule says about communication: the async collectives, the
compute XLA scheduled between each start and its done, and how much of the transfer that hides.

XLA:GPU compiles each collective it can overlap as a pair ``*-start`` / ``*-done``. The compiled
module is *scheduled* (``is_scheduled=true``): the order of a computation's instructions is the
order they are issued in. Whatever sits between a start and its done runs while the transfer is
in flight. This module reads that from the HLO text (no device, no profile):

* :func:`async_pairs` lists every pair with its bytes, its replica group, whether the group
  crosses hosts, and the matmul FLOPs scheduled between start and done (loops inside the window
  multiplied out by their trip counts);
* :func:`exposure` turns them into times with a target's figures, on a timeline of each
  computation in its scheduled order: the compute stream runs the matmuls at the dense bf16 peak,
  one collective stream runs the transfers one after another at ``sent / bandwidth`` (NVLink
  inside a host, the network across), and a ``*-done`` whose transfer has not ended stalls the
  compute stream. The stalls are the *exposed* communication per step; the rest of the transfer
  time is hidden. An estimate: the links at their datasheet bandwidth, no latency, elementwise
  work left out (so a window holds a little more time than counted), nothing autotuned.

Collectives XLA did not make async (or marked ``is_sync``) count as fully exposed.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import numpy as np

from jaxcolossal.aot import hlo

_START = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=.*? (all-reduce|reduce-scatter|all-gather|all-to-all|"
                    r"collective-permute)-start\(")
_SYNC_OP = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=.*? (all-reduce|reduce-scatter|all-gather|all-to-all|"
                      r"collective-permute)\(")
_TRIP = re.compile(r'known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"')


@dataclass(frozen=True)
class Pair:
    """One collective as scheduled: an async ``start``/``done`` pair, or a synchronous op.

    Attributes:
        kind: ``all-gather``, ``reduce-scatter``, ``all-reduce``, ``all-to-all``, ``collective-permute``.
        name: the instruction's name (the start's).
        computation: the computation it sits in.
        executions: times it runs per step (enclosing loops' trip counts multiplied).
        sent: bytes each device sends per execution (:attr:`jaxcolossal.aot.hlo.Collective.sent`).
        group: devices in its replica group (``None`` when the HLO does not say).
        cross_host: its group spans more than one host.
        flops_between: matmul FLOPs scheduled between start and done, per execution.
        between: instructions between start and done.
        asynchronous: an async pair that XLA did not mark ``is_sync``.
    """

    kind: str
    name: str
    computation: str
    executions: int
    sent: float
    group: int | None
    cross_host: bool
    flops_between: float
    between: int
    asynchronous: bool


def _group_devices(line: str) -> list[int] | None:
    """The device ids of the first replica group of a collective line, in XLA's three spellings
    (explicit lists, iota ``[g,s]<=[dims]T(perm)``, and ``mesh[...] {axes}``)."""
    m = re.search(r"replica_groups=\{\{([\d,]*)\}", line) or re.search(r"source_target_pairs=\{\{([\d,]*)\}", line)
    if m:
        return [int(x) for x in m.group(1).split(",") if x]
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line)
    if m:
        ids = np.arange(math.prod(int(x) for x in m.group(3).split(","))).reshape(
            [int(x) for x in m.group(3).split(",")])
        if m.group(4):
            ids = ids.transpose([int(x) for x in m.group(4).split(",")])
        return ids.reshape(int(m.group(1)), int(m.group(2)))[0].tolist()
    m = re.search(r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\S+)?\s*\{([^}]*)\}", line)
    if m:
        sizes = [(k.strip("' "), int(v)) for k, v in (kv.split("=") for kv in m.group(1).split(","))]
        chosen = {a.strip("' ") for a in m.group(2).split(",") if a.strip()}
        ids = np.arange(math.prod(s for _, s in sizes)).reshape([s for _, s in sizes])
        index = tuple(slice(None) if k in chosen else 0 for k, _ in sizes)
        return ids[index].ravel().tolist()
    return None


def crosses_hosts(line: str, devices_per_host: int) -> bool:
    """Whether a collective's (first) group holds devices of more than one host, hosts being runs of
    ``devices_per_host`` consecutive device ids (the mesh's process-major order)."""
    ids = _group_devices(line)
    return bool(ids) and len({i // devices_per_host for i in ids}) > 1


class _Flops:
    """Matmul FLOPs of instructions, following fusions, calls and loops (memoised per computation)."""

    def __init__(self, comps: dict):
        self.comps, self.shapes, self.memo = comps, hlo.instruction_shapes(comps), {}

    def line(self, name: str, line: str) -> float:
        own = hlo.instruction_flops(self.shapes.get(name, {}), line)
        if " while(" in line:
            body = re.search(r"body=%?([\w.\-]+)", line)
            trip = _TRIP.search(line)
            return own + (self.computation(body.group(1)) * (int(trip.group(1)) if trip else 1) if body else 0)
        if " conditional(" in line:
            return own + max((self.computation(b) for b in hlo.branches(line)), default=0)
        return own + sum(self.computation(c) for c in hlo.callees(line) if c in self.comps
                         and not re.search(rf"to_apply=%?{re.escape(c)}\b", line))

    def computation(self, name: str) -> float:
        if name not in self.memo:
            self.memo[name] = 0.0  # a cycle counts nothing
            self.memo[name] = sum(self.line(name, l) for l in self.comps.get(name, []))
        return self.memo[name]


def _pairs_in(name: str, lines: list[str], times: int, flops: _Flops, per_host: int) -> list[Pair]:
    out = []
    for i, line in enumerate(lines):
        start, sync = _START.match(line), None if _START.match(line) else _SYNC_OP.match(line)
        if not (start or sync):
            continue
        kind, inst = (start or sync).group(2), (start or sync).group(1)
        c = hlo.Collective(kind, hlo.result_shapes(line), name, line.strip())
        window, between = 0.0, 0
        if start:
            done = next((j for j in range(i + 1, len(lines)) if re.search(rf"-done\(%?{re.escape(inst)}\)", lines[j])),
                        i)
            between = max(done - i - 1, 0)
            window = sum(flops.line(name, l) for l in lines[i + 1:done])
        out.append(Pair(kind, inst, name, times, c.sent, c.group, crosses_hosts(line, per_host), window, between,
                        asynchronous=bool(start) and '"is_sync":true' not in line.replace(" ", "")))
    return out


def async_pairs(hlo_text: str, devices_per_host: int = 8) -> list[Pair]:
    """Every collective of a compiled (scheduled) program, as a :class:`Pair`, with its executions per
    step. Computations reached from several call sites (or the branches of a ``conditional``) are
    listed once per site, each as if it ran."""
    comps, _ = hlo.computations(hlo_text)
    flops = _Flops(comps)
    out = []
    for name, lines, times in hlo.walk_executions(hlo_text):
        out.extend(_pairs_in(name, lines, times, flops, devices_per_host))
    return out


@dataclass
class Exposure:
    """Communication time per step by collective kind (seconds), from :func:`exposure`."""

    by_kind: dict = field(default_factory=dict)
    """``{kind: {"count", "async", "sent", "time_s", "exposed_s", "hidden_s"}}``."""

    @property
    def time_s(self) -> float:
        return sum(v["time_s"] for v in self.by_kind.values())

    @property
    def exposed_s(self) -> float:
        return sum(v["exposed_s"] for v in self.by_kind.values())

    @property
    def hidden_s(self) -> float:
        return self.time_s - self.exposed_s

    @property
    def hidden_fraction(self) -> float:
        """The share of the communication time that scheduled compute hides (1 when there is none)."""
        return self.hidden_s / self.time_s if self.time_s else 1.0


@dataclass
class _Clock:
    """One computation's timeline: the compute stream's time, when the one collective stream is
    free, and the transfers in flight (their end times)."""

    t: float = 0.0
    comm_free: float = 0.0
    ends: dict = field(default_factory=dict)


def _simulate(lines: list[str], pairs: dict, flops: _Flops, name: str, peak: float, bw) -> dict:
    """``{pair name: (transfer seconds, stalled seconds)}`` for one execution of a computation.

    The compute stream runs the instructions in their scheduled order, each its matmul FLOPs at
    ``peak`` (loops inside as their bodies × trip counts); a ``*-start`` queues its transfer on the
    single collective stream (``sent / bw(pair)``: NCCL runs one collective at a time on it); a
    ``*-done`` stalls the compute stream until its transfer has ended; a synchronous collective
    stalls it for the whole transfer."""
    clock, out = _Clock(), {}
    for line in lines:
        start, sync = _START.match(line), None if _START.match(line) else _SYNC_OP.match(line)
        op = start or sync
        if op and op.group(1) in pairs:
            p = pairs[op.group(1)]
            dur = p.sent / bw(p)
            begin = max(clock.t, clock.comm_free)
            clock.comm_free = begin + dur
            if start and p.asynchronous:
                clock.ends[p.name] = (clock.comm_free, dur)
            else:  # the compute stream waits for it
                out[p.name] = (dur, clock.comm_free - clock.t)
                clock.t = clock.comm_free
            continue
        done = re.search(r"-done\(%?([\w.\-]+)\)", line)
        if done and done.group(1) in clock.ends:
            end, dur = clock.ends.pop(done.group(1))
            out[done.group(1)] = (dur, max(0.0, end - clock.t))
            clock.t = max(clock.t, end)
            continue
        clock.t += flops.line(name, line) / peak
    for inst, (end, dur) in clock.ends.items():  # a start without its done here: waited for at the end
        out[inst] = (dur, max(0.0, end - clock.t))
    return out


def exposure(hlo_text: str, peak_flops: float, intra_bw: float, inter_bw: float, devices_per_host: int = 8,
             min_bytes: float = 4096) -> Exposure:
    """Per kind: the collectives' transfer time per step and the part of it the compute stream waits
    for, from a timeline of each computation as XLA scheduled it (:func:`_simulate`): transfers at
    ``inter_bw`` when the group crosses hosts, else ``intra_bw`` (bytes/s per device per direction),
    the matmuls at ``peak_flops``, elementwise work and latency left out, one collective in flight
    at a time. Collectives sending under ``min_bytes`` per execution (the loss, the norms) are
    left out. An estimate of exposed communication, not a measurement: see the module doc."""
    comps, _ = hlo.computations(hlo_text)
    flops = _Flops(comps)

    def bw(p):  # the bandwidth of a collective's group
        return inter_bw if p.cross_host else intra_bw

    out = Exposure()
    for name, lines, times in hlo.walk_executions(hlo_text):
        pairs = {p.name: p for p in _pairs_in(name, lines, times, flops, devices_per_host) if p.sent >= min_bytes}
        if not pairs:
            continue
        for inst, (dur, stall) in _simulate(lines, pairs, flops, name, peak_flops, bw).items():
            p = pairs[inst]
            k = out.by_kind.setdefault(p.kind, {"count": 0, "async": 0, "sent": 0.0, "time_s": 0.0, "exposed_s": 0.0,
                                                "hidden_s": 0.0})
            k["count"] += times
            k["async"] += times if p.asynchronous else 0
            k["sent"] += p.sent * times
            k["time_s"] += dur * times
            k["exposed_s"] += min(stall, dur) * times
            k["hidden_s"] = k["time_s"] - k["exposed_s"]
    return out


def custom_calls(hlo_text: str) -> dict[str, int]:
    """``{custom-call target: executions per step}`` of a compiled program (cuDNN attention, Triton
    kernels, cuBLAS GEMMs, ...), loops multiplied out."""
    out: dict[str, int] = {}
    for _, lines, times in hlo.walk_executions(hlo_text):
        for line in lines:
            m = re.search(r'custom_call_target="([^"]+)"', line)
            if m and " custom-call(" in line:
                out[m.group(1)] = out.get(m.group(1), 0) + times
    return out
