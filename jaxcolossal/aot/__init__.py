"""Compiling for a GPU fleet without its GPUs: the targets as data (:mod:`jaxcolossal.aot.target`),
the run's real train step compiled for them (:mod:`jaxcolossal.aot.fleet`), the compiled HLO read
back (:mod:`jaxcolossal.aot.hlo`: collectives, memory, custom calls) and its schedule
(:mod:`jaxcolossal.aot.gpu_schedule`: what the collectives overlap)."""

from jaxcolossal.aot.target import TARGETS, Target, compile_only_devices, get_target, parse_fleet

__all__ = ["TARGETS", "Target", "compile_only_devices", "get_target", "parse_fleet"]
