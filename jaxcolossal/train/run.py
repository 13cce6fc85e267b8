"""What the training loop's phases share: the :class:`Run` record that :func:`jaxcolossal.train.start.start_run`
builds and every later phase reads, the run's id (:func:`new_run_id`) and its first metrics record
(:func:`run_start_record`)."""

from __future__ import annotations

import dataclasses
import datetime
import time
import uuid
from dataclasses import dataclass
from typing import Any

import jax

from jaxcolossal import metrics as mx
from jaxcolossal.checkpoint import CheckpointManager
from jaxcolossal.config import Config
from jaxcolossal.data import DataLoader
from jaxcolossal.data.corpus import TEXT_SAMPLE_PROMPT
from jaxcolossal.runtime.goodput import GoodputRecorder, StragglerTracker
from jaxcolossal.runtime.watchdog import HangWatchdog
from jaxcolossal.train.emergency import LocalCheckpoints
from jaxcolossal.train.nvme import NvmeTier
from jaxcolossal.train.profile import StepProfiler
from jaxcolossal.train.state import TrainPlan


@dataclass
class Run:
    """Everything the phases share; built by :func:`jaxcolossal.train.start.start_run`."""

    cfg: Config
    plan: TrainPlan
    state: Any
    ckpt: CheckpointManager | None
    loader: DataLoader
    evals: list
    compiled: Any
    eval_step: Any
    compile_s: float
    compiled_peak: int
    metrics: mx.MetricsWriter
    nvme: NvmeTier | None = None
    sample_prompt: str = TEXT_SAMPLE_PROMPT
    run_id: str = ""
    profiler: StepProfiler | None = None
    local: LocalCheckpoints | None = None
    goodput: GoodputRecorder = dataclasses.field(default_factory=lambda: GoodputRecorder(None))
    """The job's goodput timeline (:func:`jaxcolossal.train.loop.goodput_recorder`); in memory only by default."""
    hang: HangWatchdog = dataclasses.field(default_factory=lambda: HangWatchdog(None))
    """The hang watchdog (:func:`jaxcolossal.train.loop.train` sets it); off by default."""
    data_mark: float = 0.0
    """The data-waiting seconds at the last logged step (per-rank times, :func:`jaxcolossal.train.report.rank_times`)."""
    stragglers: StragglerTracker | None = None
    """The straggler rule's state across logged steps (:func:`jaxcolossal.train.report.rank_times` makes it from the config)."""

    def full(self, state: Any) -> Any:
        """``state`` whole: with the NVMe tier, its leaves read back from their files (for a save)."""
        return self.nvme.fill(state) if self.nvme is not None else state

    @property
    def is_main(self) -> bool:
        """True on process 0, which prints tables and writes ``metrics.jsonl``."""
        return jax.process_index() == 0

    def write(self, rec: dict) -> None:
        """Append one record to ``metrics.jsonl`` and the sinks ``logging`` switches on (TensorBoard,
        W&B; process 0)."""
        self.metrics.write(rec)


def new_run_id() -> str:
    """A unique id for one run: its UTC start time and 6 random hex digits (``20250105-143000-1a2b3c``)."""
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + "-" + uuid.uuid4().hex[:6]


def run_start_record(cfg: Config, run_id: str, resumed_from_step: int | None) -> dict:
    """The first record of a run in ``metrics.jsonl``, its boundary from the runs before it in the
    same ``run_dir``: ``event`` ``"run_start"``, ``time`` (ISO 8601, UTC), ``run`` (the id, also in
    ``train.log`` and the TensorBoard folder), ``resumed_from_step`` (None: a fresh start) and
    ``config`` (the YAML file, None when there was none). It has no ``step``."""
    return {"event": "run_start", "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "run": run_id, "resumed_from_step": resumed_from_step, "config": cfg.source}
