"""One Redis connection for the routing path's scripts: calls that wait, writes that do not.

    channel.call(script, args)   sends, reads the replies owed by earlier sends, then its own
    channel.send(script, args)   sends and returns at once; its reply is read (and checked)
                                 before the next call's, or by flush()

Redis runs one connection's commands in order, so a call always sees every earlier send,
and other clients see a send as soon as Redis has read it; only the sender skips waiting
a round trip for an answer it does not need. A decision is then one round trip: the query
waits, the speculative write that follows it does not.

Scripts are loaded (SCRIPT LOAD) each time the connection opens, so EVALSHA never meets a
server that lost them in a restart. A connection error or timeout closes the connection
(the next use reopens it) and reaches the caller; replies owed by lost sends are forgotten.
Commands are packed here (RESP, with each script's EVALSHA prefix made once): arguments are
str, bytes or int, and redis-py's general packer costs more than the rest of a send.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Iterable, Sequence
from typing import Any

import redis

logger = logging.getLogger(__name__)
_MAX_UNREAD = 64  # sends whose replies may wait; beyond it a send reads them first


class ScriptChannel:
    def __init__(self, client: redis.Redis, scripts: Iterable[str]) -> None:
        self._pool = client.connection_pool
        self._shas = {source: hashlib.sha1(source.encode()).hexdigest() for source in scripts}
        self._prefixes = {source: _pack_args(["EVALSHA", sha, 0]) for source, sha in self._shas.items()}
        self._lock = threading.Lock()  # one conversation at a time on the connection
        self._conn = None
        self._num_unread = 0
        self.num_send_errors = 0  # sends whose script failed (reported at the next read)

    def call(self, script: str, args: Sequence[Any]) -> Any:
        command = self._pack(script, args)
        with self._lock:
            conn = self._open()
            try:
                conn.send_packed_command([command], check_health=False)
                self._drain(conn)
                return conn.read_response()
            except redis.ResponseError:  # the script's own error: the connection is still in step
                raise
            except BaseException:  # lost or out of step (a timeout mid-reply): start afresh
                self._close()
                raise

    def send(self, script: str, args: Sequence[Any]) -> None:
        command = self._pack(script, args)
        with self._lock:
            conn = self._open()
            try:
                if self._num_unread >= _MAX_UNREAD:
                    self._drain(conn)
                conn.send_packed_command([command], check_health=False)
                self._num_unread += 1
            except BaseException:
                self._close()
                raise

    def flush(self) -> None:
        """Waits until Redis has answered every send."""
        with self._lock:
            if self._conn is None:
                return
            try:
                self._drain(self._conn)
            except BaseException:
                self._close()
                raise

    def close(self) -> None:
        with self._lock:
            self._close()

    def _pack(self, script: str, args: Sequence[Any]) -> bytes:
        return b"*%d\r\n%s%s" % (3 + len(args), self._prefixes[script], _pack_args(args))

    def _open(self):
        if self._conn is None:
            conn = self._pool.get_connection()
            try:
                for source in self._shas:
                    conn.send_command("SCRIPT", "LOAD", source)
                    conn.read_response()
            except BaseException:
                conn.disconnect()
                self._pool.release(conn)
                raise
            self._conn = conn
        return self._conn

    def _drain(self, conn) -> None:
        while self._num_unread:
            self._num_unread -= 1
            try:
                conn.read_response()
            except redis.ResponseError as e:  # the script failed; the connection is still in step
                self.num_send_errors += 1
                logger.warning("a routing write failed in Redis: %s", e)

    def _close(self) -> None:
        if self._conn is not None:
            self._conn.disconnect()
            self._pool.release(self._conn)
            self._conn = None
        self._num_unread = 0


def _pack_args(args: Iterable[Any]) -> bytes:
    """RESP bulk strings: `$<length>\r\n<bytes>\r\n` each."""
    parts = []
    for arg in args:
        if isinstance(arg, str):
            arg = arg.encode()
        elif isinstance(arg, int):
            arg = b"%d" % arg
        elif not isinstance(arg, bytes):
            raise TypeError(f"script arguments are str, bytes or int, got {type(arg).__name__}")
        parts.append(b"$%d\r\n%s\r\n" % (len(arg), arg))
    return b"".join(parts)
