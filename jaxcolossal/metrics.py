"""FLOPs, MFU, throughput and per-device model-state memory.

Two labelled FLOP conventions are reported side by side:

* ``6N+attn`` — model FLOPs per trained token = ``6·N_matmul + 6·L·t·d``: 6 FLOPs per matmul
  parameter per token (forward 2, backward 4; Kaplan et al., 2020) plus PaLM's attention term
  ``12·L·H·Q·t`` halved for the causal mask (Chowdhery et al., 2022, App. B); with multi-head latent
  attention's q·k and value head sizes apart, ``6·L·H·(Q_qk + Q_v)·t`` halved; a sliding-window
  layer counts the keys its window leaves (:func:`attended_keys`). ``N_matmul``
  excludes the input-embedding lookup but includes the LM head. Recompute is not counted
  (these are *model* FLOPs, the basis of MFU).
* ``colossal`` — Colossal-AI's ``examples/language/performance_evaluator.py``:
  ``2·N·(3 + recompute)`` per token with N all parameters, i.e. 8N with activation
  checkpointing (hardware FLOPs).

TFLOPS per device = FLOPs per step / step seconds / 1e12 / number of devices. MFU = model TFLOPS
per device / the device's dense bf16 peak (A100 312, H100 and H200 989, B200 2250 TFLOP/s), reported
on GPUs only (:func:`mfu_peak`). The log prints FLOP rates to three significant digits
(:func:`flops_text`).

:class:`MetricsWriter` is the run's one metrics sink: ``metrics.jsonl``, and the scalar sinks the
config switches on (TensorBoard, Weights & Biases), which get the same names and values at the same
steps.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, Mapping, Protocol, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxcolossal.config import Config, ConfigError, ModelConfig
from jaxcolossal.errors import DependencyError
from jaxcolossal.models import get_family
from jaxcolossal.models.layers.lora import adapter_shapes_and_axes
from jaxcolossal.parallel.mesh import platform
from jaxcolossal.parallel.sharding import shard_bytes

PEAK_BF16_FLOPS = {"A100": 312e12, "H100": 989e12, "H200": 989e12, "B200": 2250e12}
"""Dense bf16 peak FLOP/s by device family (NVIDIA datasheets; the planner's
:data:`jaxcolossal.plan.devices.DEVICES` has the same figures)."""


def peak_flops(device_kind: str) -> float | None:
    """Dense bf16 peak FLOP/s of a ``jax.Device.device_kind``, or None when unknown (CPU)."""
    kind = device_kind.upper()
    for name, value in PEAK_BF16_FLOPS.items():
        if name in kind:
            return value
    return None


def mfu_peak(devices: Mesh | Sequence[jax.Device]) -> float | None:
    """The peak FLOP/s per device (dense bf16) that MFU is reported against on ``devices`` (a mesh, or
    a sequence of devices): their kind's :data:`PEAK_BF16_FLOPS` when they are GPUs (by the devices'
    own platform, :func:`jaxcolossal.parallel.mesh.platform`, never ``jax.default_backend()``); None
    (no MFU) on a CPU, a TPU, or a GPU whose peak is not in the table."""
    if platform(devices) != "gpu":
        return None
    first = devices.devices.flat[0] if isinstance(devices, Mesh) else next(iter(devices))
    return peak_flops(first.device_kind)


FLOPS_UNITS = (("TFLOPS", 1.0), ("GFLOPS", 1e-3), ("MFLOPS", 1e-6))
"""The units a FLOP rate is printed in, largest first, with their size in TFLOP/s."""


def flops_rate(tflops: float) -> tuple[str, str]:
    """``(number, unit)`` for a rate in TFLOP/s, to three significant digits in the largest unit where
    it is >= 1: ``41.2`` -> ``("41.2", "TFLOPS")``, ``0.512`` -> ``("512", "GFLOPS")``, ``0.00123``
    -> ``("1.23", "GFLOPS")``; below 1 MFLOP/s in MFLOPS (``"0.0123"``). 0, NaN and inf as Python
    spells them, in TFLOPS (``"0"``, ``"nan"``)."""
    if tflops == 0 or not math.isfinite(tflops):
        return f"{tflops:g}", "TFLOPS"
    for unit, size in FLOPS_UNITS:
        value = tflops / size
        if abs(value) >= 1:
            break
    decimals = max(0, 2 - math.floor(math.log10(abs(value))))  # three significant digits
    return f"{value:.{decimals}f}", unit


def flops_text(tflops: float) -> str:
    """A rate in TFLOP/s as the log prints it: ``"41.2 TFLOPS"``, ``"512 GFLOPS"`` (:func:`flops_rate`)."""
    return " ".join(flops_rate(tflops))


INPUT_EMBEDDINGS = ("embed_tokens", "wte", "wpe")


def param_count(cfg: ModelConfig) -> dict[str, int]:
    """Parameter counts with the unpadded vocabulary, for any model family.

    ``total``: every parameter. ``embedding``: the input lookup tables (token and, for GPT-2,
    position). ``matmul``: the parameters used in matrix multiplies — every leaf with two or more
    dimensions besides ``layers`` except the lookup tables, plus the tied LM head. For a mixture
    of experts ``matmul`` counts the *active* parameters (the convention of Mixtral's and DeepSeek's
    papers): of the routed experts' weights only ``num_experts_per_tok / num_experts``; ``total``
    counts them all, ``active`` is ``total`` counted the same way, and ``routed`` is the routed
    experts' parameters (0 for a dense model).
    """

    table = get_family(cfg).param_shapes_and_axes(cfg, cfg.vocab_size)
    flat = jax.tree_util.tree_flatten_with_path(
        table, is_leaf=lambda x: isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], tuple))[0]
    total = emb = matmul = active = routed = 0
    for path, (shape, axes) in flat:
        size = math.prod(shape)
        name = str(getattr(path[-1], "key", path[-1]))
        total += size
        used = size * cfg.num_experts_per_tok // cfg.num_experts if "expert" in axes else size  # routed: top-k of E
        active += used
        routed += size if "expert" in axes else 0
        if name in INPUT_EMBEDDINGS:
            emb += size
        elif len([a for a in axes if a not in ("layers", "expert")]) >= 2:
            matmul += used
    if cfg.tie_word_embeddings:
        matmul += cfg.vocab_size * cfg.hidden_size
    return {"total": total, "embedding": emb, "matmul": matmul, "active": active, "routed": routed}


def lora_param_count(cfg: ModelConfig) -> int:
    """The parameters of ``cfg.lora``'s adapters (0 when LoRA is off)."""
    if not cfg.lora.enabled:
        return 0
    table = get_family(cfg).param_shapes_and_axes(cfg, cfg.vocab_size)
    return sum(math.prod(shape) for group in adapter_shapes_and_axes(cfg.lora, table, cfg.lora_targets).values()
               for shape, _ in group.values())


def attended_keys(window: int, seq_len: int) -> float:
    """The keys one query attends to, averaged over a causal sequence of ``seq_len`` tokens, as the
    ``6N+attn`` convention counts them: ``t/2`` for the whole prefix (``window`` 0 or >= ``t``), else the
    mean of ``min(i, w)`` over the positions ``i = 1..t``, ``w − w(w − 1)/(2t)``."""
    if not window or window >= seq_len:
        return seq_len / 2
    return window - window * (window - 1) / (2 * seq_len)


def flops_per_token(cfg: ModelConfig, seq_len: int, recompute: bool = False) -> dict[str, float]:
    """Training FLOPs per token in both conventions (module docstring); a mixture of experts counts its
    active parameters (:func:`param_count`). With LoRA the frozen weights' matmuls run forward and
    for the input gradient only (``4N``) and the adapters' all three (``6·N_lora``): the compiled
    step's matmul FLOPs exactly, on the tiny model (``tests/integration/test_lora.py``)."""
    n = param_count(cfg)
    dq, dv = cfg.attention_dims  # q·k and p·v, forward and backward: 6·h·(dq + dv) per attended key
    keys = sum(attended_keys(w, seq_len) for w in cfg.layer_windows)  # L·t/2 without sliding windows
    attention = 6 * keys * cfg.num_attention_heads * (dq + dv)  # 6·L·t·h·q when dq = dv = q, no windows
    if cfg.lora.enabled:  # the frozen weights' matmuls: forward and input gradient only; the adapters' all three
        adapters = lora_param_count(cfg)
        return {"6N+attn": float(4 * n["matmul"] + 6 * adapters + attention),
                "colossal": float(2 * n["active"] * (2 + int(recompute)) + 6 * adapters)}
    model = 6 * n["matmul"] + attention
    colossal = 2 * n["active"] * (3 + int(recompute))  # a mixture of experts: its active parameters
    return {"6N+attn": float(model), "colossal": float(colossal)}


def throughput(cfg: ModelConfig, *, batch_size: int, seq_len: int, step_seconds: float, num_devices: int,
               peak: float | None, recompute: bool = False) -> dict[str, float | None]:
    """Per-step throughput figures.

    Args:
        batch_size: global sequences per step; seq_len: tokens per sequence.
        step_seconds: wall time of one optimizer step (s).
        peak: the devices' peak FLOP/s for the MFU (:func:`mfu_peak`); None: no MFU.

    Returns ``tokens_per_s``, ``samples_per_s``, ``tflops_6n`` and ``tflops_colossal`` (TFLOP/s per
    device), and ``mfu`` (fraction, None without ``peak``).
    """
    tokens = batch_size * seq_len
    fpt = flops_per_token(cfg, seq_len, recompute)

    def per_dev(f):  # TFLOP/s per device of f FLOPs per token
        return f * tokens / step_seconds / num_devices / 1e12

    t6 = per_dev(fpt["6N+attn"])
    return {
        "tokens_per_s": tokens / step_seconds,
        "samples_per_s": batch_size / step_seconds,
        "tflops_6n": t6,
        "tflops_colossal": per_dev(fpt["colossal"]),
        "mfu": (t6 * 1e12 / peak) if peak else None,
    }


def _local_bytes(tree: Any) -> int:
    """Bytes of ``tree``'s arrays that live on the first addressable device."""
    dev = jax.local_devices()[0]
    total = 0
    for x in jax.tree.leaves(tree):
        for s in x.addressable_shards:
            if s.device == dev:
                total += s.data.nbytes
    return total


def model_state_bytes(state: Any, grad_specs: Any, param_shapes: Any, mesh_shape: Mapping[str, int]) -> dict[str, int]:
    """Per-device bytes of params, gradients and optimizer state (the ZeRO paper's (docs/zero.md) p, g, K).

    Params and optimizer state (which includes the fp32 master copy in mixed precision) are
    read from the arrays' shards on the first device (so is LoRA's frozen base, ``frozen``); the fp32 gradient buffer, which exists
    only inside the step, from its ZeRO spec.
    """
    params = _local_bytes(state.params)
    opt = _local_bytes(state.opt_state) + (_local_bytes(state.master) if state.master is not None else 0)
    grads = sum(jax.tree.leaves(jax.tree.map(
        lambda shp, spec: shard_bytes(shp, jnp.float32, spec, mesh_shape), param_shapes, grad_specs,
        is_leaf=lambda x: isinstance(x, tuple) and not isinstance(x, P))))
    frozen = _local_bytes(state.frozen) if getattr(state, "frozen", None) is not None else 0  # LoRA's base
    return {"params": params, "grads": int(grads), "optimizer": opt, "frozen": frozen,
            "total": params + int(grads) + opt + frozen}


def zero_formula_bytes(num_params: int, n: int, zero_stage: int, p: int, g: int, K: int) -> dict[str, float]:
    """the ZeRO formulas (docs/zero.md): expected per-device bytes for Ψ = ``num_params`` over N = ``n`` ZeRO ranks."""
    psi = num_params
    return {
        "params": p * psi / (n if zero_stage >= 3 else 1),
        "grads": g * psi / (n if zero_stage >= 2 else 1),
        "optimizer": K * psi / (n if zero_stage >= 1 else 1),
    }


def json_line(record: Mapping[str, Any]) -> str:
    """One strict-JSON line for ``metrics.jsonl``: a NaN or ±inf value becomes ``null`` and its key
    is listed under ``"nonfinite_values"`` with the value spelt out (``{"loss": "nan"}``), since bare
    ``NaN``/``Infinity`` is not JSON and strict parsers reject the whole line."""
    out, bad = {}, {}
    for k, v in record.items():
        if isinstance(v, float) and not math.isfinite(v):
            out[k], bad[k] = None, str(v)
        else:
            out[k] = v
    if bad:
        out["nonfinite_values"] = bad
    return json.dumps(out, allow_nan=False)


POSTTRAIN_COLUMNS = (("reward", "reward", 4), ("reward_std", "reward_std", 4), ("kl", "kl", 4),
                     ("completions/mean_length", "completion_length", 1),
                     ("rewards/accuracies", "rewards/accuracies", 3), ("rewards/margins", "rewards/margins", 4))
"""``(metric, console name, decimals)``: the columns TRL's console shows for a post-training run, GRPO's
``reward``, ``reward_std``, ``kl``, ``completion_length`` and DPO's ``rewards/accuracies``,
``rewards/margins``."""


def posttrain_columns(m: Mapping[str, Any]) -> dict[str, str]:
    """The :data:`POSTTRAIN_COLUMNS` that step metrics ``m`` hold, by their console name, formatted
    (``{"reward": "0.5000", "completion_length": "3.2"}``); ``{}`` for an SFT step."""
    return {name: f"{m[k]:.{d}f}" for k, name, d in POSTTRAIN_COLUMNS
            if isinstance(m.get(k), (int, float)) and not isinstance(m.get(k), bool)}


def completions_text(rows: Sequence[Mapping[str, Any]]) -> str:
    """``posttrain.log_completions``'s console block: one line per row of
    :meth:`jaxcolossal.posttrain.rollout.Rollouts.take_shown` (its prompt and completion as Python
    literals, then its rewards and advantage to 4 decimals)."""
    lines = [f"completions of the rollout of step {rows[0]['step']}:"]
    for r in rows:
        values = ", ".join(f"{k} {v:.4f}" for k, v in r.items() if k not in ("step", "prompt", "completion"))
        lines.append(f"  {r['prompt']!r} -> {r['completion']!r}: {values}")
    return "\n".join(lines)


def scalars(rec: Mapping[str, Any]) -> dict[str, float]:
    """The scalars of one record, by the name TensorBoard and W&B show: every int or float field but
    ``step`` (not a bool, a list or a string); the goodput summary's (a record with ``event``
    ``"goodput"``) as ``goodput/<name>``, the held-out evaluations' (``val_loss``, DPO's
    ``val_rewards/accuracies``, GRPO's ``val_reward``, ...) as ``eval/<name>``, the others as
    ``train/<name>``."""
    def section(k: str) -> str:
        return "goodput" if rec.get("event") == "goodput" else "eval" if k.startswith("val_") else "train"
    return {f"{section(k)}/{k}": float(v) for k, v in rec.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}


class ScalarSink(Protocol):
    """Where :class:`MetricsWriter` sends each record's :func:`scalars`."""

    def log(self, step: int, values: Mapping[str, float]) -> None:
        """Record ``values`` (name -> value) at training step ``step``."""

    def close(self, exit_code: int = 0) -> None:
        """Flush and close; ``exit_code`` != 0: the run failed."""


class TensorBoardSink:
    """TensorBoard event files in ``log_dir`` (tensorboardX's ``SummaryWriter``).

    Raises:
        DependencyError: no ``tensorboardX`` package.
    """

    def __init__(self, log_dir: str):
        try:
            from tensorboardX import SummaryWriter  # heavy (protobuf): TensorBoard runs only
        except ImportError as e:
            raise DependencyError("logging.tensorboard=true needs the tensorboardX package: "
                                  "pip install tensorboardX") from e
        self.writer = SummaryWriter(log_dir)

    def log(self, step: int, values: Mapping[str, float]) -> None:
        for k, v in values.items():
            self.writer.add_scalar(k, v, step)
        self.writer.flush()

    def close(self, exit_code: int = 0) -> None:
        self.writer.close()


def import_wandb() -> Any:
    """The ``wandb`` module (imported here, for ``logging.wandb`` runs only).

    Raises:
        DependencyError: it is not installed (or does not import): one line naming ``pip install wandb``.
    """
    try:
        import wandb  # heavy (0.6 s, a service process): logging.wandb runs only
    except ImportError as e:
        raise DependencyError(f"logging.wandb=true needs the wandb package: pip install wandb ({e})") from None
    return wandb


class WandbSink:
    """A Weights & Biases run (:func:`wandb.init`) in ``<run_dir>/wandb``, with id ``run_id``; each
    record's scalars are logged at its step (``wandb.log(values, step=step)``).

    Args:
        project: ``""``: ``$WANDB_PROJECT``, else ``jaxcolossal``.
        name: the display name; ``""``: ``run_id``.
        mode: ``auto`` (W&B's own: ``$WANDB_MODE``, else online), ``online``, ``offline``, ``disabled``.
        config: the run's config, as W&B shows it.

    Raises:
        DependencyError: no ``wandb`` package.
        ConfigError: W&B could not start the run (not logged in, no network in online mode): one
            line with W&B's reason and what to set.
    """

    def __init__(self, run_dir: str, run_id: str, project: str = "", name: str = "", mode: str = "auto",
                 config: Mapping[str, Any] | None = None):
        self.wandb = wandb = import_wandb()
        try:
            self.run = wandb.init(project=project or os.environ.get("WANDB_PROJECT") or "jaxcolossal",
                                  name=name or run_id, id=run_id, dir=run_dir,
                                  mode=None if mode == "auto" else mode, config=dict(config or {}))
        except wandb.errors.Error as e:
            reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise ConfigError(f"logging.wandb=true: W&B could not start the run ({reason}); log in with wandb login "
                              "(or set WANDB_API_KEY), or set logging.wandb_mode=offline and upload the run later "
                              "with wandb sync") from None

    def log(self, step: int, values: Mapping[str, float]) -> None:
        self.run.log(dict(values), step=step)

    def table(self, step: int, name: str, rows: Sequence[Mapping[str, Any]]) -> None:
        """``rows`` (dicts with the same keys) as a ``wandb.Table`` named ``name`` at ``step``."""
        columns = list(rows[0])
        self.run.log({name: self.wandb.Table(columns=columns, data=[[r[c] for c in columns] for r in rows])},
                     step=step)

    def close(self, exit_code: int = 0) -> None:
        self.run.finish(exit_code=exit_code)


class MetricsWriter:
    """The run's metric sinks: ``<run_dir>/metrics.jsonl`` (one strict-JSON object per record,
    :func:`json_line`) and the scalar sinks (:class:`ScalarSink`): with ``tensorboard=True``,
    TensorBoard event files in ``<run_dir>/tensorboard/<run_id>`` (TensorBoard shows each run id as a
    run of its own; ``<run_dir>/tensorboard`` when ``run_id`` is empty), and any in ``sinks``
    (:meth:`for_run` adds W&B's).

    Every numeric field of a record with a ``step`` becomes a scalar at that step in each sink, under
    the same name (:func:`scalars`): the held-out evaluations' ``val_*`` as ``eval/val_*``, the goodput
    summary's as ``goodput/<name>``, the others as ``train/<name>`` (``loss``, ``grad_norm``, ``lr``,
    ``tokens_per_s``, ``tflops_6n``, ``mfu``, ``peak_memory_bytes``, ``loss_scale``, ...). Only process 0 writes (the caller passes
    ``enabled=False`` elsewhere; no sink is opened then).

    Raises:
        DependencyError: ``tensorboard=True`` without the ``tensorboardX`` package.
    """

    def __init__(self, run_dir: str, tensorboard: bool = False, enabled: bool = True, run_id: str = "",
                 sinks: Sequence[ScalarSink] = ()):
        self.jsonl = open(os.path.join(run_dir, "metrics.jsonl"), "a") if enabled else None
        self.sinks: list[ScalarSink] = list(sinks) if enabled else []
        if enabled and tensorboard:
            self.sinks.insert(0, TensorBoardSink(os.path.join(run_dir, "tensorboard", run_id)))

    @classmethod
    def for_run(cls, cfg: Config, run_id: str, enabled: bool) -> "MetricsWriter":
        """The sinks ``cfg.logging`` switches on, for the run ``run_id`` (``enabled``: process 0).

        Raises:
            DependencyError: a sink's package is missing (tensorboardX, wandb).
            ConfigError: W&B could not start the run (:class:`WandbSink`).
        """
        lg = cfg.logging
        sinks = [WandbSink(lg.run_dir, run_id, lg.wandb_project, lg.wandb_run_name, lg.wandb_mode,
                           cfg.to_dict())] if enabled and lg.wandb else []
        return cls(lg.run_dir, lg.tensorboard, enabled=enabled, run_id=run_id, sinks=sinks)

    def write(self, rec: Mapping[str, Any]) -> None:
        """Append one record (a flat dict, usually with ``step``) to every sink; one without ``step``
        (``run_start``) goes to ``metrics.jsonl`` only."""
        if self.jsonl:
            self.jsonl.write(json_line(rec) + "\n")
            self.jsonl.flush()
        if self.sinks and "step" in rec:
            values = scalars(rec)
            for sink in self.sinks:
                sink.log(int(rec["step"]), values)

    def table(self, step: int, name: str, rows: Sequence[Mapping[str, Any]]) -> None:
        """``rows`` (dicts with the same keys) as a table named ``name`` at ``step`` in the sinks that
        show tables (W&B's); a no-op without rows or such a sink."""
        for sink in self.sinks:
            if rows and hasattr(sink, "table"):
                sink.table(step, name, rows)

    def close(self, exit_code: int = 0) -> None:
        """Flush and close the sinks (idempotent); ``exit_code`` != 0 marks a failed run (W&B)."""
        if self.jsonl:
            self.jsonl.close()
            self.jsonl = None
        sinks, self.sinks = self.sinks, []
        for sink in sinks:
            sink.close(exit_code)
