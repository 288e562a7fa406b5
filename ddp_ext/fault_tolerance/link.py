"""The replica's end of the control connection: a thread that sends
heartbeats and keeps the latest epoch the coordinator announced."""

import select
import socket
import threading
import time
from typing import Dict, Optional, Tuple

from ddp_ext.fault_tolerance import _wire


class CoordinatorLost(RuntimeError):
    """The coordinator's connection closed: no quorum can be had any more."""


class ReplicaDropped(RuntimeError):
    """The coordinator dropped this replica (it was silent too long)."""


class Link:
    def __init__(self, host: str, port: int, hello: dict, heartbeat_timeout: float, connect_timeout: float = 30.0):
        self.address = f"{host}:{port}"
        self._sock = socket.create_connection((host, port), timeout=connect_timeout)
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._interval = max(0.005, min(0.25, heartbeat_timeout / 5))
        self._reader = _wire.LineReader()
        self._cond = threading.Condition()
        self.epochs: Dict[int, Tuple[str, ...]] = {}
        self.latest = 0
        self.history = False
        self.lost: Optional[str] = None  # why the link is gone, once it is
        self.dropped = False
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
        self._sock.settimeout(None)
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
                if not self.send({"type": "hb"}):
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
