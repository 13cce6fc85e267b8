"""Published benchmark rows (Colossal-AI, MaxText, torchtitan) beside the planner's predictions for
the same model, hardware, layout and batch, with one efficiency constant for every row."""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass

from jaxcolossal.config import ConfigError, load_config
from jaxcolossal.metrics import flops_per_token
from jaxcolossal.plan.cost import Layout, predict
from jaxcolossal.plan.devices import DEVICES
from jaxcolossal.plan.search import human_bytes, search


@dataclass(frozen=True)
class PublishedRow:
    """One published training throughput and the run that made it.

    ``overrides``: the config keys that reproduce the run's layout, remat and batch on ``preset``
    (``configs/bench/<preset>.yaml``); ``None`` when nothing was published for the layout (the
    planner's choice only). ``tokens_per_gpu``: the published throughput in tokens/s per GPU, or
    ``tflops_6n``: the published TFLOP/s per GPU in the 6N + causal-attention convention, from
    which the tokens follow; ``published``: how the source states it.
    """

    row: str
    source: str
    preset: str
    device: str
    devices: int
    overrides: tuple | None
    published: str = ""
    tokens_per_gpu: float = 0.0
    tflops_6n: float = 0.0


def _colossal(samples: float, tflops_8n: float) -> str:
    return f"{samples:g} samples/s, {tflops_8n:g} TFLOPS (8N) = {tflops_8n * 6 / 8:,.0f} (6N)"


SEED_TABLE = (
    PublishedRow("7B, 8×H200, ZeRO-2 dp8, 36 per DP, full remat", "Colossal-AI README", "llama2_7b", "h200", 8,
                 ("parallel.data_parallel_size=8", "parallel.zero_stage=2", "training.batch_size=288",
                  "model.remat=full"),
                 _colossal(17.13, 534.18), tokens_per_gpu=17.13 * 4096 / 8),
    PublishedRow("70B, 16×H200, ZeRO-2 dp16, 2 per DP (batch assumed), full remat", "Colossal-AI README", "llama3_70b",
                 "h200", 16, ("parallel.data_parallel_size=16", "parallel.zero_stage=2", "training.batch_size=32",
                              "model.remat=full"),
                 _colossal(3.27, 469.1), tokens_per_gpu=3.27 * 4096 / 16),
    PublishedRow("Llama2-7B, 8×H100, FSDP 8, 4 per GPU, remat minimal (dots)", "MaxText configs/gpu/a3/llama_2_7b",
                 "llama2_7b", "h100", 8, ("parallel.data_parallel_size=8", "parallel.zero_stage=3",
                                          "training.batch_size=32", "model.remat=dots"),
                 "about 492 TFLOP/s per GPU", tflops_6n=492.0),
    PublishedRow("Llama 3.1 8B, 8×H100 (500 W), FSDP, 2 per GPU, seq 8192 (assumed), selective remat",
                 "torchtitan benchmarks/llama3_h100_202412", "llama3_8b", "h100", 8,
                 ("parallel.data_parallel_size=8", "parallel.zero_stage=3", "training.batch_size=16",
                  "training.seq_len=8192", "model.max_position_embeddings=8192", "model.remat=selective"),
                 "6,667 tokens/s per GPU (FSDP + torch.compile)", tokens_per_gpu=6667.0),
    PublishedRow("7B, 16×B200, ZeRO-1 dp2 tp2 pp4, 36 per DP (batch assumed)", "Colossal-AI README", "llama2_7b",
                 "b200", 16, ("parallel.data_parallel_size=2", "parallel.tensor_parallel_size=2",
                              "parallel.pipeline_parallel_size=4", "parallel.zero_stage=1", "training.batch_size=72",
                              "parallel.num_microbatches=18", "model.remat=full")),
    PublishedRow("70B, 16×B200, 2 per DP (batch assumed)", "Colossal-AI README", "llama3_70b", "b200", 16, None),
)
"""The published rows (docs/planner.md). Colossal-AI's: seq 4096, bf16, activation checkpointing, its
TFLOPS in the ``8N`` convention (which counts the recomputation); its 70B runs were LLaMA-2 70B (a 32k
vocabulary against the ``llama3_70b`` preset's 128k). MaxText's figure is taken to be in the 6N +
causal-attention convention. torchtitan's H100s were power-capped at 500 W with 96 GB of HBM2e (the
table's H100 has a 989 TFLOP/s peak); its sequence length is the default of its Llama 3 8B config."""

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclass
class Compared:
    """A row with the planner's prediction for its layout (``None``: none published or refused) and
    the planner's own choice on the same model and devices."""

    spec: PublishedRow
    published_tokens: float
    predicted: Layout | None
    choice: Layout | None
    refused: str = ""

    @property
    def error(self) -> float | None:
        if not self.published_tokens or self.predicted is None:
            return None
        return self.predicted.tokens_per_s / self.spec.devices / self.published_tokens - 1


def _config(spec: PublishedRow):
    base = ["training.seq_len=4096", "training.micro_batch_size=0", "training.gradient_accumulation_steps=1",
            "model.remat=full"]
    return load_config(os.path.join(ROOT, "configs", "bench", f"{spec.preset}.yaml"),
                       overrides=base + list(spec.overrides or ()))


def compare(spec: PublishedRow, efficiency: float, choose: bool = True) -> Compared:
    """The planner's prediction for ``spec``'s layout and (``choose``) its own choice, at ``efficiency``."""
    cfg, device = _config(spec), DEVICES[spec.device]
    published = spec.tokens_per_gpu
    if spec.tflops_6n:
        published = spec.tflops_6n * 1e12 / flops_per_token(cfg.model, cfg.training.seq_len)["6N+attn"]
    predicted, refused = None, ""
    if spec.overrides is not None:
        try:
            predicted = predict(copy.deepcopy(cfg), spec.devices, device, efficiency)
        except ConfigError as e:
            refused = str(e)
    choice = None
    if choose:
        layouts, _ = search(cfg, spec.devices, device, efficiency)
        choice = next((lay for lay in layouts if lay.fits), None)
    return Compared(spec, published, predicted, choice, refused)


def best_constant(rows: list[Compared], efficiency: float) -> tuple[float, dict]:
    """The one efficiency (on a 0.01 grid from 0.30 to 0.70) that minimises the worst |error| over
    ``rows`` (predicted at ``efficiency``) whose layout fits and has a published figure, and each
    such row's error at it. The compute time scales as 1/efficiency, the communication not."""
    fits = [r for r in rows if r.error is not None and r.predicted.fits]
    if not fits:
        return efficiency, {}

    def errors(e: float) -> dict:
        out = {}
        for r in fits:
            lay = r.predicted
            tokens = lay.tokens_per_s * lay.step_s  # per step
            out[r.spec.row] = tokens / (lay.compute_s * efficiency / e + lay.comm_s) / r.spec.devices \
                / r.published_tokens - 1
        return out
    grid = [round(0.30 + 0.01 * i, 2) for i in range(41)]
    best = min(grid, key=lambda e: max(abs(x) for x in errors(e).values()))
    return best, errors(best)


def _show(lay: Layout, spec: PublishedRow) -> str:
    device = DEVICES[spec.device]
    fit = "" if lay.fits else f"; **does not fit**: {human_bytes(lay.need['total'])} > {human_bytes(0.9 * device.memory)}"
    return (f"{lay.tokens_per_s / spec.devices:,.0f} tok/s/GPU, {lay.tflops:,.0f} TFLOPS, MFU {lay.mfu:.1%}, "
            f"{human_bytes(lay.need['total'])}{fit}")


def seed_table(efficiency: float = 0.45) -> str:
    """Each published row beside the planner's prediction for its layout, the error, and the layout
    the planner prefers (markdown), at ``efficiency``; then the one constant that minimises the
    worst error over the rows that fit, and every row's error at it."""
    lines = ["| row | source | published | predicted for the row's layout | error | planner's choice |",
             "|---|---|---|---|---|---|"]
    compared = [compare(spec, efficiency) for spec in SEED_TABLE]
    for spec, c in zip(SEED_TABLE, compared):
        pub = (f"{spec.published} = {c.published_tokens:,.0f} tok/s/GPU" if c.published_tokens
               else "(no figure in our references)")
        mine = _show(c.predicted, spec) if c.predicted else (f"refused: {c.refused}" if c.refused else "—")
        err = f"{c.error:+.1%}" if c.error is not None else ""
        choice = f"{c.choice.strategy()}: {_show(c.choice, spec)}" if c.choice else "no layout fits"
        lines.append(f"| {spec.row} | {spec.source} | {pub} | {mine} | {err} | {choice} |")
    e, errors = best_constant(compared, efficiency)
    fitted = "; ".join(f"{row.split(',')[0]} ({spec.source.split()[0]}) {errors[row]:+.1%}"
                       for spec in SEED_TABLE for row in [spec.row] if row in errors)
    lines.append(f"(efficiency {efficiency:g} of the bf16 peak; TFLOPS per device in the 6N + attention convention; "
                 "Colossal-AI's 8N figures converted to 6N; predictions as in docs/planner.md)")
    lines.append(f"one constant for every row that fits: efficiency {e:.2f} minimises the worst error: {fitted}")
    return "\n".join(lines)


__all__ = ["SEED_TABLE", "PublishedRow", "best_constant", "compare", "seed_table"]
