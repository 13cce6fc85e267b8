"""``python -m jaxcolossal.plan``: pick a layout for a model on a cluster before renting it."""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
from typing import Callable

from jaxcolossal.config import Config, ConfigError, config_from_dict, load_config
from jaxcolossal.errors import DependencyError
from jaxcolossal.models.hf_io import config_from_hf, read_hf_config
from jaxcolossal.plan.devices import DEVICES, Device, device_key
from jaxcolossal.plan.search import plan_layouts
from jaxcolossal.plan.seed_table import seed_table

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
"""The repository (for ``configs/``)."""


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m jaxcolossal.plan", description=DESCRIPTION)
    ap.add_argument("--seed-table", action="store_true",
                    help="print the published rows (Colossal-AI, MaxText, torchtitan) beside the planner's predictions "
                    "and nothing else; takes no other option")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="a benchmark preset: configs/bench/<name>.yaml (llama_1b, llama3_8b, llama3_70b, ...)")
    src.add_argument("--config", help="a config file")
    src.add_argument("--hf-config", help="a Hugging Face config.json, or its folder (LLaMA or GPT-2)")
    ap.add_argument("--devices", type=int, required=True, help="number of accelerators")
    ap.add_argument("--device", default="h100", help=f"one of {sorted(DEVICES)} (default h100)")
    ap.add_argument("--memory-gb", type=float, help="override the device memory (GB)")
    ap.add_argument("--peak-tflops", type=float, help="override the bf16 peak (TFLOP/s)")
    ap.add_argument("--devices-per-node", type=int, help="default 8")
    ap.add_argument("--intra-gbps", type=float, help="intra-node bandwidth per device, GB/s")
    ap.add_argument("--inter-gbps", type=float, help="inter-node bandwidth per device, GB/s")
    ap.add_argument("--seq", type=int, help="sequence length (default: the config's)")
    ap.add_argument("--global-batch", type=int, help="sequences per step (default: the config's batch_size, or its "
                    "micro_batch_size × --devices)")
    ap.add_argument("--efficiency", type=float, default=0.45, help="fraction of peak the matmuls reach (0.45)")
    ap.add_argument("--top", type=int, default=8, help="how many fitting layouts to list (default 8)")
    ap.add_argument("--confirm", type=int, default=0, metavar="K",
                    help="compile the K fastest fitting layouts for the fleet with XLA's GPU compiler (no GPU needed; "
                    "the gpu-compile extra) and rank them again by the compiled memory and schedule (default 0: off)")
    return ap


def confirm_target(top: int, device_name: str) -> str:
    """The compile target of ``--confirm K`` on ``--device`` (:attr:`Device.target`).

    Raises:
        ConfigError: ``K`` below 1, or a device without a compile target (``a100-40``).
    """
    if top < 1:
        raise ConfigError(f"--confirm {top}: the number of layouts to compile, at least 1 (0, the default: off)")
    device = DEVICES.get(device_key(device_name))
    if device is None or not device.target:
        raise ConfigError(f"--confirm: no GPU compile target for --device {device_name!r}; --confirm compiles for "
                          f"{sorted(k for k, d in DEVICES.items() if d.target)}")
    return device.target


def _given_or(given: float | None, scale: float, default: float) -> float:
    """An override ``given`` in its flag's unit times ``scale``, else the device's ``default``."""
    return given * scale if given is not None else default


def _device(a: argparse.Namespace) -> Device:
    """The ``--device`` with the overrides given.

    Raises:
        ConfigError: an unknown device, or a value that is not positive.
    """
    name = device_key(a.device)
    if name not in DEVICES:
        raise ConfigError(f"--device {a.device!r}: known devices are {sorted(DEVICES)} (a100 = a100-80); or give --memory-gb and "
                          "--peak-tflops with the closest one")
    for flag, value in (("--memory-gb", a.memory_gb), ("--peak-tflops", a.peak_tflops),
                        ("--intra-gbps", a.intra_gbps), ("--inter-gbps", a.inter_gbps)):
        if value is not None and not (math.isfinite(value) and value > 0):
            raise ConfigError(f"{flag} {value:g}: must be a positive number")
    if a.devices_per_node is not None and a.devices_per_node < 1:
        raise ConfigError(f"--devices-per-node {a.devices_per_node}: must be at least 1")
    if not (math.isfinite(a.efficiency) and 0 < a.efficiency <= 1):
        raise ConfigError(f"--efficiency {a.efficiency:g}: the fraction of the peak the matmuls reach, in (0, 1]")
    if a.top < 1:
        raise ConfigError(f"--top {a.top}: must be at least 1")
    if a.devices < 1:
        raise ConfigError(f"--devices {a.devices}: must be at least 1")
    dev = DEVICES[name]
    return dataclasses.replace(dev, memory=_given_or(a.memory_gb, 1e9, dev.memory),
                               peak=_given_or(a.peak_tflops, 1e12, dev.peak),
                               per_node=_given_or(a.devices_per_node, 1, dev.per_node),
                               intra_bw=_given_or(a.intra_gbps, 1e9, dev.intra_bw),
                               inter_bw=_given_or(a.inter_gbps, 1e9, dev.inter_bw))


def _config(a: argparse.Namespace) -> tuple[Config, str, dict | None]:
    """``(config, the --config part of the command that runs it, model overrides)`` from ``--model``,
    ``--config`` or ``--hf-config``, with ``--seq`` and ``--global-batch``.

    Raises:
        ConfigError: no such config or Hugging Face file, or the config's own errors.
    """
    training = {k: v for k, v in (("seq_len", a.seq), ("batch_size", a.global_batch)) if v is not None}
    if a.model or a.config:
        path = a.config or os.path.join(ROOT, "configs", "bench", f"{a.model}.yaml")
        if not os.path.exists(path):
            presets = sorted(f[:-5] for f in os.listdir(os.path.join(ROOT, "configs", "bench")) if f.endswith(".yaml"))
            raise ConfigError(f"no such config: {path}" + (f"; the presets are {presets}" if a.model else ""))
        cfg = load_config(path, overrides=[f"training.{k}={v}" for k, v in training.items()])
        return cfg, f"--config {path if a.config else f'configs/bench/{a.model}.yaml'}", None
    if not os.path.exists(a.hf_config):
        raise ConfigError(f"--hf-config {a.hf_config}: no such file or folder")
    folder = a.hf_config if os.path.isdir(a.hf_config) else os.path.dirname(os.path.abspath(a.hf_config))
    # planned for GPUs: cuDNN's fused attention (XLA's attention elsewhere), as the bench presets
    model = {**dataclasses.asdict(config_from_hf(read_hf_config(folder))), "attention_impl": "cudnn"}
    cfg = config_from_dict({"model": model, "training": training, "precision": {"bf16": True}})
    default = dataclasses.asdict(load_config(os.path.join(ROOT, "configs", "llama_tiny.yaml")).model)
    return cfg, "", {f"model.{k}": v for k, v in model.items() if v != default.get(k) and k != "remat"}


DESCRIPTION = ("Pick a layout for a model on a GPU cluster before renting it: every dp/tp/pp × ZeRO × remat × "
               "accumulation, predicted and ranked by step time; --confirm K compiles the K fastest for the fleet "
               "with XLA's GPU compiler (no GPU needed); --seed-table prints published benchmark rows beside the "
               "planner's predictions. docs/planner.md")


def main(argv: list[str] | None = None, confirm: Callable[..., str] | None = None) -> int:
    """``python -m jaxcolossal.plan`` (:data:`DESCRIPTION`). ``confirm``:
    :func:`jaxcolossal.aot.confirm.report`, which ``--confirm K`` calls (the command line passes it
    in; the planner never imports the compiler, which builds the train step)."""
    argv = sys.argv[1:] if argv is None else argv
    if "--seed-table" in argv:  # the published rows beside the planner's predictions
        if len(argv) > 1:
            print("error: --seed-table takes no other option", file=sys.stderr)
            return 2
        print(seed_table())
        return 0
    a = _parser().parse_args(argv)
    try:
        dev = _device(a)
        if a.confirm:  # checked before the search, so that bad input costs nothing
            if confirm is None:
                raise ConfigError("--confirm is offered by the command line, python -m jaxcolossal.plan")
            confirm_target(a.confirm, a.device)
        cfg, source, model_overrides = _config(a)
        if not a.global_batch and cfg.training.micro_batch_size:
            cfg.training.batch_size = cfg.training.micro_batch_size * a.devices
        cfg.training.micro_batch_size = 0
        plan = plan_layouts(cfg, a.devices, dev, a.efficiency, a.top, source, model_overrides)
        print(plan.text())
        if a.confirm and plan.best:
            print("\n" + confirm(cfg, a.devices, a.device, dev, a.confirm, a.efficiency, source, model_overrides))
    except (ConfigError, OSError, DependencyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not plan.layouts:
        print(f"error: no layout of this model on {a.devices} devices accepts a global batch of "
              f"{cfg.training.batch_size} × {cfg.training.seq_len} tokens (the batch must divide over the "
              "data-parallel group, the layers over pp, the heads over tp): try a batch that is a multiple of "
              "the device count", file=sys.stderr)
        return 1
    if not plan.best:
        print(f"error: no layout of this model fits {a.devices} × {dev.name}: more devices, a shorter sequence, "
              "a smaller batch, or the offload section (docs/offload.md)", file=sys.stderr)
        return 1
    return 0
