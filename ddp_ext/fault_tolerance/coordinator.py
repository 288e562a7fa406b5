"""The coordination service of fault-tolerant training: its own process.

    python -m ddp_ext.fault_tolerance.coordinator --port 29600 [--control-port 29601] [--min-replicas 3] [--run-id NAME]

It serves a torch TCPStore on --port (the replicas' Gloo groups meet there,
and each step's commit decision is kept there) and a control port
(--control-port, by default the next port, so both can be opened in a
firewall; the store's key `<run-id>/control_port` tells replicas which)
where every replica keeps one connection: heartbeats in, membership epochs out. See Note [Epochs and
quorums] in ddp_ext/fault_tolerance/roster.py. It prints one line
`ddp_ext coordinator ready port=P control_port=C run_id=R` once it listens,
then one line per epoch.

If the coordinator dies, the replicas' control connections close and every
replica raises CoordinatorLost at its next step boundary (or within its
heartbeat timeout while it waits on the coordinator): training stops with
the last committed step intact in memory; it never hangs. (A replica that
gets no answer at all, a cut link, keeps trying for its connect timeout:
Note [A silent link] in ddp_ext/fault_tolerance/link.py.) The coordinator
never blocks on one replica: it sends without waiting.
"""

import argparse
import datetime
import selectors
import socket
import sys
import time
from typing import Dict, Optional

import torch.distributed as dist

from ddp_ext.fault_tolerance import _wire
from ddp_ext.fault_tolerance.link import bound
from ddp_ext.fault_tolerance.roster import Roster
from ddp_ext.fault_tolerance.store_cleanup import StoreCleanup

TICK_S = 0.01  # how often silence is checked


class Coordinator:
    def __init__(self, host: str = "0.0.0.0", port: int = 29600, run_id: str = "default", min_replicas: int = 1,
                 log=print, control_port: Optional[int] = None):
        """`control_port`: None takes `port` + 1 (any free port where `port`
        is 0), 0 any free port."""
        self.roster = Roster(run_id, min_replicas)
        self.cleanup = StoreCleanup(run_id)
        self._progressed = False
        self.store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=60))
        self.port = self.store.port
        if control_port is None:
            control_port = port + 1 if port else 0
        self._listener = socket.create_server((host, control_port))
        self.control_port = self._listener.getsockname()[1]
        self.store.set(f"{run_id}/control_port", str(self.control_port))
        self.store.set("ddp_ext/coordinator_run_id", run_id)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._clients: Dict[socket.socket, dict] = {}  # socket -> {"reader", "rid"}
        self._by_id: Dict[str, socket.socket] = {}
        self._log = log

    def close(self) -> None:
        """Stops listening and closes every replica's connection (the store
        lives as long as this object)."""
        for sock in list(self._clients):
            self._selector.unregister(sock)
            sock.close()
        self._clients.clear()
        self._by_id.clear()
        self._selector.unregister(self._listener)
        self._listener.close()

    def serve_forever(self) -> None:
        self._log(f"ddp_ext coordinator ready port={self.port} control_port={self.control_port} "
                  f"run_id={self.roster.run_id}")
        while True:
            self.poll(TICK_S)

    def poll(self, timeout: float) -> None:
        for key, _ in self._selector.select(timeout):
            if key.fileobj is self._listener:
                conn, _ = self._listener.accept()
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                conn.setblocking(False)
                self._clients[conn] = {"reader": _wire.LineReader(), "rid": None}
                self._selector.register(conn, selectors.EVENT_READ)
            else:
                self._read(key.fileobj)
        now = time.monotonic()
        for rid in self.roster.stale(now):
            self._drop(rid, f"no heartbeat for more than {self.roster.peers[rid].heartbeat_timeout} s")
        epoch = self.roster.next_epoch()
        if epoch is not None:
            self._log(f"epoch {epoch.number}: {list(epoch.members)}")
            self._broadcast({"type": "epoch", "epoch": epoch.number, "members": list(epoch.members),
                             "history": self.roster.history})
        if self._progressed and self.cleanup is not None:
            self._progressed = False
            self._delete_done_keys()

    def _delete_done_keys(self) -> None:
        """Note [Deleting commit keys] in ddp_ext/fault_tolerance/store_cleanup.py."""
        epoch = self.roster.epoch
        try:
            for key in self.cleanup.due(epoch.number, epoch.members, self.roster.progress()):
                self.store.delete_key(key)
        except Exception as exc:  # housekeeping: never worth stopping the run for
            self._log(f"deleting finished steps' keys from the store failed ({exc}); keeping them from now on")
            self.cleanup = None

    def _read(self, conn: socket.socket) -> None:
        client = self._clients.get(conn)
        if client is None:
            return
        try:
            data = conn.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._close(conn)
            return
        try:
            messages = client["reader"].feed(data)
        except ValueError:
            self._close(conn)
            return
        now = time.monotonic()
        for message in messages:
            kind = message.get("type")
            rid = client["rid"]
            if kind == "hello" and rid is None:
                self._hello(conn, message, now)
            elif rid is None:
                continue
            elif kind == "hb":
                self.roster.heard(rid, now, _progress(message))
                self._progressed = self._progressed or "step" in message
            elif kind == "abort":
                self.roster.heard(rid, now)
                self.roster.aborted(int(message["epoch"]))
            elif kind == "formed":
                self.roster.formed(int(message["epoch"]))
                progress = _progress(message)
                if progress is not None and self.cleanup is not None:
                    self.cleanup.formed(*progress)
                    self.roster.heard(rid, now, progress)
                    self._progressed = True

    def _hello(self, conn, message: dict, now: float) -> None:
        reason = self.roster.hello(message, now)
        if reason is not None:
            self._log(f"refused {message.get('replica_id')!r}: {reason}")
            self._send(conn, {"type": "refused", "reason": reason})
            self._close(conn, lose=False)
            return
        rid = message["replica_id"]
        old = self._by_id.pop(rid, None)
        if old is not None and old is not conn:
            self._send(old, {"type": "dropped", "reason": "a replica with the same id said hello"})
            self._close(old, lose=False)
        self._clients[conn]["rid"] = rid
        self._by_id[rid] = conn
        try:
            bound(conn, float(message["heartbeat_timeout"]))  # the kernel gives up on a cut link too
        except OSError:
            pass
        if not self._send(conn, {"type": "welcome"}):
            return
        epoch = self.roster.epoch
        if epoch.number:
            self._send(conn, {"type": "epoch", "epoch": epoch.number, "members": list(epoch.members),
                              "history": self.roster.history})

    def _drop(self, rid: str, reason: str) -> None:
        self._log(f"dropping {rid!r}: {reason}")
        conn = self._by_id.get(rid)
        if conn is not None:
            self._send(conn, {"type": "dropped", "reason": reason})
            self._close(conn)
        else:
            self.roster.lost(rid)

    def _close(self, conn: socket.socket, lose: bool = True) -> None:
        client = self._clients.pop(conn, None)
        try:
            self._selector.unregister(conn)
        except (KeyError, ValueError):
            pass
        conn.close()
        if client is not None and client["rid"] is not None:
            if self._by_id.get(client["rid"]) is conn:
                del self._by_id[client["rid"]]
                if lose:
                    self.roster.lost(client["rid"])

    def _send(self, conn: socket.socket, message: dict) -> bool:
        """Sends without waiting: the coordinator never blocks on one replica
        (Note [A silent link] in ddp_ext/fault_tolerance/link.py). A
        connection that cannot take a small message at once is not being
        read (cut off, or its process stopped with its buffer full) or is
        broken: it is closed, and its replica leaves (it says hello again
        when it can). False then."""
        data = _wire.encode(message)
        try:
            sent = conn.send(data)
            why = None if sent == len(data) else "its send buffer is full"
        except (BlockingIOError, InterruptedError):
            why = "its send buffer is full"
        except OSError as exc:
            why = str(exc)
        if why is None:
            return True
        client = self._clients.get(conn)
        if client is not None:
            self._log(f"closing the connection of {client['rid']!r}: a message could not be sent ({why})")
            self._close(conn)
        return False

    def _broadcast(self, message: dict) -> None:
        for rid, conn in list(self._by_id.items()):
            self._send(conn, message)


def _progress(message: dict):
    """(epoch, committed steps) from a replica's message, or None."""
    if "step" not in message:
        return None
    return int(message["epoch"]), int(message["step"])


def main(argv: Optional[list] = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m ddp_ext.fault_tolerance.coordinator",
        description="Membership, heartbeats and per-step quorums for ddp_ext.fault_tolerance.Replica.")
    parser.add_argument("--host", default="0.0.0.0", help="address to listen on (default: all)")
    parser.add_argument("--port", type=int, default=29600, help="TCPStore port (0: any free port)")
    parser.add_argument("--control-port", type=int, default=None,
                        help="port of the replicas' control connections (default: --port + 1; 0: any free port)")
    parser.add_argument("--run-id", default="default", help="name of the run; replicas must name the same")
    parser.add_argument("--min-replicas", type=int, default=1, help="replicas to wait for before the first step")
    args = parser.parse_args(argv)
    coordinator = Coordinator(args.host, args.port, args.run_id, args.min_replicas,
                              log=lambda line: print(line, flush=True), control_port=args.control_port)
    try:
        coordinator.serve_forever()
    except KeyboardInterrupt:
        sys.exit(0)


if __name__ == "__main__":
    main()
