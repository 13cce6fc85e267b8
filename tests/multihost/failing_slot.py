"""Run scripts/train.py, except in the launcher slot named by ``JAXCOLOSSAL_TEST_FAILING_SLOT``, which
exits with status 1 at once, at every start (a host that cannot come back).

    JAXCOLOSSAL_TEST_FAILING_SLOT=3 python -m jaxcolossal.run --nproc 2:4 --max-restarts 2 failing_slot.py [train.py args]

Used by tests/multihost/test_restarts.py (repeated failure, shrink).
"""
import os
import runpy
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

if __name__ == "__main__":
    slot = os.environ.get("JAXCOLOSSAL_SLOT", "")
    if slot and slot == os.environ.get("JAXCOLOSSAL_TEST_FAILING_SLOT", "").strip():
        print(f"FAULT slot {slot} fails at start (restart {os.environ.get('JAXCOLOSSAL_RESTART_COUNT')})", flush=True)
        sys.exit(1)
    sys.argv = [str(REPO / "scripts" / "train.py"), *sys.argv[1:]]
    runpy.run_path(sys.argv[0], run_name="__main__")
