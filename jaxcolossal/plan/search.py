"""The layout search: every dp/tp/pp (and sp for long sequences) × ZeRO × remat × accumulation of a
model on a cluster, predicted, sorted, and printed as Colossal-AI's benchmark table with the
command that runs the best."""

from __future__ import annotations

import copy
import dataclasses
import math

from jaxcolossal.config import Config, ConfigError
from jaxcolossal.metrics import param_count
from jaxcolossal.plan.cost import Layout, predict
from jaxcolossal.plan.devices import Device


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def search(cfg: Config, num_devices: int, device: Device, efficiency: float = 0.45) -> tuple[list[Layout], dict]:
    """Every layout of ``cfg``'s model on ``num_devices``: tp (within a node) × pp × dp, ZeRO 0–3
    (0–1 with a pipeline), remat none/full, gradient accumulation (pipeline microbatches) 1, 2, 4,
    … up to the per-replica batch; from 8k tokens on, also ring attention over sp (tp·sp within a
    node, no pipeline). Returns the layouts sorted fastest first, and for each (zero, tp, pp, dp,
    sp) family the smallest predicted memory among its layouts (bytes), for the families where
    none fits."""
    m, t = cfg.model, cfg.training
    out, smallest = [], {}
    sps = [1] + ([d for d in (2, 4, 8) if d <= device.per_node] if t.seq_len >= 8192 else [])
    for tp, sp in ((tp, sp) for tp in _divisors(num_devices) for sp in sps
                   if tp * sp <= device.per_node and num_devices % (tp * sp) == 0):
        for pp in (d for d in _divisors(num_devices // (tp * sp)) if m.num_layers % d == 0 and (sp == 1 or d == 1)):
            dp = num_devices // (tp * pp * sp)
            if t.batch_size % dp:
                continue
            per_replica = t.batch_size // dp
            for zero in ((0, 1) if pp > 1 else (0, 1, 2, 3)):
                if zero and dp == 1:
                    continue
                for remat in ("none", "full"):
                    for k in (d for d in _divisors(per_replica) if d & (d - 1) == 0):
                        if pp > 1 and k < pp:
                            continue
                        ov = {"parallel.data_parallel_size": dp, "parallel.tensor_parallel_size": tp,
                              "parallel.pipeline_parallel_size": pp, "parallel.zero_stage": zero,
                              "model.remat": remat}
                        c = copy.deepcopy(cfg)
                        c.parallel = dataclasses.replace(
                            c.parallel, data_parallel_size=dp, tensor_parallel_size=tp, pipeline_parallel_size=pp,
                            zero_stage=zero, sequence_parallel_size=sp,
                            sequence_parallelism_mode="ring_attn" if sp > 1 else "none")
                        if sp > 1:
                            ov.update({"parallel.sequence_parallel_size": sp,
                                       "parallel.sequence_parallelism_mode": "ring_attn", "model.attention_impl": "xla"})
                            c.model.attention_impl = "xla"
                        c.model.remat = remat
                        c.training.micro_batch_size = 0
                        if pp > 1:
                            c.parallel.num_microbatches = k
                            c.training.gradient_accumulation_steps = 1
                            ov["parallel.num_microbatches"] = k
                        else:
                            c.training.gradient_accumulation_steps = k
                            ov["training.gradient_accumulation_steps"] = k
                        try:
                            lay = predict(c, num_devices, device, efficiency)
                        except ConfigError:
                            continue
                        lay.overrides = ov
                        out.append(lay)
                        fam = (zero, tp, pp, dp, sp)
                        smallest[fam] = min(smallest.get(fam, math.inf), lay.need["total"])
    fitting = {(lay.overrides["parallel.zero_stage"], lay.overrides["parallel.tensor_parallel_size"],
                lay.overrides["parallel.pipeline_parallel_size"], lay.overrides["parallel.data_parallel_size"],
                lay.overrides.get("parallel.sequence_parallel_size", 1))
               for lay in out if lay.fits}
    rejected = {f: b for f, b in smallest.items() if f not in fitting}
    return sorted(out, key=lambda lay: (not lay.fits, lay.step_s)), rejected


def run_overrides(cfg: Config, layout: Layout, model: dict | None = None) -> dict:
    """The ``key=value`` overrides that make ``scripts/train.py`` run ``layout`` exactly as planned:
    the layout's own keys, the planned sequence length and global batch (``micro_batch_size=0``,
    so a preset's per-device batch does not override it), the precision, and ``model`` (the model
    section's keys when the model came from a Hugging Face ``config.json``)."""
    t = cfg.training
    out = dict(model or {})
    out.update(layout.overrides)
    out.update({"training.seq_len": t.seq_len, "training.batch_size": t.batch_size, "training.micro_batch_size": 0,
                "precision.bf16": str(cfg.precision.mode == "bf16").lower(),
                "precision.fp16": str(cfg.precision.mode == "fp16").lower()})
    return out


def _count(n: float) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e8 else f"{n / 1e6:.2f} M"


def human_bytes(n: float) -> str:
    return f"{n / 1e9:,.1f} GB" if n >= 1e8 else f"{n / 1e6:,.1f} MB"


@dataclasses.dataclass(frozen=True)
class PlanReport:
    """The planner's answer for a model on a cluster: every layout considered (fastest first), the
    smallest predicted memory (bytes) of each (zero, tp, pp, dp, sp) family where none fits, and what
    the command line needs to render it (:meth:`text`)."""

    cfg: Config
    num_devices: int
    device: Device
    efficiency: float
    layouts: list
    rejected: dict
    top: int = 8
    source: str = "--config CONFIG"
    model_overrides: dict | None = None

    @property
    def best(self) -> list[Layout]:
        """The fitting layouts, fastest first, at most ``top`` of them."""
        return [lay for lay in self.layouts if lay.fits][: self.top]

    @property
    def run_command(self) -> str | None:
        """The command line that runs the best layout (None when no layout fits)."""
        if not self.best:
            return None
        ov = " ".join(f"{k}={v}" for k, v in run_overrides(self.cfg, self.best[0], self.model_overrides).items())
        return f"python scripts/train.py {self.source + ' ' if self.source else ''}{ov}"

    def text(self) -> str:
        """The printout: Colossal-AI's benchmark table of :attr:`best`, why each other family
        failed, and :attr:`run_command`."""
        return _render(self)


def plan_layouts(cfg: Config, num_devices: int, device: Device, efficiency: float = 0.45, top: int = 8,
                 source: str = "--config CONFIG", model_overrides: dict | None = None) -> PlanReport:
    """:func:`search` of ``cfg``'s model on ``num_devices`` × ``device``, as a :class:`PlanReport`."""
    layouts, rejected = search(cfg, num_devices, device, efficiency)
    return PlanReport(cfg, num_devices, device, efficiency, layouts, rejected, top, source, model_overrides)


def report(cfg: Config, num_devices: int, device: Device, efficiency: float = 0.45, top: int = 8,
           source: str = "--config CONFIG", model_overrides: dict | None = None) -> str:
    """The planner's printout (:meth:`PlanReport.text` of :func:`plan_layouts`): the fastest fitting
    layouts as Colossal-AI's benchmark table (strategy, batch per DP, samples/s, TFLOPS per device,
    memory), why each other family failed, and the command line that runs the best."""
    return plan_layouts(cfg, num_devices, device, efficiency, top, source, model_overrides).text()


def _render(r: PlanReport) -> str:
    """:meth:`PlanReport.text`."""
    cfg, device, t = r.cfg, r.device, r.cfg.training
    n = param_count(cfg.model)["total"]
    lines = [f"model {cfg.model.type} {_count(n)} parameters, seq {t.seq_len}, global batch {t.batch_size}; "
             f"{r.num_devices} × {device.name} ({device.memory / 1e9:.0f} GB, {device.peak / 1e12:.0f} TFLOP/s bf16, "
             f"{device.per_node} per node); {cfg.precision.mode}; efficiency {r.efficiency:g} of peak",
             f"{len(r.layouts)} layouts considered, {sum(lay.fits for lay in r.layouts)} fit in 90% of the memory",
             "",
             "| strategy | accumulation / microbatches | batch per DP | samples/s | tokens/s | TFLOPS/device | MFU | "
             "memory/device | step (compute + comm) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for lay in r.best:
        o = lay.overrides
        k = o.get("parallel.num_microbatches", o.get("training.gradient_accumulation_steps", 1))
        lines.append(f"| {lay.strategy()} | {k} | {t.batch_size // o['parallel.data_parallel_size']} | "
                     f"{lay.tokens_per_s / t.seq_len:,.2f} | {lay.tokens_per_s:,.0f} | {lay.tflops:,.1f} | "
                     f"{lay.mfu:.1%} | {human_bytes(lay.need['total'])} | {lay.step_s:.2f} s "
                     f"({lay.compute_s:.2f} + {lay.comm_s:.2f}"
                     + (f", bubble {lay.bubble:.0%}" if lay.bubble else "") + ") |")
    if not r.best:
        lines.append("| (no layout fits: see below) | | | | | | | | |")
    if r.rejected:
        lines.append("")
        lines.append("rejected (the smallest predicted memory of each family, over remat and accumulation):")
        for (zero, tp, pp, dp, sp), need in sorted(r.rejected.items(), key=lambda kv: kv[1]):
            fam = (f"ZeRO-{zero} dp{dp}" + (f" sp{sp} ring" if sp > 1 else "") + (f" tp{tp}" if tp > 1 else "")
                   + (f" pp{pp}" if pp > 1 else ""))
            lines.append(f"  {fam}: {human_bytes(need)} > {human_bytes(0.9 * device.memory)}")
    if r.best:
        lines += ["", f"run the best: {r.run_command}"]
        if r.model_overrides:
            lines.append("(add model.init_from=<the Hugging Face folder> to start from its weights)")
    lines.append("(predictions: memory by the ZeRO formulas and the residuals traced from the model code, time by FLOPs at the "
                 "efficiency and ring volumes at the link bandwidths, no overlap; docs/planner.md)")
    return "\n".join(lines)
