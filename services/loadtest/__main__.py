"""`python -m baton.services.loadtest run|compare ...`: the same as `baton bench`."""

import sys

from .cli import main_argv

sys.exit(main_argv())
