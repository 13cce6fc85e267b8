"""``python -m jaxcolossal.run``: the local multi-process launcher's command line.

The launcher lives in :mod:`jaxcolossal.runtime.run`; this module keeps its command name
(``python -m jaxcolossal.run --nproc N script.py ...``) as users know it.
"""

import sys

from jaxcolossal.runtime.run import main

if __name__ == "__main__":
    sys.exit(main())
