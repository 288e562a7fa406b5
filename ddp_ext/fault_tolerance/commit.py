"""Whether a step commits: one decision per (epoch, step), kept in the
coordinator's store.

Note [Committing a step]
~~~~~~~~~~~~~~~~~~~~~~~~
A Gloo allreduce that returns on one rank does not mean it returned on every
rank: a peer can die, hang or lose a link after this rank got its sum, and
then the peers that did not get it must not apply the step while this one
does, or the replicas diverge. So no rank applies its optimizer step until
the step's decision is known, and the decision is made once, atomically, in
the coordinator's store:

  1. A member that finished its forward and backward (every bucket reduced,
     the averaged gradients in .grad) votes: it adds 1 to the step's vote
     count. The member whose vote makes the count equal to the quorum's size
     writes "commit <E>" with compare_set (which sets a key only if it is
     still unset), where E is the newest epoch it has heard of.
  2. A member whose step failed (a collective raised: a peer died, the group
     timed out; or its own step raised) writes "abort" with compare_set, and
     does not vote.
  3. A member waiting for the decision that sees the coordinator announce an
     epoch without one of the quorum's members (it died or was dropped for
     silence) looks at the count once more: all votes in means "commit",
     anything less means "abort"; either goes through compare_set.

compare_set makes the first writer win and every later writer read that
first value, so every member reads the same decision; a member applies the
step if and only if the decision is "commit". "commit" is written only when
every member of the quorum voted, that is, every member finished the
reduction and holds the same averaged gradients (a Gloo allreduce gives every
rank the same bits), so no rank ever applies a partially reduced update, and
a step either moves every surviving member or none. A member that dies after
voting does not hold the others back: they commit without it and drop it at
the next boundary. A member that was stopped (SIGSTOP) and resumes reads the
decision that was made without it (it never waits for a vote the others
already gave up on; the decisions of its epoch's last steps are kept for
it), and the coordinator has dropped it, so it rejoins and is healed instead
of training on. E names the quorum of the next step, so every
member changes its group at the same step boundary (Note [Epochs and
quorums] in ddp_ext/fault_tolerance/roster.py). The store is the single
point of decision: if the coordinator dies, no decision can be made, and the
members stop (CoordinatorLost) instead of guessing. The coordinator deletes
the keys no member will read again (Note [Deleting commit keys] in
ddp_ext/fault_tolerance/store_cleanup.py).
"""

import dataclasses
import time

from ddp_ext.fault_tolerance.link import CoordinatorLost, Link

_POLL_FIRST_S = 0.0002
_POLL_MAX_S = 0.01


@dataclasses.dataclass(frozen=True)
class Decision:
    committed: bool
    next_epoch: int  # the epoch of the next step (commit), or the one that failed (abort)


def _parse(value, epoch: int) -> Decision:
    text = value.decode() if isinstance(value, bytes) else str(value)
    if text.startswith("commit "):
        return Decision(True, int(text.split()[1]))
    return Decision(False, epoch)


def _store_call(link: Link, call, *args):
    try:
        return call(*args)
    except Exception as exc:  # the store lives in the coordinator's process
        link.check()
        raise CoordinatorLost(f"the coordinator's store stopped answering: {exc}") from exc


def commit_keys(run_id: str, epoch: int, step: int):
    """The vote count's and the decision's keys of one step."""
    prefix = f"{run_id}/commit/{epoch}/{step}"
    return f"{prefix}/votes", f"{prefix}/decision"


def decide(store, link: Link, run_id: str, epoch: int, step: int, members: tuple, voted: bool) -> Decision:
    """Votes (or vetoes, if not `voted`) step `step` of `epoch` and returns
    the decision every member of `members` reads. See Note [Committing a step]."""
    votes_key, decision_key = commit_keys(run_id, epoch, step)
    size = len(members)
    if not voted:
        return _parse(_store_call(link, store.compare_set, decision_key, "", "abort"), epoch)
    if _store_call(link, store.add, votes_key, 1) == size:
        return _parse(_store_call(link, store.compare_set, decision_key, "", f"commit {link.latest}"), epoch)
    pause = _POLL_FIRST_S
    while True:
        if _store_call(link, store.check, [decision_key]):
            return _parse(_store_call(link, store.get, decision_key), epoch)
        link.check()
        announced = link.members(link.latest) or members
        if any(m not in announced for m in members):
            # See step 3 of the Note.
            if _store_call(link, store.add, votes_key, 0) == size:
                value = _store_call(link, store.compare_set, decision_key, "", f"commit {link.latest}")
            else:
                value = _store_call(link, store.compare_set, decision_key, "", "abort")
            return _parse(value, epoch)
        time.sleep(pause)
        pause = min(pause * 2, _POLL_MAX_S)
