"""Output channels over a Unix socket, for a gateway and an engine replica on one Ray node.

A channel's batches (workers/output_channels.py has the protocol) otherwise travel as Ray
objects on a Serve stream: each one passes the replica's Ray threads, the object store's
bookkeeping and the gateway's Ray threads, a handful of thread wake-ups that took ~6 ms per
batch on a busy 2-core machine (docs/benchmarks.md, session 28). On one node the replica
instead offers a socket (`LocalSocket`) as the channel stream's first item; the gateway
connects, names its channel in a first frame, and every later batch is one frame on it, read
by the gateway's event loop directly. The Serve call stays open beside it, empty, as the
channel's lifetime: either side ending it closes the socket, and a socket that ends closes
the channel.

The socket lives in a directory only this user can enter (mode 0700), so only this user's
processes can connect; the replica reads nothing from a connection but a channel id, and the
gateway unpickles only from the socket its replica named over Ray.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import struct
import tempfile
from dataclasses import dataclass

logger = logging.getLogger(__name__)

_HEADER = struct.Struct("!I")  # a frame: its payload's length, then the payload
MAX_CHANNEL_ID_BYTES = 256
NAME_TIMEOUT_S = 10.0  # a connection that has not named its channel by then is closed
_MAX_SOCKET_PATH = 100  # sockaddr_un holds 108 bytes on Linux


@dataclass(frozen=True, slots=True)
class LocalSocket:
    """The first item of a channel's stream when its batches come on this Unix socket."""

    path: str


def frame(payload: bytes) -> bytes:
    return _HEADER.pack(len(payload)) + payload


async def read_frame(reader: asyncio.StreamReader, max_bytes: int | None = None) -> bytes | None:
    """The next frame's payload; None when the stream ends between frames."""
    try:
        header = await reader.readexactly(_HEADER.size)
    except asyncio.IncompleteReadError as error:
        if not error.partial:
            return None
        raise
    (size,) = _HEADER.unpack(header)
    if max_bytes is not None and size > max_bytes:
        raise ValueError(f"a {size}-byte frame where at most {max_bytes} bytes were expected")
    return await reader.readexactly(size)


def ray_node_id() -> str:
    """This process's Ray node, or "" outside Ray (then no channel is local)."""
    try:
        import ray
    except ImportError:
        return ""
    if not ray.is_initialized():
        return ""
    return ray.get_runtime_context().get_node_id()


class SocketListener:
    """The replica's listening socket, made on first use; connections are handed to the
    channel they name (`expect`)."""

    def __init__(self) -> None:
        self.path: str | None = None
        self._directory: str | None = None
        self._server: asyncio.AbstractServer | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._expected: dict[str, asyncio.Future] = {}

    async def start(self) -> str:
        if self.path is None:
            directory = tempfile.mkdtemp(prefix="baton-channels-")  # mode 0700
            path = os.path.join(directory, "outputs.sock")
            if len(path.encode()) > _MAX_SOCKET_PATH:  # a long TMPDIR
                shutil.rmtree(directory, ignore_errors=True)
                directory = tempfile.mkdtemp(prefix="baton-channels-", dir="/tmp")
                path = os.path.join(directory, "outputs.sock")
            self._server = await asyncio.start_unix_server(self._accept, path)
            self._loop = asyncio.get_running_loop()
            self._directory, self.path = directory, path
        return self.path

    def expect(self, channel_id: str) -> asyncio.Future:
        """Resolves to (reader, writer) when the gateway of `channel_id` connects."""
        older = self._expected.get(channel_id)
        if older is not None:
            self.forget(channel_id, older)
        future = self._expected[channel_id] = asyncio.get_running_loop().create_future()
        return future

    def forget(self, channel_id: str, future: asyncio.Future) -> None:
        """Stops waiting for a connection that `expect` returned `future` for."""
        if self._expected.get(channel_id) is future:
            del self._expected[channel_id]
        future.cancel()

    def close(self) -> None:
        """Stops listening and removes the socket (from any thread); open connections stay
        until their channels end."""
        server, loop = self._server, self._loop
        if server is not None and loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._stop, server)
        if self._directory is not None:
            shutil.rmtree(self._directory, ignore_errors=True)
        self.path = self._directory = self._server = self._loop = None

    def _stop(self, server: asyncio.AbstractServer) -> None:
        for channel_id, future in list(self._expected.items()):
            self.forget(channel_id, future)
        server.close()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            name = await asyncio.wait_for(read_frame(reader, MAX_CHANNEL_ID_BYTES), NAME_TIMEOUT_S)
        except Exception:  # timed out, or a frame that is not a name
            name = None
        channel_id = name.decode(errors="replace") if name else ""
        future = self._expected.pop(channel_id, None)
        if future is None or future.done():
            logger.warning("output channel socket: a connection for %r, which is not opening here", channel_id)
            writer.close()
            return
        future.set_result((reader, writer))
