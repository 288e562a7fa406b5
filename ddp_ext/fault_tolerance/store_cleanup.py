"""Which keys of the coordinator's store no replica needs any more, so a
run of millions of steps does not grow the coordinator's memory. Pure: the
coordinator feeds it what replicas report and deletes what it returns.

Note [Deleting commit keys]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
Each step writes two keys (its vote count and its decision: Note
[Committing a step] in ddp_ext/fault_tolerance/commit.py) under its epoch.
Replicas report progress as (epoch, committed steps): in "formed" when they
enter an epoch and in every heartbeat after a commit. A member reporting
(E, c) has read the decisions of every step before c. Once every member of
the current epoch E has reported progress in E, with c_low the least count:
  - the keys of steps before c_low in E are deleted: every member has read
    them, and no one else uses E's keys;
  - every older epoch is over for every member: its steps up to c_low
    (including one it aborted at c_low) are deleted, with its formation
    counter, and the epoch is forgotten.
Only a process that was dropped (stopped, cut off) can still read a deleted
key. It finds it missing and writes "abort" or votes into a fresh count,
which stays short of the old quorum's size unless every member of that old
quorum votes again: none does, since a member that voted or decided never
votes on the same (epoch, step) again. Such a process applies nothing it
would not have applied before, and it is healed when it rejoins (its epoch is
older than every current member's). What stays behind: Gloo's rendezvous keys
of each epoch (one per member, a few hundred bytes per membership change),
and, rarely, the last keys of an epoch whose members all left at once.
"""

from typing import Dict, List, Optional, Tuple

from ddp_ext.fault_tolerance.commit import commit_keys
from ddp_ext.fault_tolerance.group import arrival_key

Progress = Tuple[int, int]  # (epoch, committed steps)


class StoreCleanup:
    def __init__(self, run_id: str):
        self.run_id = run_id
        self._first: Dict[int, int] = {}  # epoch -> first step whose keys may still be there

    def formed(self, epoch: int, step: int) -> None:
        """A member entered `epoch` holding `step` committed steps."""
        self._first[epoch] = min(step, self._first.get(epoch, step))

    def due(self, epoch: int, members, progress: Dict[str, Optional[Progress]]) -> List[str]:
        """The keys to delete now, given the current epoch, its members and
        each replica's latest progress. See Note [Deleting commit keys]."""
        reports = [progress.get(m) for m in members]
        if not reports or any(r is None or r[0] != epoch for r in reports) or epoch not in self._first:
            return []
        low = min(r[1] for r in reports)
        keys: List[str] = []
        for e in sorted(self._first):
            if e > epoch:
                continue
            end = low if e == epoch else low + 1
            keys += [k for s in range(self._first[e], end) for k in commit_keys(self.run_id, e, s)]
            if e == epoch:
                self._first[e] = max(self._first[e], end)
            else:
                keys.append(arrival_key(self.run_id, e))
                del self._first[e]
        return keys
