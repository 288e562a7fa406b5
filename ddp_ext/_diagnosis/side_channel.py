"""The side channel of hang attribution: each rank's report, as JSON under a
key of its own in the store its process group was made from. It does not
depend on the collective that is stuck, and a rank that died cannot answer
through it, which is how it is told from one that is only waiting."""

import json
import os
import socket
import time
from typing import Callable, Dict, Optional

import torch.distributed as dist

POLL_S = 0.05


class StoreUnreachable(RuntimeError):
    pass


def store_of(process_group):
    """The store `process_group` was made from, or the default one; None
    without either (a process group made by hand)."""
    c10d = dist.distributed_c10d
    try:
        entry = c10d._world.pg_map.get(process_group)
        if entry is not None:
            return entry[1]
    except Exception:  # torch internals moved: fall back to the default store
        pass
    try:
        if dist.is_initialized():
            return c10d._get_default_store()
    except Exception:
        pass
    return None


class SideChannel:
    """Reports of the ranks of one wrapper, keyed by their rank in its group."""

    def __init__(self, store, rank: int, world_size: int, prefix: str):
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.prefix = prefix

    def _key(self, rank: int, kind: str = "report") -> str:
        return f"{self.prefix}/{kind}/{rank}"

    def introduce(self) -> None:
        """Publishes where this rank runs (its host and process), once: how a
        silent rank on the same host is told dead from busy."""
        try:
            self.store.set(self._key(self.rank, "process"), json.dumps([socket.gethostname(), os.getpid()]))
        except Exception:  # diagnosis is best effort: a store without room or rights
            pass

    def alive(self, rank: int) -> Optional[bool]:
        """Whether rank's process is alive: known only on this host."""
        try:
            key = self._key(rank, "process")
            if not self.store.check([key]):
                return None
            host, pid = json.loads(self.store.get(key))
        except Exception:
            return None
        if host != socket.gethostname():
            return None
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return not _zombie(pid)

    def publish(self, report: dict, proof: bool = False) -> None:
        """Writes this rank's report; `proof`: it proves the others' waits
        endless, so it also moves the counter that their waits read."""
        try:
            self.store.set(self._key(self.rank), json.dumps(report))
            if proof:
                self.store.add(self._key(0, "proofs"), 1)
        except Exception as e:  # the store's host died, or the connection broke
            raise StoreUnreachable(str(e)) from e

    def proofs(self) -> int:
        """How many proofs the ranks published so far: one round trip."""
        try:
            return int(self.store.add(self._key(0, "proofs"), 0))
        except Exception as e:
            raise StoreUnreachable(str(e)) from e

    def read(self, rank: int) -> Optional[dict]:
        key = self._key(rank)
        try:
            if not self.store.check([key]):
                return None
            return json.loads(self.store.get(key))
        except Exception as e:
            raise StoreUnreachable(str(e)) from e

    def gather(self, accept: Callable[[dict], bool], window_s: float) -> Dict[int, dict]:
        """Every other rank's report that `accept` takes, waiting up to
        `window_s` seconds for those not there yet (0: one pass)."""
        found: Dict[int, dict] = {}
        deadline = time.monotonic() + window_s
        while True:
            for rank in range(self.world_size):
                if rank == self.rank or rank in found:
                    continue
                report = self.read(rank)
                if report is not None and accept(report):
                    found[rank] = report
            if len(found) == self.world_size - 1 or time.monotonic() >= deadline:
                return found
            time.sleep(POLL_S)


def _zombie(pid: int) -> bool:
    """A process that ended and waits for its parent to reap it (Linux)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return False
