"""``python -m spmd``: see ``spmd.cli``."""

import sys

from spmd.cli import main

if __name__ == "__main__":
    sys.exit(main())
