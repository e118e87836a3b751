"""`python -m mlacore` is the `mla` command."""

import sys

from mlacore.tools.cli import main

sys.exit(main())
