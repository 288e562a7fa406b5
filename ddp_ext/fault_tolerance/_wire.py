"""The coordinator's control connection: one JSON object per line, both ways.

Replica to coordinator: {"type": "hello", ...} once, then {"type": "hb"}
heartbeats, {"type": "abort", "epoch": e} when a step or a group formation
of epoch e failed, {"type": "formed", "epoch": e} when one formed.
Coordinator to replica: {"type": "welcome"} or {"type": "refused",
"reason": ...} in answer to hello, {"type": "epoch", "epoch": e, "members":
[...], "history": bool} whenever membership changes, and {"type": "dropped",
"reason": ...} just before it closes the connection of a replica it stopped
hearing from.
"""

import json
import socket
from typing import List, Optional

MAX_LINE = 1 << 20


def encode(message: dict) -> bytes:
    return (json.dumps(message) + "\n").encode()


def send(sock: socket.socket, message: dict) -> None:
    sock.sendall(encode(message))


class LineReader:
    """Splits what a socket delivers into JSON messages."""

    def __init__(self):
        self._pending = b""

    def feed(self, data: bytes) -> List[dict]:
        self._pending += data
        if len(self._pending) > MAX_LINE and b"\n" not in self._pending:
            raise ValueError("control message longer than 1 MiB")
        *lines, self._pending = self._pending.split(b"\n")
        return [json.loads(line) for line in lines if line.strip()]


def parse_address(address: str, default_port: Optional[int] = None):
    """'host:port' (or 'host' with a default port) -> (host, port)."""
    host, sep, port = address.rpartition(":")
    if not sep:
        if default_port is None:
            raise ValueError(f"coordinator address must be 'host:port', got {address!r}")
        return address, default_port
    return host or "127.0.0.1", int(port)
