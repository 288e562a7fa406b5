"""Which keys of the coordinator's store no replica needs any more, so a
run of millions of steps does not grow the coordinator's memory. Pure: the
coordinator feeds it what replicas report and deletes what it returns.

Note [Deleting commit keys]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
Each step writes two keys (its vote count and its decision: Note
[Committing a step] in ddp_ext/fault_tolerance/commit.py) under its epoch.
Replicas report progress as (epoch, committed steps): in "formed" when they
enter an epoch, and in every heartbeat after that. A member reporting (E, c)
has read the decisions of every step of E before c.
  - The current epoch E: once every member has reported progress in E, with
    c_low the least count, the keys of E's steps before c_low are deleted:
    every member has read them, and no one else uses E's keys.
  - An older epoch e, once every member of E reported progress in E: its
    members either are in E (past all of e) or were dropped. A dropped
    member may still be waiting on the decision of e's last committed step
    (it voted, then was stopped) or of the step after it, and if every
    newer holder of the state dies it becomes the heal source, so those
    decisions must stay. A step commits only with every member's vote, so
    the members of an epoch are never more than one step apart: with t the
    highest count any replica reported in e (reports lag; the true one is
    no lower), every member of e stopped at step t - 1 or later. So e's
    steps before t - 1 go, with its formation counter, and e is forgotten;
    its steps from t - 1 on stay (at most two, or more when the last
    reports lagged or were replaced before the coordinator read them).
    tests/fault_tolerance/test_fault_tolerance_training.py runs that case: a member stopped
    between its vote and the decision, resumed once the other died.
So no replica reads a deleted key. Were one to, it would find the key
missing and write "abort" or vote into a fresh count, which stays short of
the old quorum's size (a member that voted or decided never votes on the same
(epoch, step) again): it would apply nothing, and be healed when it rejoins.
What stays behind per membership change: Gloo's rendezvous keys (one per
member), each epoch's last steps as above, the counters of epochs announced
but never formed, and all of an epoch's keys if every "formed" of it was lost.
"""

from typing import Dict, List, Optional, Tuple

from ddp_ext.fault_tolerance.commit import commit_keys
from ddp_ext.fault_tolerance.group import arrival_key

Progress = Tuple[int, int]  # (epoch, committed steps)


class StoreCleanup:
    def __init__(self, run_id: str):
        self.run_id = run_id
        self._first: Dict[int, int] = {}  # epoch -> first step whose keys may still be there
        self._top: Dict[int, int] = {}  # epoch -> highest count reported in it

    def formed(self, epoch: int, step: int) -> None:
        """A member entered `epoch` holding `step` committed steps."""
        self._first[epoch] = min(step, self._first.get(epoch, step))
        self._top[epoch] = max(step, self._top.get(epoch, step))

    def due(self, epoch: int, members, progress: Dict[str, Optional[Progress]]) -> List[str]:
        """The keys to delete now, given the current epoch, its members and
        each connected replica's latest progress. See Note [Deleting commit
        keys]."""
        for report in progress.values():
            if report is not None and report[0] in self._top:
                self._top[report[0]] = max(self._top[report[0]], report[1])
        reports = [progress.get(m) for m in members]
        if not reports or any(r is None or r[0] != epoch for r in reports) or epoch not in self._first:
            return []
        low = min(r[1] for r in reports)
        keys: List[str] = []
        for e in sorted(self._first):
            if e > epoch:
                continue
            end = low if e == epoch else self._top[e] - 1
            keys += [k for s in range(self._first[e], end) for k in commit_keys(self.run_id, e, s)]
            if e == epoch:
                self._first[e] = max(self._first[e], end)
            else:
                keys.append(arrival_key(self.run_id, e))
                del self._first[e], self._top[e]
        return keys
