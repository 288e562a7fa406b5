"""The coordinator's decisions, pure: who is connected, who is a member of
the current epoch, and when a new epoch starts. No sockets, no clock of its
own (times are passed in), so it is table-tested without processes.

Note [Epochs and quorums]
~~~~~~~~~~~~~~~~~~~~~~~~~
An epoch is a numbered membership: the ordered list of replica ids that
train together over one Gloo process group (rank = position in the list).
The coordinator starts a new epoch when
  1. a member's control connection closes (the process died: the kernel
     closes its sockets) or stays silent longer than that replica's
     heartbeat timeout (hung, stopped, or cut off): it leaves;
  2. a replica says hello and is accepted: it joins (joiners are appended, so
     the survivors keep their relative order and the lowest survivor stays
     rank 0);
  3. a member reports that a step or a group formation in the current epoch
     failed (a cut link, a collective that timed out, an error in the
     training step): the same members, over a new group.
Before the first epoch it waits for `min_replicas` replicas. Each step's
quorum is the epoch named by the previous step's commit decision (Note
[Committing a step] in ddp_ext/fault_tolerance/commit.py), so every member
switches epoch at the same step boundary.
"""

import dataclasses
from typing import Dict, List, Optional, Tuple


@dataclasses.dataclass
class Peer:
    replica_id: str
    heartbeat_timeout: float  # seconds of silence after which it is dropped
    last_heard: float  # the coordinator's clock, seconds
    progress: Optional[Tuple[int, int]] = None  # its last reported (epoch, committed steps)


@dataclasses.dataclass(frozen=True)
class Epoch:
    number: int
    members: tuple


class Roster:
    """The coordinator's book of peers and epochs (see the Note above)."""

    def __init__(self, run_id: str, min_replicas: int = 1):
        if min_replicas < 1:
            raise ValueError(f"min_replicas must be at least 1, got {min_replicas}")
        self.run_id = run_id
        self.min_replicas = min_replicas
        self.fingerprint: Optional[str] = None  # the run's model, from its first replica
        self.peers: Dict[str, Peer] = {}  # connected and accepted, in arrival order
        self.epoch = Epoch(0, ())  # epoch 0: none yet
        self.history = False  # some epoch formed: fresh replicas must heal
        self._dirty = False

    def hello(self, message: dict, now: float) -> Optional[str]:
        """A replica says hello; returns why it is refused, or None."""
        rid = message.get("replica_id")
        if message.get("run_id") != self.run_id:
            return (
                f"this coordinator serves run {self.run_id!r}, and replica {rid!r} asked for run "
                f"{message.get('run_id')!r}: point the replica at its own run's coordinator"
            )
        if not isinstance(rid, str) or not rid:
            return f"replica_id must be a non-empty string, got {rid!r}"
        timeout = message.get("heartbeat_timeout")
        if not isinstance(timeout, (int, float)) or timeout <= 0:
            return f"heartbeat_timeout must be a positive number of seconds, got {timeout!r}"
        fingerprint = message.get("fingerprint")
        if self.fingerprint is not None and fingerprint != self.fingerprint:
            return (
                f"replica {rid!r} holds a different model or optimizer than the run's (its "
                f"fingerprint {fingerprint} is not the run's {self.fingerprint}: parameter or "
                f"buffer names, shapes or dtypes, or the optimizer's class differ); it was not "
                f"let in and the run goes on without it"
            )
        self.fingerprint = fingerprint
        self.peers.pop(rid, None)  # a restarted replica under the same id replaces the old one
        self.peers[rid] = Peer(rid, float(timeout), now)
        self._dirty = True
        return None

    def heard(self, rid: str, now: float, progress: Optional[Tuple[int, int]] = None) -> None:
        peer = self.peers.get(rid)
        if peer is not None:
            peer.last_heard = now
            if progress is not None:
                peer.progress = progress

    def progress(self) -> Dict[str, Optional[Tuple[int, int]]]:
        """Each connected replica's last reported (epoch, committed steps)."""
        return {rid: peer.progress for rid, peer in self.peers.items()}

    def lost(self, rid: str) -> None:
        """Its connection closed (or the coordinator dropped it)."""
        if self.peers.pop(rid, None) is not None:
            self._dirty = True

    def stale(self, now: float) -> List[str]:
        """Replicas silent for longer than their heartbeat timeout."""
        return [p.replica_id for p in self.peers.values() if now - p.last_heard > p.heartbeat_timeout]

    def aborted(self, epoch: int) -> None:
        """A member could not finish a step or a formation in `epoch`."""
        if epoch == self.epoch.number:
            self._dirty = True

    def formed(self, epoch: int) -> None:
        self.history = True

    def next_epoch(self) -> Optional[Epoch]:
        """The epoch to announce after the events so far, or None."""
        if not self._dirty:
            return None
        if self.epoch.number == 0 and len(self.peers) < self.min_replicas:
            return None
        self._dirty = False
        survivors = [m for m in self.epoch.members if m in self.peers]
        joiners = [rid for rid in self.peers if rid not in survivors]
        members = tuple(survivors + joiners)
        if not members:
            return None
        self.epoch = Epoch(self.epoch.number + 1, members)
        return self.epoch
