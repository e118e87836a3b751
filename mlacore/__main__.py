"""`python -m mlacore` is the `mla` command."""

import sys

from mlacore.tools.cli import main

if __name__ == "__main__":
    sys.exit(main())
