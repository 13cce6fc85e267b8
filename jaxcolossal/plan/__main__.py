"""``python -m jaxcolossal.plan``: the layout planner's command line (:mod:`jaxcolossal.plan.cli`)."""

import sys

from jaxcolossal.plan.cli import main

sys.exit(main())
