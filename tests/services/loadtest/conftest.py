"""Makes `loadtest_helpers` (records and a fake backend for the unit tests) importable."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
