"""The loop's finish phase (:func:`finish_run`): what happens after the last step or a signal, in
order: the final evaluation, the final save, the adapters, the sample and the goodput report."""

from __future__ import annotations

import os
from typing import Any

import jax

from jaxcolossal.generate import printable
from jaxcolossal.models.peft import save_adapters
from jaxcolossal.runtime.dist_logger import get_dist_logger
from jaxcolossal.train.checkpointing import save
from jaxcolossal.train.evaluate import final_evaluation, sample_text
from jaxcolossal.train.guard import StepWatchdog, StopSignals
from jaxcolossal.train.report import report_goodput
from jaxcolossal.train.run import Run


def finish_run(run: Run, state: Any, perf: dict, val_start: float, watchdog: StepWatchdog,
               stop: StopSignals) -> dict:
    """After the last step (or a signal): the final evaluation (:func:`jaxcolossal.train.evaluate.final_evaluation`;
    on a signal a warning instead), the final save (:func:`_final_save`), the state made whole (NVMe),
    LoRA's adapters in PEFT's format beside the logs, the end-of-run sample (printed on process 0)
    and the goodput report. Returns :func:`jaxcolossal.train.loop.train`'s summary dict."""
    out = {"val_loss_start": val_start, "val_loss_end": None, "perf": perf, "compile_s": run.compile_s,
           "sample": "", "state": state, "plan": run.plan, "stopped_by": stop.received,
           "exit_code": stop.exit_code}
    run.hang.stop()  # the end-of-run phases are watched by the collective-timeout watchdog
    if stop:  # a signal: save where we are and stop, without the final evaluation
        watchdog.stop()
        get_dist_logger().warning(f"{stop.received} received: saving step {int(state.step)} and stopping", ranks=[0])
    else:
        out["val_loss_end"] = final_evaluation(run, state, val_start, watchdog)
    _final_save(run, state, out["val_loss_end"])
    if run.nvme is not None:  # the returned state is whole
        out["state"] = state = run.full(state)
    if run.plan.lora and run.is_main:  # the trained adapters in PEFT's format, beside the logs
        out["adapter_dir"] = _save_adapters(run, state)
    if not stop:
        out["sample"] = sample_text(run, state)
        if run.is_main and out["sample"]:
            print("----- sample -----\n" + printable(out["sample"]) + "\n------------------")
    out["goodput"] = report_goodput(run, int(state.step))
    return out


def _final_save(run: Run, state: Any, val_loss: float | None) -> None:
    """The emergency checkpoints closed, the final persistent checkpoint written (whatever they did;
    a no-op without ``checkpoint.dir``) and the folder closed, the now stale emergency copies
    cleared; time ``checkpoint_save`` in the goodput."""
    with run.goodput.phase("checkpoint_save"):
        try:
            if run.local is not None:
                run.local.close()
        finally:  # whatever the emergency copies did, the final persistent checkpoint is written
            save(run, state, val_loss=val_loss, final=True)
        if run.ckpt:
            run.ckpt.close()
        if run.local is not None:  # the final persistent step is the newest: the emergency copies are stale
            run.local.clear()


def _save_adapters(run: Run, state: Any) -> str:
    """LoRA's trained adapters in PEFT's format in ``<logging.run_dir>/adapter`` (returned), logged."""
    adapter_dir = os.path.join(run.cfg.logging.run_dir, "adapter")
    save_adapters(adapter_dir, run.cfg.model, jax.device_get(state.master if run.plan.mixed else state.params),
                  base_model=run.cfg.model.init_from)
    get_dist_logger().info(f"LoRA adapters saved in PEFT's format in {adapter_dir}", ranks=[0])
    return adapter_dir
