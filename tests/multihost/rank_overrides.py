"""Run scripts/train.py with extra ``section.key=value`` overrides for some ranks only.

    JAXCOLOSSAL_TEST_RANK_OVERRIDES="1:training.max_steps=2" python rank_overrides.py [train.py args]

Used by the multi-process tests to make the processes of one job disagree (a rank that leaves
the training loop early), which a launcher cannot do: it gives every process the same command.
"""
import os
import runpy
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

if __name__ == "__main__":
    rank = os.environ.get("RANK", "0")
    extra = [item.split(":", 1)[1]
             for item in os.environ.get("JAXCOLOSSAL_TEST_RANK_OVERRIDES", "").split(",")
             if item.strip() and item.split(":", 1)[0].strip() == rank]
    sys.argv = [str(REPO / "scripts" / "train.py"), *sys.argv[1:], *extra]
    runpy.run_path(sys.argv[0], run_name="__main__")
