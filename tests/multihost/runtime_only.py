"""Import jaxcolossal's runtime modules (faults, heartbeat, watchdog) without the package's ``__init__``.

``import jaxcolossal`` imports jax, flax and the models: 2 s a process on the 2-core machine, against
50 ms for the runtime's modules, which import only the standard library and each other. The quick
launcher tests start 2 to 4 stand-in processes several times each, so their workers import this first
(``import runtime_only``): it registers an empty ``jaxcolossal`` package over the repository's folder,
unless the real one is imported already.
"""
import sys
import types
from pathlib import Path

sys.modules.setdefault("jaxcolossal", types.ModuleType("jaxcolossal")).__path__ = [
    str(Path(__file__).resolve().parents[2] / "jaxcolossal")]
