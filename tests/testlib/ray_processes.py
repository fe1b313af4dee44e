"""Processes of the Ray cluster this test process started, found by their titles in /proc.

Ray names a replica's process `ray::ServeReplica:<app>:<deployment>`, with `.<method>` appended
while a call runs (an async replica's overlapping calls can leave it so between calls); only
processes that descend from this one count, so another cluster on the machine is never touched."""

from __future__ import annotations

import os
from pathlib import Path


def replica_pids(role: str, app: str = "baton") -> list[int]:
    return titled_pids(f"ray::ServeReplica:{app}:{role}")


def titled_pids(title: str) -> list[int]:
    """Our processes whose title is `title` (`ray::ServeController`, `ray::ProxyActor`, ...)."""
    return sorted(pid for pid, cmdline in _processes() if _is_titled(cmdline, title) and _is_ours(pid))


def script_pids(name: str) -> list[int]:
    """Our processes running the Python script `name` (`log_monitor.py`, `monitor.py`)."""
    return sorted(
        pid
        for pid, cmdline in _processes()
        if any(Path(arg).name == name for arg in cmdline.split(" ")[1:3]) and _is_ours(pid)
    )


def environment(pid: int) -> dict[str, str]:
    """The environment a process started with."""
    with open(f"/proc/{pid}/environ", "rb") as environ:
        items = environ.read().split(b"\0")
    return dict(item.decode(errors="replace").split("=", 1) for item in items if b"=" in item)


def _is_titled(cmdline: str, title: str) -> bool:
    first = cmdline.split(" ", 1)[0]
    return first == title or first.startswith(title + ".")


def _processes():
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:  # gone meanwhile
            continue
        yield int(entry.name), cmdline


def _parent(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])  # after "(comm)": state, then ppid


def _is_ours(pid: int) -> bool:
    me, current = os.getpid(), pid
    while current and current != 1:
        if current == me:
            return True
        current = _parent(current)
    return False
