"""The replica's end of the control connection: a thread that sends
heartbeats and keeps the latest epoch the coordinator announced.

Note [A silent link]
~~~~~~~~~~~~~~~~~~~~
A peer that dies has its connections closed by its kernel, and whoever
waits on them hears at once. A cut link (a cable, a switch, a firewall that
drops) says nothing: no reset, no carrier change; a blocked recv waits until
TCP gives up, a quarter of an hour later. Every wait of a replica is bounded
instead, by its heartbeat timeout:
  - Gloo's collectives, group formations and heal transfers: the group's
    timeout is the heartbeat timeout (ddp_ext/fault_tolerance/group.py);
  - the control link: TCP_USER_TIMEOUT (the kernel drops a connection whose
    sent data stays unacknowledged that long; heartbeats are always in
    flight, so a cut is found within the timeout) and a send timeout;
  - the store's connection: torch's TCPStore client bounds only the wait
    for a key, and blocks in recv through a cut; `bound_connections` gives
    its socket the same TCP_USER_TIMEOUT and a receive timeout.
A replica that lost the coordinator this way cannot tell a dead coordinator
from a cut link, so it tries again (`reconnect`): a refused connection means
nothing listens there any more (CoordinatorLost at once); no answer means a
cut, and it keeps trying for its connect timeout. When the link comes back it
says hello again; the coordinator dropped it meanwhile, so it is let in as a
joiner and healed, and it never applies a step decided without it (Note
[Committing a step] in ddp_ext/fault_tolerance/commit.py). The coordinator
never blocks on a replica: it sends without waiting and closes a connection
that cannot take a message (ddp_ext/fault_tolerance/coordinator.py).
"""

import os
import select
import socket
import struct
import threading
import time
from typing import Dict, Optional, Tuple

from ddp_ext.fault_tolerance import _wire


class CoordinatorLost(RuntimeError):
    """The coordinator's connection closed: no quorum can be had any more."""


class ReplicaDropped(RuntimeError):
    """The coordinator dropped this replica (it was silent too long)."""


def bound(sock: socket.socket, timeout_s: float, receive_s: Optional[float] = None) -> None:
    """A connection that fails when what it sent stays unacknowledged for
    `timeout_s` (and, with `receive_s`, a recv that waits longer than that).
    See Note [A silent link]."""
    if hasattr(socket, "TCP_USER_TIMEOUT"):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, max(1, int(timeout_s * 1000)))
    if receive_s is not None:
        seconds = int(receive_s)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO,
                        struct.pack("ll", seconds, int((receive_s - seconds) * 1e6)))


def bound_connections(port: int, timeout_s: float, receive_s: float) -> int:
    """`bound` for every TCP connection of this process to `port` (a torch
    TCPStore client's, whose socket Python cannot reach otherwise); returns
    how many. See Note [A silent link]."""
    count = 0
    for name in os.listdir("/proc/self/fd") if os.path.isdir("/proc/self/fd") else ():
        try:
            sock = socket.socket(fileno=int(name))
        except (OSError, ValueError):
            continue
        try:
            if sock.type == socket.SOCK_STREAM and sock.family in (socket.AF_INET, socket.AF_INET6) \
                    and sock.getpeername()[1] == port:
                bound(sock, timeout_s, receive_s)
                count += 1
        except OSError:
            pass
        finally:
            sock.detach()  # the descriptor stays its owner's
    return count


class Link:
    def __init__(self, host: str, port: int, hello: dict, heartbeat_timeout: float, connect_timeout: float = 30.0):
        self.address = f"{host}:{port}"
        self._sock = socket.create_connection((host, port), timeout=connect_timeout)
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        bound(self._sock, heartbeat_timeout)
        self._interval = max(0.005, min(0.25, heartbeat_timeout / 5))
        self._reader = _wire.LineReader()
        self._cond = threading.Condition()
        self.epochs: Dict[int, Tuple[str, ...]] = {}
        self.latest = 0
        self.history = False
        self.lost: Optional[str] = None  # why the link is gone, once it is
        self.dropped = False
        self.progress: Optional[Tuple[int, int]] = None  # (epoch, committed steps), sent with heartbeats
        self._send_lock = threading.Lock()
        _wire.send(self._sock, hello)
        self._sock.settimeout(connect_timeout)
        answer = self._read_one()
        if answer.get("type") == "refused":
            self._sock.close()
            raise ValueError(f"the coordinator refused this replica: {answer['reason']}")
        if answer.get("type") != "welcome":
            self._sock.close()
            raise RuntimeError(f"unexpected answer from the coordinator: {answer!r}")
        self._sock.settimeout(heartbeat_timeout)  # a send that cannot go out fails the link
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="ddp_ext-ft-heartbeat", daemon=True)
        self._thread.start()

    def _read_one(self) -> dict:
        while True:
            data = self._sock.recv(65536)
            if not data:
                raise CoordinatorLost(f"the coordinator at {self.address} closed the connection during hello")
            messages = self._reader.feed(data)
            if messages:
                for extra in messages[1:]:
                    self._handle(extra)
                return messages[0]

    def _handle(self, message: dict) -> None:
        with self._cond:
            if message.get("type") == "epoch":
                number = int(message["epoch"])
                self.epochs[number] = tuple(message["members"])
                self.latest = max(self.latest, number)
                self.history = self.history or bool(message.get("history"))
            elif message.get("type") == "dropped":
                self.dropped = True
                self.lost = f"the coordinator dropped this replica: {message.get('reason')}"
            self._cond.notify_all()

    def _run(self) -> None:
        next_beat = 0.0
        while not self._stop:
            now = time.monotonic()
            if now >= next_beat:
                beat = {"type": "hb"}
                progress = self.progress
                if progress is not None:
                    beat["epoch"], beat["step"] = progress
                if not self.send(beat):
                    break
                next_beat = now + self._interval
            try:
                ready, _, _ = select.select([self._sock], [], [], max(0.0, next_beat - time.monotonic()))
                if ready:
                    data = self._sock.recv(65536)
                    if not data:
                        self._fail(f"the coordinator at {self.address} closed the connection")
                        break
                    for message in self._reader.feed(data):
                        self._handle(message)
            except (OSError, ValueError) as exc:
                if not self._stop:
                    self._fail(f"the connection to the coordinator at {self.address} failed: {exc}")
                break
            except Exception as exc:  # a message this replica cannot read: say so rather than go quiet
                self._fail(f"a message from the coordinator at {self.address} could not be handled: {exc!r}")
                break

    def _fail(self, why: str) -> None:
        with self._cond:
            if self.lost is None:
                self.lost = why
            self._cond.notify_all()

    def send(self, message: dict) -> bool:
        try:
            with self._send_lock:
                _wire.send(self._sock, message)
            return True
        except OSError as exc:
            if not self._stop:
                self._fail(f"the connection to the coordinator at {self.address} failed: {exc}")
            return False

    def check(self) -> None:
        """Raises if the link is gone."""
        if self.lost is not None:
            raise (ReplicaDropped if self.dropped else CoordinatorLost)(self.lost)

    def wait(self, predicate, timeout: float) -> bool:
        """Waits until predicate() (called under the lock) or the link fails."""
        with self._cond:
            return self._cond.wait_for(lambda: predicate() or self.lost is not None, timeout)

    def members(self, epoch: int) -> Optional[Tuple[str, ...]]:
        with self._cond:
            return self.epochs.get(epoch)

    def close(self) -> None:
        self._stop = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=2.0)


def reconnect(host: str, port: int, hello: dict, heartbeat_timeout: float, patience_s: float) -> Link:
    """A new link after the last one failed, trying for `patience_s`.
    Raises CoordinatorLost when the coordinator's host refuses the connection
    (nothing listens there: it is gone) or does not answer in time (a cut
    that lasts). See Note [A silent link]."""
    deadline = time.monotonic() + patience_s
    while True:
        left = deadline - time.monotonic()
        try:
            return Link(host, port, hello, heartbeat_timeout, connect_timeout=max(0.05, min(heartbeat_timeout, left)))
        except ConnectionRefusedError as exc:
            raise CoordinatorLost(f"the coordinator at {host}:{port} refuses connections: it is gone") from exc
        except (OSError, CoordinatorLost) as exc:  # no answer (a cut), unreachable, or closed during hello
            if time.monotonic() + 0.2 >= deadline:
                raise CoordinatorLost(
                    f"the coordinator at {host}:{port} could not be reached for {patience_s:.0f} s "
                    f"(the last try: {exc})") from exc
            time.sleep(0.2)
