"""Where `baton serve`'s log records go: the console shows `--log-level` and up (warning by
default, so a normal start and stop print only Baton's own lines), and the run folder's
`baton.log` keeps INFO and up from Baton, Ray and Serve in this process. Ray's and Serve's
own processes (raylet, GCS, controller, proxies, replicas) write into Ray's session folder
(`<ray temp>/session_*/logs`, Serve's under `logs/serve`), whose path `baton serve` prints.

Loggers: `baton` (ours), `ray` (`ray.init` sets its level from `logging_level`), and
`ray.serve`, which Serve configures on import with a stream handler of its own and which does
not propagate to `ray`. One record is dropped outright: `serve.run` calls Serve's start again
and logs "Connecting to existing Serve app ... New http_options/controller_options will not be
applied", which is false here, since `serve.start` applied Baton's options just before.
"""

from __future__ import annotations

import logging
from pathlib import Path

LEVELS = ("debug", "info", "warning", "error")
DEFAULT_LEVEL = "warning"
LOG_FILE = "baton.log"
_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class _NotSecondServeStart(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Connecting to existing Serve app")


def level_number(level: str) -> int:
    return logging.getLevelName(level.upper())


def file_level(level: str) -> int:
    """The run folder's log keeps INFO and up, or more when the console asks for more."""
    return min(level_number(level), logging.INFO)


def configure(level: str, run_dir: Path) -> Path:
    """Sets Baton's, Ray's and Serve's driver loggers up (imports Ray and Serve); returns the log file."""
    from ..ray_env import import_ray

    import_ray()
    import ray.serve  # noqa: F401 - configures the `ray.serve` logger, which is then adjusted here

    console_level, kept_level = level_number(level), file_level(level)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOG_FILE
    to_file = logging.FileHandler(path)
    to_file.setLevel(kept_level)
    to_file.setFormatter(logging.Formatter(_FORMAT))

    baton = logging.getLogger("baton")
    to_console = logging.StreamHandler()
    to_console.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    baton.addHandler(to_console)
    baton.propagate = False
    for name in ("baton", "ray", "ray.serve"):
        logger = logging.getLogger(name)
        logger.setLevel(kept_level)
        for handler in logger.handlers:  # Ray's and Serve's console handlers, and Baton's
            handler.setLevel(console_level)
        logger.addHandler(to_file)
    logging.getLogger("ray.serve").addFilter(_NotSecondServeStart())
    return path
