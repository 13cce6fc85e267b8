"""Deterministic, resumable batches of random windows from a token stream.

Every batch is a pure function of ``(tokens, seed, step)``: the window starts of
optimizer step ``step`` come from ``np.random.default_rng([seed, step])``. There
is no iterator state to checkpoint; resuming only needs the step number, and
every process can build exactly its own rows of the global batch.
"""
from __future__ import annotations

import operator
from typing import Iterator

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

__all__ = [
    "window_starts",
    "sample_windows",
    "process_rows",
    "local_rows",
    "eval_batches",
    "DataLoader",
    "ExampleLoader",
    "packing_fields",
]


# --------------------------------------------------------------------- checks
def _as_int(name: str, value, minimum: int) -> int:
    try:
        v = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an integer, got {value!r}") from None
    if v < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {v}")
    return v


def _as_stream(tokens) -> np.ndarray:
    tokens = np.asarray(tokens)
    if tokens.ndim != 1:
        raise ValueError(f"tokens must be a 1-D token stream, got shape {tokens.shape}")
    if not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(f"tokens must have an integer dtype, got {tokens.dtype}")
    return tokens


def _check_seq_len(tokens: np.ndarray, seq_len: int) -> None:
    if seq_len + 1 > len(tokens):
        raise ValueError(
            f"seq_len={seq_len} is too long for a token stream of {len(tokens)} tokens: "
            f"a window needs seq_len + 1 = {seq_len + 1} tokens (inputs plus the "
            f"shifted target); lower seq_len or use a bigger corpus"
        )


def _gather(tokens: np.ndarray, starts: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    # One fancy-index gather of [rows, seq_len + 1]; no Python loop over rows.
    windows = np.lib.stride_tricks.sliding_window_view(tokens, seq_len + 1)[starts]
    windows = windows.astype(np.int32, copy=False)
    return np.ascontiguousarray(windows[:, :-1]), np.ascontiguousarray(windows[:, 1:])


# ------------------------------------------------------------------ sampling
def window_starts(num_tokens: int, step: int, batch_size: int, seq_len: int, seed: int) -> np.ndarray:
    """Window starts of the global batch of optimizer step ``step``.

    Seeding rule: ``rng = np.random.default_rng([seed, step])`` and
    ``starts = rng.integers(0, num_tokens - seq_len, size=batch_size)``, i.e.
    ``batch_size`` starts drawn uniformly, with replacement, from
    ``[0, num_tokens - seq_len - 1]`` (inclusive). The same ``(seed, step)``
    always gives the same starts, on any machine and in any process.

    Returns:
      ``int64`` array of shape ``[batch_size]``.

    Raises:
      ValueError: ``step``/``seed`` negative, ``batch_size``/``seq_len`` < 1, or
        ``seq_len + 1 > num_tokens``.
    """
    step = _as_int("step", step, 0)
    seed = _as_int("seed", seed, 0)
    batch_size = _as_int("batch_size", batch_size, 1)
    seq_len = _as_int("seq_len", seq_len, 1)
    num_tokens = _as_int("num_tokens", num_tokens, 0)
    if seq_len + 1 > num_tokens:
        raise ValueError(
            f"seq_len={seq_len} is too long for a token stream of {num_tokens} tokens "
            f"(a window needs seq_len + 1 = {seq_len + 1})"
        )
    rng = np.random.default_rng([seed, step])
    return rng.integers(0, num_tokens - seq_len, size=batch_size, dtype=np.int64)


def sample_windows(tokens, step: int, batch_size: int, seq_len: int, seed: int, rows=None):
    """Inputs and next-token targets for (part of) the global batch of ``step``.

    The global batch has ``batch_size`` rows; row ``i`` is the window starting
    at ``s_i = window_starts(len(tokens), step, batch_size, seq_len, seed)[i]``
    (seeding rule: ``np.random.default_rng([seed, step])``, see
    :func:`window_starts`): ``inputs[i] = tokens[s_i : s_i + seq_len]`` and
    ``targets[i] = tokens[s_i + 1 : s_i + seq_len + 1]``.

    Args:
      tokens: 1-D integer token stream of length ``N >= seq_len + 1`` (a numpy
        array; ``uint8`` for the byte tokenizer).
      step: optimizer step (>= 0).
      batch_size: rows of the GLOBAL batch (>= 1).
      seq_len: tokens per row (>= 1).
      seed: data seed (>= 0).
      rows: ``None`` for the whole global batch, or a slice / integer index
        array selecting this process's rows (e.g. :func:`process_rows`).
        Concatenating the results of all processes in process order gives the
        global batch exactly.

    Returns:
      ``(inputs, targets)``: C-contiguous ``int32`` arrays of shape
      ``[num_selected_rows, seq_len]``.

    Raises:
      ValueError: bad ``step``/``seed``/``batch_size``/``seq_len`` or
        ``seq_len + 1 > N`` (message names ``seq_len``).
      IndexError: an index in ``rows`` outside ``[0, batch_size)``.
    """
    tokens = _as_stream(tokens)
    seq_len = _as_int("seq_len", seq_len, 1)
    _check_seq_len(tokens, seq_len)
    starts = window_starts(len(tokens), step, batch_size, seq_len, seed)
    if rows is not None:
        starts = starts[rows] if isinstance(rows, slice) else starts[np.asarray(rows, dtype=np.int64)]
    return _gather(tokens, starts, seq_len)


def packing_fields(doc_starts, starts, seq_len: int) -> dict[str, np.ndarray]:
    """Segment ids, positions and loss mask of windows packed with several documents.

    Window ``i`` holds inputs ``tokens[s_i : s_i + seq_len]``; ``doc_starts`` (sorted int, first
    0) are where documents start in the stream. Returns int32 ``segment_ids`` (0 for the
    document the window starts in, +1 at each document start), int32 ``positions`` (offset
    within the document, restarting at 0) and float32 ``loss_mask``: 0 where the target is the
    first token of the next document (predicting it from another document is not this
    document's loss), else 1. All ``[rows, seq_len]``.
    """
    doc_starts = np.asarray(doc_starts, np.int64)
    idx = np.asarray(starts, np.int64)[:, None] + np.arange(seq_len + 1, dtype=np.int64)[None, :]
    doc = np.searchsorted(doc_starts, idx, side="right") - 1
    positions = idx[:, :-1] - doc_starts[doc[:, :-1]]
    segments = doc - doc[:, :1]
    mask = (segments[:, 1:] == segments[:, :-1]).astype(np.float32)
    return {"segment_ids": np.ascontiguousarray(segments[:, :-1].astype(np.int32)),
            "positions": np.ascontiguousarray(positions.astype(np.int32)), "loss_mask": mask}


def process_rows(batch_size: int, process_index: int, process_count: int) -> slice:
    """The contiguous block of global-batch rows owned by one process.

    Process ``p`` of ``n`` owns rows ``[p * batch_size // n, (p + 1) * batch_size // n)``.

    Returns:
      ``slice(start, stop)``.

    Raises:
      ValueError: ``batch_size`` not divisible by ``process_count`` (the
        message gives both numbers), ``process_count < 1`` or
        ``process_index`` outside ``[0, process_count)``.
    """
    batch_size = _as_int("batch_size", batch_size, 1)
    process_count = _as_int("process_count", process_count, 1)
    process_index = _as_int("process_index", process_index, 0)
    if process_index >= process_count:
        raise ValueError(f"process_index={process_index} must be < process_count={process_count}")
    if batch_size % process_count:
        raise ValueError(
            f"global batch_size={batch_size} is not divisible by process_count="
            f"{process_count}; every process must hold the same number of rows "
            f"(choose a batch_size that is a multiple of {process_count})"
        )
    per = batch_size // process_count
    return slice(process_index * per, (process_index + 1) * per)


def local_rows(sharding: jax.sharding.Sharding, global_shape: tuple[int, ...]):
    """Rows (dim 0) of a global array that this process's devices address.

    They are ordered the way ``jax.make_array_from_process_local_data``
    expects the process-local data: the distinct row-shards of the addressable
    devices, sorted by their first row.

    Returns:
      A ``slice`` when the rows are contiguous, otherwise an ``int64`` index array.

    Raises:
      ValueError: ``global_shape[0]`` is not divisible by the number of
        shards along dim 0.
    """
    try:
        shard_rows = sharding.shard_shape(tuple(global_shape))[0]
    except Exception as e:  # IndivisibleError / ValueError
        raise ValueError(
            f"batch of shape {tuple(global_shape)} cannot be split by {sharding}: "
            f"the batch size must be divisible by the number of batch shards ({e})"
        ) from None
    index_map = sharding.addressable_devices_indices_map(tuple(global_shape))
    starts = sorted({(idx[0].start or 0) for idx in index_map.values()})
    if all(b - a == shard_rows for a, b in zip(starts, starts[1:])):
        return slice(starts[0], starts[-1] + shard_rows)
    return np.concatenate([np.arange(s, s + shard_rows, dtype=np.int64) for s in starts])


# ------------------------------------------------------------------- eval
def eval_batches(tokens, batch_size: int, seq_len: int, num_batches: int, doc_starts=None) -> list[tuple]:
    """A FIXED set of validation windows (no randomness), for a stable val loss.

    ``n = batch_size * num_batches`` window starts are spaced evenly over
    ``[0, N - seq_len - 1]`` including both ends: ``start_j = j * (N - seq_len
    - 1) // (n - 1)`` (``start_0 = 0`` if ``n == 1``). When the stream is short
    windows may overlap or repeat. Batch ``b`` holds windows
    ``b * batch_size .. (b + 1) * batch_size - 1``.

    Returns:
      list of ``num_batches`` pairs ``(inputs, targets)``, each an ``int32``
      array of shape ``[batch_size, seq_len]`` with targets = inputs shifted by one;
      with ``doc_starts`` 5-tuples ``(inputs, targets, loss_mask, segment_ids,
      positions)`` (:func:`packing_fields`).

    Raises:
      ValueError: ``batch_size``/``seq_len``/``num_batches`` < 1, or
        ``seq_len + 1 > N``.
    """
    tokens = _as_stream(tokens)
    batch_size = _as_int("batch_size", batch_size, 1)
    seq_len = _as_int("seq_len", seq_len, 1)
    num_batches = _as_int("num_batches", num_batches, 1)
    _check_seq_len(tokens, seq_len)
    n = batch_size * num_batches
    max_start = len(tokens) - seq_len - 1
    starts = np.arange(n, dtype=np.int64) * max_start // max(n - 1, 1)
    inputs, targets = _gather(tokens, starts, seq_len)
    arrays = [inputs, targets]
    if doc_starts is not None:  # packed: (inputs, targets, loss_mask, segment_ids, positions)
        f = packing_fields(doc_starts, starts, seq_len)
        arrays += [f["loss_mask"], f["segment_ids"], f["positions"]]
    return [
        tuple(a[b * batch_size:(b + 1) * batch_size] for a in arrays)
        for b in range(num_batches)
    ]


# ------------------------------------------------------------------ loader
class DataLoader:
    """Stateless, resumable loader of next-token-prediction batches.

    ``batch(step)`` is a pure function of ``(tokens, seed, step)`` (seeding rule
    ``np.random.default_rng([seed, step])``, see :func:`window_starts`), so
    resuming at step ``k`` yields exactly what an uninterrupted run yields at
    step ``k``.

    Without a mesh, ``batch`` returns plain numpy ``int32`` arrays holding this
    process's rows ``process_rows(batch_size, process_index, process_count)``
    (the whole batch in a single process). With a mesh, it returns GLOBAL
    ``jax.Array``s of shape ``[batch_size, seq_len]`` sharded by
    ``NamedSharding(mesh, batch_spec)``: each process builds only the rows its
    devices address (derived from the sharding) and calls
    ``jax.make_array_from_process_local_data``.

    Args:
      tokens: 1-D integer token stream (numpy; ``uint8`` for the byte tokenizer).
      batch_size: GLOBAL batch size (>= 1).
      seq_len: tokens per row (>= 1, ``seq_len + 1 <= len(tokens)``).
      seed: data seed (>= 0).
      mesh: optional ``jax.sharding.Mesh``.
      batch_spec: ``PartitionSpec`` of the ``[batch, seq]`` arrays; defaults
        to ``P(mesh.axis_names[0])``. Only valid with a mesh.
      process_index, process_count: default to ``jax.process_index()`` /
        ``jax.process_count()``. They choose the rows in the no-mesh case; with
        a mesh they must equal JAX's own values (the rows come from the sharding).
      start_step: first step yielded by ``iter(loader)``.
      doc_starts: optional sorted starts of the documents in ``tokens`` (``data.packing_mask``):
        batches then also carry ``segment_ids``, ``positions`` and ``loss_mask``.

    Raises:
      ValueError: ``batch_size < 1``, ``seq_len < 1``, ``seq_len + 1 >
        len(tokens)``, ``batch_size`` not divisible by ``process_count`` (no
        mesh) or by the batch shards (mesh), ``batch_spec`` without a mesh, or
        process arguments that contradict JAX with a mesh; messages name the
        argument.
    """

    def __init__(self, tokens, batch_size: int, seq_len: int, seed: int, mesh=None,
                 batch_spec=None, process_index=None, process_count=None, start_step: int = 0,
                 doc_starts=None):
        self.tokens = _as_stream(tokens)
        self.doc_starts = None if doc_starts is None else np.asarray(doc_starts, np.int64)
        self.batch_size = _as_int("batch_size", batch_size, 1)
        self.seq_len = _as_int("seq_len", seq_len, 1)
        _check_seq_len(self.tokens, self.seq_len)
        self.seed = _as_int("seed", seed, 0)
        self.start_step = _as_int("start_step", start_step, 0)
        self.global_shape = (self.batch_size, self.seq_len)
        self.mesh = mesh

        jax_index, jax_count = jax.process_index(), jax.process_count()
        self.process_index = jax_index if process_index is None else _as_int("process_index", process_index, 0)
        self.process_count = jax_count if process_count is None else _as_int("process_count", process_count, 1)

        if mesh is None:
            if batch_spec is not None:
                raise ValueError("batch_spec was given without a mesh; pass mesh= as well")
            self.sharding = None
            self.rows = process_rows(self.batch_size, self.process_index, self.process_count)
        else:
            if (self.process_index, self.process_count) != (jax_index, jax_count):
                raise ValueError(
                    f"with a mesh, process_index/process_count must match JAX "
                    f"({jax_index}/{jax_count}), got {self.process_index}/{self.process_count}"
                )
            if batch_spec is None:
                batch_spec = PartitionSpec(mesh.axis_names[0])
            self.sharding = NamedSharding(mesh, batch_spec)
            self.rows = local_rows(self.sharding, self.global_shape)
        self.batch_spec = batch_spec

    def local_batch(self, step: int) -> dict[str, np.ndarray]:
        """This process's rows of step ``step`` as numpy ``int32`` arrays of
        shape ``[local_rows, seq_len]`` (keys ``inputs``, ``targets``; with ``doc_starts``
        also ``segment_ids``, ``positions`` and ``loss_mask``, :func:`packing_fields`)."""
        inputs, targets = sample_windows(self.tokens, step, self.batch_size, self.seq_len,
                                         self.seed, rows=self.rows)
        out = {"inputs": inputs, "targets": targets}
        if self.doc_starts is not None:
            starts = window_starts(len(self.tokens), step, self.batch_size, self.seq_len, self.seed)
            starts = starts[self.rows] if isinstance(self.rows, slice) else starts[np.asarray(self.rows)]
            out.update(packing_fields(self.doc_starts, starts, self.seq_len))
        return out

    def batch(self, step: int) -> dict:
        """The batch of optimizer step ``step``: ``{"inputs", "targets"}``.

        Returns global ``jax.Array``s (``int32``, shape ``[batch_size, seq_len]``,
        sharded by ``self.sharding``) with a mesh, else this process's numpy rows.
        Raises ``ValueError`` for a negative step.
        """
        local = self.local_batch(step)
        if self.sharding is None:
            return local
        return {k: self._put(v, (self.batch_size,) + v.shape[1:]) for k, v in local.items()}

    def to_global(self, array: np.ndarray):
        """Place a GLOBAL numpy array (dim 0 = batch, e.g. from :func:`eval_batches`,
        identical on every process) the same way as training batches.

        Returns a global ``jax.Array`` with a mesh, else this process's rows
        (``array[process_rows(...)]``). Raises ``ValueError`` when dim 0 does not
        divide among the processes / batch shards.
        """
        array = np.asarray(array)
        if self.sharding is None:
            return array[process_rows(array.shape[0], self.process_index, self.process_count)]
        rows = local_rows(self.sharding, array.shape)
        return self._put(np.ascontiguousarray(array[rows]), array.shape)

    def _put(self, local: np.ndarray, global_shape) -> jax.Array:
        return jax.make_array_from_process_local_data(self.sharding, local, tuple(global_shape))

    def iterate(self, start_step: int | None = None, num_steps: int | None = None) -> Iterator[dict]:
        """Yield ``batch(start_step)``, ``batch(start_step + 1)``, ... (forever,
        or ``num_steps`` batches). ``start_step`` defaults to ``self.start_step``."""
        step = self.start_step if start_step is None else _as_int("start_step", start_step, 0)
        end = None if num_steps is None else step + _as_int("num_steps", num_steps, 0)
        while end is None or step < end:
            yield self.batch(step)
            step += 1

    def __iter__(self) -> Iterator[dict]:
        """Infinite iterator starting at ``self.start_step``."""
        return self.iterate()

    def __repr__(self) -> str:
        return (f"DataLoader(tokens={len(self.tokens)}, batch_size={self.batch_size}, "
                f"seq_len={self.seq_len}, seed={self.seed}, rows={self.rows}, "
                f"sharding={self.sharding})")


class ExampleLoader(DataLoader):
    """Batches of whole examples with a loss mask (instruction fine-tuning, :mod:`.chat`).

    ``batch(step)`` is ``{"inputs", "targets", "loss_mask"}``: ``batch_size`` rows drawn from
    ``examples [N, seq_len + 1]`` by ``np.random.default_rng([seed, step]).integers(0, N)``, so
    like :class:`DataLoader` it is a pure function of ``(examples, seed, step)`` (resume needs only
    the step) and each process builds only the rows its devices address. ``masks [N, seq_len]``
    (float32, aligned with the targets) gives ``loss_mask``.

    Raises:
        ValueError: shapes that do not match, no examples, and what :class:`DataLoader` raises.
    """

    def __init__(self, examples, masks, batch_size: int, seed: int, mesh=None, batch_spec=None,
                 process_index=None, process_count=None, start_step: int = 0):
        examples, masks = np.asarray(examples), np.asarray(masks, np.float32)
        if examples.ndim != 2 or len(examples) == 0 or masks.shape != (len(examples), examples.shape[1] - 1):
            raise ValueError(f"examples must be [N >= 1, seq_len + 1] and masks [N, seq_len], got "
                             f"{examples.shape} and {masks.shape}")
        super().__init__(examples[0], batch_size, examples.shape[1] - 1, seed, mesh=mesh, batch_spec=batch_spec,
                         process_index=process_index, process_count=process_count, start_step=start_step)
        self.examples, self.masks = examples.astype(np.int32), masks

    def local_batch(self, step: int) -> dict[str, np.ndarray]:
        """This process's rows of step ``step``: ``inputs``/``targets`` int32 and ``loss_mask`` float32."""
        step = _as_int("step", step, 0)
        idx = np.random.default_rng([self.seed, step]).integers(0, len(self.examples), self.batch_size)[self.rows]
        rows = self.examples[idx]
        return {"inputs": np.ascontiguousarray(rows[:, :-1]), "targets": np.ascontiguousarray(rows[:, 1:]),
                "loss_mask": np.ascontiguousarray(self.masks[idx])}

    def eval_batches(self, examples, masks, batch_size: int, num_batches: int) -> list[tuple]:
        """Fixed evaluation batches ``(inputs, targets, loss_mask)``, placed like training batches:
        the first ``batch_size · num_batches`` rows of ``examples`` (cycled when there are fewer)."""
        n = batch_size * num_batches
        idx = np.arange(n) % len(examples)
        ex, m = np.asarray(examples, np.int32)[idx], np.asarray(masks, np.float32)[idx]
        return [tuple(self.to_global(a[b * batch_size:(b + 1) * batch_size])
                      for a in (ex[:, :-1], ex[:, 1:], m)) for b in range(num_batches)]


class PairLoader(ExampleLoader):
    """Batches of preference pairs (DPO, :mod:`.preference`): ``batch(step)`` is ``{"inputs",
    "targets", "loss_mask"}`` of ``batch_size`` rows, ``batch_size / 2`` pairs drawn by
    ``np.random.default_rng([seed, step]).integers(0, N)``, interleaved (row ``2i`` chosen, ``2i + 1``
    rejected: :func:`.preference.pair_rows`), so a pure function of ``(pairs, seed, step)`` as
    :class:`ExampleLoader` is (resume needs only the step).

    ``pairs``: a :class:`jaxcolossal.data.preference.PreferenceData`.

    :attr:`ref_logps`: None, or each pair's precomputed reference sequence log-probs, fp32 ``[N, 2]``
    (chosen, rejected; ``posttrain.precompute_ref_log_probs``, :mod:`jaxcolossal.train.ref_logps`), keyed
    by the pair's index in ``pairs``: then each batch also carries ``"ref_logps"`` fp32 ``[batch_size, 1]``,
    row ``2i``/``2i + 1`` the chosen/rejected value of the pair drawn for it.

    Raises:
        ValueError: an odd ``batch_size``, and what :class:`ExampleLoader` raises.
    """

    ref_logps: np.ndarray | None = None

    def __init__(self, pairs, batch_size: int, seed: int, mesh=None, batch_spec=None, process_index=None,
                 process_count=None, start_step: int = 0):
        if batch_size % 2:
            raise ValueError(f"a batch of preference pairs needs an even number of rows, got {batch_size}")
        n = len(pairs.chosen)
        rows, masks = pairs.rows(np.arange(n))
        super().__init__(rows, masks, batch_size, seed, mesh=mesh, batch_spec=batch_spec, process_index=process_index,
                         process_count=process_count, start_step=start_step)
        self.num_pairs = n
        self.pair_tokens = pairs.row_lengths(np.arange(n)).reshape(n, 2).sum(1)  # int64 [N]: chosen + rejected
        self._counted = (-1, 0)  # (step, tokens of steps 0..step): num_tokens's running sum

    def _draws(self, step: int) -> np.ndarray:
        """The pairs of step ``step``'s whole batch (every process's), int64 ``[batch_size / 2]``."""
        step = _as_int("step", step, 0)
        return np.random.default_rng([self.seed, step]).integers(0, self.num_pairs, self.batch_size // 2)

    def row_index(self, step: int) -> np.ndarray:
        """This process's rows of step ``step`` as int indices into the interleaved pair rows (``2i``, ``2i + 1``)."""
        pairs = self._draws(step)
        return np.stack([2 * pairs, 2 * pairs + 1], axis=1).reshape(-1)[self.rows]

    def num_tokens(self, step: int) -> int:
        """TRL's ``num_tokens``: the tokens (prompt + response + eos, padding left out) of every row of the
        whole batches of steps ``0..step``, all processes' (a pure function of the data, the seed and the
        step, so a resumed run counts on where it stopped). Kept as a running sum: the next step costs one
        batch's draw; any other step counts from step 0."""
        step = _as_int("step", step, 0)
        done, total = self._counted if self._counted[0] <= step else (-1, 0)
        for s in range(done + 1, step + 1):
            total += int(self.pair_tokens[self._draws(s)].sum())
        self._counted = (step, total)
        return total

    def step_metrics(self, step: int) -> dict:
        """The host metrics logged with optimizer step ``step`` (0-based; the loop adds them): ``num_tokens``."""
        return {"num_tokens": float(self.num_tokens(step))}

    def local_batch(self, step: int) -> dict[str, np.ndarray]:
        """This process's rows of step ``step``: ``inputs``/``targets`` int32 and ``loss_mask`` float32."""
        idx = self.row_index(step)
        rows = self.examples[idx]
        out = {"inputs": np.ascontiguousarray(rows[:, :-1]), "targets": np.ascontiguousarray(rows[:, 1:]),
               "loss_mask": np.ascontiguousarray(self.masks[idx])}
        if self.ref_logps is not None:  # row 2i + c of the pairs' interleaving is pair i's value c
            out["ref_logps"] = np.ascontiguousarray(self.ref_logps.reshape(-1)[idx][:, None], np.float32)
        return out

    def attach_ref_logps(self, values: np.ndarray) -> None:
        """Set :attr:`ref_logps` to ``values`` (``[num_pairs, 2]``, cast to fp32).

        Raises:
            ValueError: another shape."""
        values = np.asarray(values, np.float32)
        if values.shape != (self.num_pairs, 2):
            raise ValueError(f"reference log-probs of shape {values.shape} for {self.num_pairs} pairs: expected "
                             f"({self.num_pairs}, 2)")
        self.ref_logps = values
