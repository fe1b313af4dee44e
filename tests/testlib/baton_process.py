"""`baton serve` as an operator runs it: a subprocess in a session of its own, so every process
it starts (Ray's, the local redis-server) can be found by session id afterwards, and a test
can signal the `baton serve` process alone."""

from __future__ import annotations

import contextlib
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
READY_LINE = "Ctrl-C or SIGTERM stops"


def session_pids(session_id: int) -> dict[int, str]:
    """pid -> command line of every live process in that session (from /proc)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:  # it exited meanwhile
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # the command name may hold spaces
        if fields[0] != "Z" and int(fields[3]) == session_id:
            found[int(entry.name)] = cmdline
    return found


class BatonServe:
    """Starts `baton serve --config <colocated config on free ports>`; `output` keeps its lines.
    `workdir` must be short (e.g. under /tmp): Ray's socket paths in it are limited to 107 bytes."""

    def __init__(
        self,
        workdir: Path,
        model: Path,
        grace_period_s: float,
        extra_args: Sequence[str] = (),
        env: dict[str, str] | None = None,
    ) -> None:
        """`extra_args` go after the others (`baton serve` flags win over its config); `env` adds
        to this process's environment."""
        config = yaml.safe_load((REPO / "configs" / "local-colocated.yaml").read_text())
        config["server"].update(http_port=0, grpc_port=0, metrics_port=0)  # free ports: runs share the machine
        self.config_path = workdir / "baton.yaml"
        self.config_path.write_text(yaml.safe_dump(config))
        command = [sys.executable, "-m", "baton.services.cli", "serve", "--config", str(self.config_path)]
        command += ["--model", str(model), "--grace-period", str(grace_period_s), *extra_args]
        self.process = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
            env={**os.environ, "BATON_HOME": str(workdir / "home"), **(env or {})},
        )
        self.output: list[str] = []
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    @property
    def session_id(self) -> int:
        return self.process.pid  # start_new_session: it leads its own session

    def wait_for(self, prefix: str, timeout_s: float = 180.0) -> str:
        """The first line of output (from now on) that starts with `prefix`."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                line = self._lines.get(timeout=1.0)
            except queue.Empty:
                continue
            if line is None:
                raise AssertionError(f"baton serve exited before printing {prefix!r}:\n{self.text()}")
            if line.startswith(prefix):
                return line
        raise AssertionError(f"baton serve did not print {prefix!r} within {timeout_s:g} s:\n{self.text()}")

    def wait_ready(self) -> str:
        """The gRPC address, once `baton serve` says it is serving."""
        self.wait_for(READY_LINE)
        return re.search(r"^gRPC\s+(\S+)", self.text(), re.MULTILINE).group(1)

    def signal(self, sig: int = signal.SIGTERM) -> None:
        os.kill(self.process.pid, sig)  # this process alone, not its group

    def text(self) -> str:
        return "".join(self.output)

    def kill_session(self) -> None:
        """Clean-up after a failed test: SIGKILL what is left of the session this test started."""
        for pid in session_pids(self.session_id):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.process.wait(timeout=10)

    def _read(self) -> None:
        for line in self.process.stdout:
            self.output.append(line)
            self._lines.put(line)
        self._lines.put(None)
