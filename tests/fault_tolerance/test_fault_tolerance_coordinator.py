"""The coordinator on its own: the membership decisions as a table (pure,
no processes), then the coordinator's server in this process with raw
control connections (hello, refusals, heartbeats, drops, aborts, a
connection that is not read), and the replica's end's bounds on a silent
link."""

import socket
import time

import pytest

from ddp_ext.fault_tolerance import _wire, commit, link
from ddp_ext.fault_tolerance.coordinator import Coordinator
from ddp_ext.fault_tolerance.link import CoordinatorLost
from ddp_ext.fault_tolerance.roster import Roster
from ddp_ext.fault_tolerance.store_cleanup import StoreCleanup


def hello(rid, run_id="run", fingerprint="f", timeout=1.0):
    return {"type": "hello", "run_id": run_id, "replica_id": rid, "fingerprint": fingerprint,
            "heartbeat_timeout": timeout}


def test_first_epoch_waits_for_min_replicas():
    m = Roster("run", min_replicas=2)
    assert m.hello(hello("a"), 0.0) is None
    assert m.next_epoch() is None
    assert m.hello(hello("b"), 0.0) is None
    e = m.next_epoch()
    assert (e.number, e.members) == (1, ("a", "b"))
    assert m.next_epoch() is None  # nothing changed


def test_leaving_joining_and_aborting_make_new_epochs():
    m = Roster("run")
    for rid in "abc":
        m.hello(hello(rid), 0.0)
    assert m.next_epoch().members == ("a", "b", "c")
    m.lost("a")
    assert m.next_epoch().members == ("b", "c")  # survivors keep their order
    m.hello(hello("a"), 1.0)
    assert m.next_epoch().members == ("b", "c", "a")  # joiners are appended
    m.aborted(2)  # an old epoch's abort changes nothing
    assert m.next_epoch() is None
    m.aborted(3)
    e = m.next_epoch()
    assert (e.number, e.members) == (4, ("b", "c", "a"))


@pytest.mark.parametrize("message, phrase", [
    (hello("x", run_id="other"), "serves run 'run'"),
    (hello("x", fingerprint="g"), "different model"),
    (hello("x", timeout=0), "heartbeat_timeout must be a positive"),
    (hello("x", timeout=-1.0), "heartbeat_timeout must be a positive"),
    (hello(""), "replica_id must be a non-empty string"),
])
def test_refusals_name_the_problem(message, phrase):
    m = Roster("run")
    assert m.hello(hello("a"), 0.0) is None
    m.next_epoch()
    reason = m.hello(message, 0.0)
    assert reason is not None and phrase in reason
    assert m.next_epoch() is None and m.epoch.members == ("a",)  # nothing changed for the run


def test_silence_longer_than_the_timeout_is_stale():
    m = Roster("run")
    m.hello(hello("a", timeout=1.0), 0.0)
    m.hello(hello("b", timeout=3.0), 0.0)
    m.heard("a", 0.5)
    assert m.stale(1.4) == []
    assert m.stale(1.6) == ["a"]
    assert m.stale(3.1) == ["a", "b"]


def test_min_replicas_must_be_positive():
    with pytest.raises(ValueError, match="min_replicas"):
        Roster("run", min_replicas=0)


def _steps(keys):
    """{(epoch, step)} of the commit keys among `keys` (both keys of each step present)."""
    pairs = [tuple(int(x) for x in k.split("/")[2:4]) for k in keys if "/commit/" in k]
    assert all(pairs.count(p) == 2 for p in pairs), keys
    return set(pairs)


def test_commit_keys_go_once_every_member_read_them():
    c = StoreCleanup("run")
    c.formed(1, 0)
    assert c.due(1, ("a", "m"), {"a": (1, 5), "m": None}) == []  # m has not reported
    assert _steps(c.due(1, ("a", "m"), {"a": (1, 5), "m": (1, 3)})) == {(1, 0), (1, 1), (1, 2)}
    assert c.due(1, ("a", "m"), {"a": (1, 5), "m": (1, 3)}) == []  # nothing twice
    # a committed step 5 (so m voted for it: m is at step 5 or 6, its report
    # lags); m is stopped and dropped; epoch 2, a and a newcomer n healed
    # from a, forms at step 6.
    assert c.due(1, ("a", "m"), {"a": (1, 6), "m": (1, 3)}) == []
    c.formed(2, 6)
    assert c.due(2, ("a", "n"), {"a": (2, 6), "m": (1, 3)}) == []  # n has not reported
    keys = c.due(2, ("a", "n"), {"a": (2, 6), "n": (2, 6)})
    # Epoch 1 is over: its steps 3 and 4 and its counter go; the decisions m
    # may still wait on (steps 5 and 6) stay.
    assert _steps(keys) == {(1, 3), (1, 4)} and "run/form/1/arrived" in keys and len(keys) == 5
    assert _steps(c.due(2, ("a", "n"), {"a": (2, 9), "n": (2, 8)})) == {(2, 6), (2, 7)}
    # m resumes and reports from the forgotten epoch 1: ignored.
    assert _steps(c.due(2, ("a", "n"), {"a": (2, 9), "n": (2, 9), "m": (1, 6)})) == {(2, 8)}
    assert c.due(3, ("a", "n"), {"a": (3, 9), "n": (3, 9)}) == []  # epoch 3's first step is not known yet


def test_the_server_deletes_commit_keys_all_members_read():
    coordinator = Coordinator("127.0.0.1", 0, "run", log=lambda line: None)
    a, b = Client(coordinator, hello("a")), Client(coordinator, hello("b"))
    epoch = a.epoch_with(coordinator, ["a", "b"])["epoch"]
    keys = {step: commit.commit_keys("run", epoch, step) for step in range(4)}
    for pair in keys.values():
        for key in pair:
            coordinator.store.set(key, "x")
    for client, done in ((a, 4), (b, 2)):
        _wire.send(client.sock, {"type": "formed", "epoch": epoch, "step": 0})
        _wire.send(client.sock, {"type": "hb", "epoch": epoch, "step": done})
    deadline = time.monotonic() + 5
    while coordinator.store.check(list(keys[1])) and time.monotonic() < deadline:
        coordinator.poll(0.005)
    left = [step for step, pair in keys.items() if coordinator.store.check(list(pair))]
    assert left == [2, 3]  # b has not read step 2's decision yet


class Client:
    def __init__(self, coordinator, message):
        self.sock = socket.create_connection(("127.0.0.1", coordinator.control_port))
        self.reader = _wire.LineReader()
        self.inbox = []
        _wire.send(self.sock, message)

    def receive(self, coordinator, kind, timeout=5.0):
        deadline = time.monotonic() + timeout
        self.sock.setblocking(False)
        while time.monotonic() < deadline:
            coordinator.poll(0.005)
            for i, m in enumerate(self.inbox):
                if m["type"] == kind:
                    return self.inbox.pop(i)
            try:
                data = self.sock.recv(65536)
                if not data:
                    return {"type": "closed"}
                self.inbox += self.reader.feed(data)
            except BlockingIOError:
                pass
        raise AssertionError(f"no {kind!r} message; got {self.inbox}")

    def epoch_with(self, coordinator, members):
        """Epoch announcements until one with `members` (the welcome repeats the current one)."""
        while True:
            e = self.receive(coordinator, "epoch")
            if e["members"] == members:
                return e


def test_the_server_announces_epochs_and_drops_the_silent():
    coordinator = Coordinator("127.0.0.1", 0, run_id="run", log=lambda line: None)
    assert coordinator.store.get("ddp_ext/coordinator_run_id") == b"run"
    a = Client(coordinator, hello("a", timeout=0.3))
    assert a.receive(coordinator, "welcome")
    assert a.receive(coordinator, "epoch")["members"] == ["a"]
    b = Client(coordinator, hello("b", timeout=30.0))
    assert b.receive(coordinator, "welcome")
    assert b.epoch_with(coordinator, ["a", "b"])["epoch"] == 2
    # a sends no heartbeat: dropped after 0.3 s, told why, and b hears of it.
    dropped = a.receive(coordinator, "dropped")
    assert "no heartbeat" in dropped["reason"]
    assert b.epoch_with(coordinator, ["b"])["epoch"] == 3
    # An abort in the current epoch re-forms it with the same members.
    _wire.send(b.sock, {"type": "abort", "epoch": coordinator.roster.epoch.number})
    e = b.receive(coordinator, "epoch")
    assert e["members"] == ["b"] and e["epoch"] == coordinator.roster.epoch.number
    # A refused hello is answered with the reason and closed.
    c = Client(coordinator, hello("c", run_id="elsewhere"))
    refused = c.receive(coordinator, "refused")
    assert "serves run 'run'" in refused["reason"]
    # A closed connection is a replica gone.
    b.sock.close()
    for _ in range(50):
        coordinator.poll(0.005)
    assert coordinator.roster.peers == {}


def test_a_replica_that_does_not_read_is_closed_not_waited_on():
    # The coordinator sends without blocking: a connection that cannot take
    # a message (its reader stopped, or a silent link filled the buffers) is
    # closed and its replica leaves; the others are served without a stall.
    logged = []
    coordinator = Coordinator("127.0.0.1", 0, run_id="run", log=logged.append)
    deaf = Client(coordinator, hello("deaf", timeout=60.0))
    deaf.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    other = Client(coordinator, hello("other", timeout=60.0))
    assert other.receive(coordinator, "welcome")
    conn = coordinator._by_id["deaf"]
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    started = time.monotonic()
    for _ in range(10_000):
        if "deaf" not in coordinator._by_id:
            break
        coordinator._broadcast({"type": "epoch", "epoch": 0, "members": ["x" * 1000], "history": False})
    assert time.monotonic() - started < 5.0
    assert "deaf" not in coordinator._by_id and "deaf" not in coordinator.roster.peers
    assert any("closing the connection of 'deaf'" in line for line in logged), logged
    assert other.epoch_with(coordinator, ["other"])  # a new epoch without it, announced to the rest


def test_reconnect_gives_up_at_once_when_the_coordinator_is_gone():
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    listener.close()  # nothing listens there now: connections are refused
    started = time.monotonic()
    with pytest.raises(CoordinatorLost, match="refuses connections"):
        link.reconnect("127.0.0.1", port, hello("a"), heartbeat_timeout=2.0, patience_s=30.0)
    assert time.monotonic() - started < 5.0


def test_the_store_client_connection_is_bounded():
    # torch's TCPStore client blocks in recv through a cut link; the replica
    # bounds its socket (Note [A silent link]).
    import datetime

    import torch.distributed as dist

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", server.port, is_master=False, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=10))
    client.add("k", 1)
    assert link.bound_connections(server.port, 2.0, 4.0) >= 1
    assert client.add("k", 1) == 2  # still works


def _free_port_pair() -> int:
    """A port p such that p and p + 1 are free now."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        try:
            with socket.socket() as first, socket.socket() as second:
                first.bind(("127.0.0.1", port))
                second.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue
    raise RuntimeError("no two consecutive free ports")


def test_the_control_port_is_the_next_port_unless_named():
    """Both ports are known in advance, so a firewall can open them."""
    port = _free_port_pair()
    coordinator = Coordinator("127.0.0.1", port, "run", log=lambda line: None)
    assert (coordinator.port, coordinator.control_port) == (port, port + 1)
    assert coordinator.store.get("run/control_port") == str(port + 1).encode()
    coordinator.close()
    named = _free_port_pair()
    coordinator = Coordinator("127.0.0.1", 0, "run", log=lambda line: None, control_port=named)
    assert coordinator.control_port == named
    coordinator.close()
