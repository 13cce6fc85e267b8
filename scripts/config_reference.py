"""Write docs/config.md, the configuration reference, from the attribute docstrings of
jaxcolossal/config/schema.py (:func:`jaxcolossal.config.config_reference_markdown`).

    python scripts/config_reference.py            # (re)write docs/config.md
    python scripts/config_reference.py --check    # exit 1 when docs/config.md is not up to date

Exit status: 0 written or up to date; 1 with --check when the file differs or is missing.
"""

import argparse
import os
import sys

from jaxcolossal.config import config_reference_markdown

PAGE = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "docs", "config.md"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="only compare: exit 1 when docs/config.md differs")
    ap.add_argument("--out", default=PAGE, help="the page to write or check (default: docs/config.md)")
    args = ap.parse_args(argv)
    text = config_reference_markdown()
    if args.check:
        try:
            with open(args.out, encoding="utf-8") as f:
                same = f.read() == text
        except FileNotFoundError:
            same = False
        if not same:
            print(f"{args.out} is not up to date: run python scripts/config_reference.py", file=sys.stderr)
            return 1
        print(f"{args.out} is up to date")
        return 0
    with open(args.out, "w", encoding="utf-8") as f:
        f.write(text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
