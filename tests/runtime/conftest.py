"""Runtime tests import their helper modules from this directory."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
