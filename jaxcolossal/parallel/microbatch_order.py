"""The order a loader lays a step's rows in, so that each microbatch holds the same rows on every layout.

The train step (:func:`jaxcolossal.train.step.make_grad_fn`) splits a global batch of ``B`` rows
sharded over ``n`` data shards as ``[n, k, B/(n·k)]``: data shard ``i`` holds rows ``[i·B/n, (i+1)·B/n)``
and its microbatch ``j`` the ``j``-th block of ``B/(n·k)`` of them. Microbatch ``j`` of the whole step
is the union over the shards, which depends on ``n``: on one device it is rows ``[j·B/k, (j+1)·B/k)``, on
four shards rows from every quarter. A sum over the step does not care; a loss normalised per
microbatch (GRPO's ``bnpo``, TRL's per-microbatch metrics) does. A loader that places its rows in
:func:`microbatch_order` makes microbatch ``j`` rows ``[j·B/k, (j+1)·B/k)`` of its own order on every
layout, as TRL's sampler hands out consecutive slices for its accumulation steps.
"""

from __future__ import annotations

import numpy as np


def microbatch_order(rows: int, data_shards: int, microbatches: int) -> np.ndarray:
    """The permutation ``order`` (int ``[rows]``) with which ``batch[order]``, split by the step over
    ``data_shards`` shards and ``microbatches`` accumulation steps, gives microbatch ``j`` exactly the
    rows ``[j·rows/k, (j+1)·rows/k)`` of ``batch`` (``k = microbatches``); the identity when either count is 1.

    Raises:
        ValueError: ``rows`` is not a multiple of ``data_shards × microbatches``.
    """
    n, k = data_shards, microbatches
    if rows % (n * k):
        raise ValueError(f"{rows} rows do not split into {n} data shards x {k} microbatches")
    b = rows // (n * k)
    # position (i, j, r) of the step's split holds row j·(rows/k) + i·b + r
    return np.arange(rows).reshape(k, n, b).transpose(1, 0, 2).reshape(-1)
