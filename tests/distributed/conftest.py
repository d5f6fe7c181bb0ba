"""Multi-process tests import their launcher and worker modules from this directory."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
