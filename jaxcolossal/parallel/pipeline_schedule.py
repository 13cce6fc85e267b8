"""Pipeline schedules as static tables: which microbatch and chunk each stage runs, forward and
backward, at each tick (GPipe, 1F1B, interleaved 1F1B), with their bubble and stash sizes.

The executor that runs a table is :mod:`jaxcolossal.parallel.pipeline_executor`; docs/pipeline.md has the
schedules' formulas and measurements.

Schedules (``p`` stages, ``m`` microbatches, ``v`` chunks per device):

* ``gpipe``: all forwards, then all backwards (autodiff of the forward scan);
  ``m·v + p − 1`` forward ticks; bubble ``(p − 1)/(m·v + p − 1)``.
* ``1f1b``: lock-step one forward and one backward slot per tick; stage ``s`` runs the forward of
  microbatch ``t − s`` and the backward of ``t − (2p − 2 − s)``; ``m + 2p − 2`` ticks, a stash of
  ``2p − 1`` stage inputs whatever ``m``; bubble ``(2p − 2)/(m + 2p − 2)``.
* ``interleaved``: the same lock-step over ``V = v·p`` virtual stages placed round-robin, in
  groups of ``p`` microbatches; ``m·v + (v + 1)·p − 2`` ticks; bubble
  ``((v + 1)·p − 2)/(m·v + (v + 1)·p − 2)``; a stash of ``2V − 1`` chunk inputs.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from jaxcolossal.config import Config, ConfigError, pipeline_microbatches

# table columns
VALID, MB, CHUNK, SLOT, FIRST, LAST = range(6)


# ----------------------------------------------------------------------------- schedule tables


@dataclass(frozen=True)
class PipelineSchedule:
    """A static schedule: what each of ``p`` devices runs at each of ``T`` ticks.

    Attributes:
        kind: ``"gpipe"``, ``"1f1b"`` or ``"interleaved"``.
        p, m, v: stages (devices on ``pp``), microbatches, chunks (virtual stages) per device.
        fwd: int32 ``[T, p, 6]``: per tick and device the forward slot's (valid, microbatch,
            chunk, stash slot, is-first-virtual-stage, is-last-virtual-stage).
        bwd: the same for the backward slot, or ``None`` for ``gpipe`` (autodiff mirrors ``fwd``).
        num_slots: stash entries per device (stage inputs kept for the backward).
    """

    kind: str
    p: int
    m: int
    v: int
    fwd: np.ndarray
    bwd: np.ndarray | None
    num_slots: int

    @property
    def num_ticks(self) -> int:
        return int(self.fwd.shape[0])

    @property
    def bubble_fraction(self) -> float:
        """Idle (device, slot) pairs over all pairs in the table (forward and backward slots
        alike; for ``gpipe`` the backward pass mirrors the forward table)."""
        busy = int(self.fwd[..., VALID].sum()) + (int(self.bwd[..., VALID].sum()) if self.bwd is not None else 0)
        slots = self.fwd[..., VALID].size * (2 if self.bwd is not None else 1)
        return 1.0 - busy / slots

    @property
    def bubble_formula(self) -> float:
        """The closed form of :attr:`bubble_fraction` (module docstring)."""
        p, m, v = self.p, self.m, self.v
        if self.kind == "gpipe":
            return (p - 1) / (m * v + p - 1)
        return ((v + 1) * p - 2) / (m * v + (v + 1) * p - 2)


def _unit(j: int, c: int, p: int, v: int, reverse: bool) -> int:
    """Position of (microbatch j, chunk c) in a device's forward (or backward) unit order:
    groups of p microbatches, then chunks (reversed for the backward), then the microbatch."""
    g, r = divmod(j, p)
    cc = v - 1 - c if reverse else c
    return g * v * p + cc * p + r


@functools.lru_cache(maxsize=256)
def make_schedule(kind: str, p: int, m: int, v: int = 1) -> PipelineSchedule:
    """Build the static table for ``kind`` over ``p`` stages, ``m`` microbatches, ``v`` chunks
    (cached: the planner asks for the same tables for many layouts; treat them as read-only).

    Raises:
        ConfigError: ``v > 1`` with ``m`` not a multiple of ``p``, or an unknown kind.
    """
    if kind not in ("gpipe", "1f1b", "interleaved"):
        raise ConfigError(f"parallel.pipeline_schedule={kind!r}: allowed values are ['gpipe', '1f1b', 'interleaved']")
    if v > 1 and m % p:
        raise ConfigError(f"{v} model chunks need num_microbatches divisible by pipeline_parallel_size: "
                          f"{m} % {p} != 0")
    V = v * p
    units = m * v
    lockstep = kind != "gpipe"
    T = units + (V + p - 2 if lockstep else p - 1)
    S = 2 * V - 1 if lockstep else 1
    fwd = np.zeros((T, p, 6), np.int32)
    bwd = np.zeros((T, p, 6), np.int32)
    # idle slots still write their (stale) input to the stash: to slot (t - s) mod S, the slot of
    # the unit this device would start at tick t, which no waiting unit holds (check_schedule)
    for t in range(T):
        for s in range(p):
            fwd[t, s, SLOT] = (t - s) % S
            bwd[t, s, SLOT] = (t - s) % S
    for j in range(m):
        for c in range(v):
            for s in range(p):
                k = c * p + s
                uf = _unit(j, c, p, v, reverse=False)
                tf = s + uf
                fwd[tf, s] = (1, j, c, uf % S, k == 0, k == V - 1)
                if lockstep:
                    tb = (V - 1) + (p - 1 - s) + _unit(j, c, p, v, reverse=True)
                    bwd[tb, s] = (1, j, c, uf % S, k == 0, k == V - 1)
    fwd.setflags(write=False)
    bwd.setflags(write=False)
    sched = PipelineSchedule(kind, p, m, v, fwd, bwd if lockstep else None, S)
    check_schedule(sched)
    return sched


def check_schedule(s: PipelineSchedule) -> None:
    """Assert the data dependencies of a table (used at build time and by the tests).

    Forward of (j, k+1) is exactly one tick after forward of (j, k) on the next device; backward
    of (j, k-1) exactly one tick after backward of (j, k) on the previous device; the last
    virtual stage's backward is in the tick of its forward; every unit runs once; a stash slot is
    never overwritten while its unit waits for its backward.
    """
    p, v, m = s.p, s.v, s.m
    V = p * v
    where_f, where_b = {}, {}
    for t in range(s.num_ticks):
        for d in range(p):
            row = s.fwd[t, d]
            if row[VALID]:
                key = (int(row[MB]), int(row[CHUNK]) * p + d)
                assert key not in where_f
                where_f[key] = (t, int(row[SLOT]))
            if s.bwd is not None and s.bwd[t, d, VALID]:
                row = s.bwd[t, d]
                key = (int(row[MB]), int(row[CHUNK]) * p + d)
                assert key not in where_b
                where_b[key] = (t, int(row[SLOT]))
    assert len(where_f) == m * V
    for (j, k), (t, _) in where_f.items():
        if k + 1 < V:
            assert where_f[(j, k + 1)][0] == t + 1, (j, k)
    if s.bwd is None:
        return
    assert len(where_b) == m * V
    for (j, k), (t, slot) in where_b.items():
        tf, fslot = where_f[(j, k)]
        assert slot == fslot and t >= tf
        if k == V - 1:
            assert t == tf
        if k > 0:
            assert where_b[(j, k - 1)][0] == t + 1, (j, k)
        # no other forward on this device writes the slot during (tf, t]
        d = k % p
        for tt in range(tf + 1, t + 1):
            assert s.fwd[tt, d, SLOT] != slot, (j, k, tt)


def pipeline_schedule_for(cfg: Config, p: int) -> PipelineSchedule:
    """The schedule a config asks for on ``p`` pipeline stages."""
    par = cfg.parallel
    return make_schedule(par.pipeline_schedule, p, pipeline_microbatches(cfg, p), par.num_model_chunks)
