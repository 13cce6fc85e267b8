"""Compiling for a GPU fleet without its GPUs: the targets as data (:mod:`jaxcolossal.aot.target`)
and the run's real train step compiled for them (:mod:`jaxcolossal.aot.fleet`)."""

from jaxcolossal.aot.target import TARGETS, Target, compile_only_devices, get_target, parse_fleet

__all__ = ["TARGETS", "Target", "compile_only_devices", "get_target", "parse_fleet"]
