"""A connector's NIXL agent, and the control messages it carries (nixl_connector.py says
what the messages mean).

`create_agent` loads NIXL (the `nixl` package if present, else `nixl-cu12`) and makes an
agent with a UCX backend and a metadata listener on a free port. `Mailbox` sends and
receives the control messages as NIXL notifications holding small JSON documents; a
message to a peer whose metadata has not arrived here yet waits until it has, or until its
deadline. Neither is thread-safe: the connector's loop thread makes every call.
"""

from __future__ import annotations

import importlib
import json
import logging
import socket
from collections.abc import Iterator
from typing import Any

logger = logging.getLogger(__name__)


def load_nixl() -> tuple[type, type]:
    """(nixl_agent, nixl_agent_config): from the `nixl` package if present, else `nixl-cu12`."""
    for module in ("nixl._api", "nixl_cu12._api"):
        try:
            api = importlib.import_module(module)
            return api.nixl_agent, api.nixl_agent_config
        except (ImportError, OSError):  # OSError: the package is there but its libraries do not load
            continue
    raise RuntimeError(
        "kv_transfer.transport 'nixl' needs NVIDIA NIXL, which is not installed: "
        "pip install nixl-cu12 (or baton[nixl]); or use transport 'torch' (NCCL on GPUs, gloo on CPUs)"
    )


def create_agent(name: str) -> tuple[Any, int]:
    """(agent, its metadata listener's port). No progress thread: the caller's polling drives UCX."""
    nixl_agent, nixl_agent_config = load_nixl()
    for attempt in range(3):  # the port may be taken between the probe and the agent's bind
        port = _free_port()
        config = nixl_agent_config(
            enable_prog_thread=False, enable_listen_thread=True, listen_port=port, backends=["UCX"]
        )
        try:
            agent = nixl_agent(name, config)
            break
        except RuntimeError as error:
            if "bind" not in str(error).lower() or attempt == 2:
                raise
    if "UCX" not in agent.backends:
        raise RuntimeError("NIXL's UCX backend plugin is missing from this installation")
    return agent, port


class Mailbox:
    def __init__(self, agent: Any, name: str, timeout_s: float) -> None:
        self.agent = agent
        self.name = name  # for log lines
        self.timeout_s = timeout_s
        self._outbox: list[tuple[str, bytes, float]] = []

    def __bool__(self) -> bool:
        """Messages wait to leave."""
        return bool(self._outbox)

    def send(self, peer: str, message: dict, now: float) -> None:
        """Queues a message; `flush` sends it once the peer's metadata is loaded here."""
        self._outbox.append((peer, json.dumps(message).encode(), now + self.timeout_s))

    def flush(self, now: float) -> None:
        waiting = []
        for peer, payload, deadline in self._outbox:
            if self.agent.check_remote_metadata(peer):
                try:
                    self.agent.send_notif(peer, payload)
                except Exception as error:
                    logger.warning("NIXL connector %s: message to %s lost: %s", self.name, peer, error)
            elif now <= deadline:
                waiting.append((peer, payload, deadline))
            else:
                logger.warning("NIXL connector %s: %s never became reachable", self.name, peer)
        self._outbox = waiting

    def receive(self) -> Iterator[tuple[str, str, dict]]:
        """(peer, op, message) for each message that arrived; unreadable ones are logged."""
        for peer, messages in self.agent.get_new_notifs().items():
            for raw in messages:
                try:
                    message = json.loads(raw)
                    op = message["op"]
                except (ValueError, KeyError, TypeError):
                    logger.warning("NIXL connector %s: unreadable message from %s: %r", self.name, peer, raw[:200])
                    continue
                yield peer, op, message


def _free_port() -> int:
    """A port free now, for the agent's metadata listener (NIXL does not report one it picked)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("", 0))
        return probe.getsockname()[1]
