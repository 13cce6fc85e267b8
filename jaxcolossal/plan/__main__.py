"""``python -m jaxcolossal.plan``: the layout planner's command line (:mod:`jaxcolossal.plan.cli`).

The one place where the planner meets the GPU compiler: ``--confirm K`` compiles the planner's top
layouts with :func:`jaxcolossal.aot.confirm.report`. This entry point passes it in, so that the
planner's modules never import the compiler (which builds the train step); the import-linter
contract in pyproject.toml names this one edge as allowed.
"""

import sys

from jaxcolossal.aot.target import prepare_environment

prepare_environment()  # before jax starts: the GPU compiler's environment on a machine without a GPU

from jaxcolossal.aot.confirm import report  # noqa: E402
from jaxcolossal.plan.cli import main  # noqa: E402

sys.exit(main(confirm=report))
