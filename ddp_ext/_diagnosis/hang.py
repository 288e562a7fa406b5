"""Hang attribution's Python side: the handler the reducer calls when one of
its waits passes `hang_timeout_s`, fails, or when a backward ends with
buckets never launched (Note [Hang attribution] in reducer/stall_watch.h).

Each call publishes this rank's report through the store; a rank that
stopped also reads the others' (waiting up to a short window for them) and
returns the message to raise, or warns once and returns None to wait on.
"""

import os
import socket
import time
import warnings
from typing import Dict, Optional

from ddp_ext._diagnosis.messages import hang_message, proven
from ddp_ext._diagnosis.settings import HangSettings, resolve_hang_settings
from ddp_ext._diagnosis.side_channel import SideChannel, StoreUnreachable, store_of

MAX_NAMES = 64  # parameter names a report carries; the rest are counted
# Per process group (by name): the number the next wrapper over it proposes.
# See `store_key`.
_next_numbers: Dict[str, int] = {}


class HangDiagnosis:
    """The reducer's stall handler for one wrapper. Holds no reference to the
    wrapper or its reducer (the reducer holds this)."""

    def __init__(self, settings: HangSettings, channel: Optional[SideChannel], rank: int, world_size: int):
        self.settings = settings
        self.channel = channel
        self.rank = rank
        self.world_size = world_size
        self.warned = set()
        self.messages = []  # every message formatted, for tests and post-mortems

    def __call__(self, report: dict) -> Optional[str]:
        report = dict(report)
        unready = report["unready"]
        report["unready_count"] = len(unready)
        report["unready"], report["unready_buckets"] = unready[:MAX_NAMES], report["unready_buckets"][:MAX_NAMES]
        report.update(host=socket.gethostname(), pid=os.getpid(), time=time.time())
        store_error = self._publish(report)
        if report["kind"] in ("unfinished", "resolved"):
            return None
        window = self.settings.failed_window_s if report["kind"] == "failed" else self.settings.window_s
        reports: Dict[int, Optional[dict]] = {r: None for r in range(self.world_size) if r != self.rank}
        if store_error is None:
            try:
                reports.update(self.channel.gather(lambda other: self._relevant(report, other), window))
            except StoreUnreachable as e:
                store_error = str(e)
        alive = {r: self.channel.alive(r) for r, rep in reports.items() if rep is None} if store_error is None else {}
        message = hang_message(report, reports, self.settings.timeout_s, window, alive)
        if store_error is not None:
            message += (
                f"\nThe other ranks' reports could not be read: the store is unreachable ({store_error}); the rank "
                "that hosts it (rank 0 with the env:// or tcp:// init methods) may have died."
            )
        self.messages.append(message)
        mode = self.settings.on_hang
        if report["kind"] == "failed" or mode == "raise" or (mode == "auto" and proven(report, reports)):
            # This rank leaves the reducer's collectives: the others should know.
            self._publish(dict(report, kind="raised", was=report["kind"]))
            return message
        incident = (report["step"], report["waiting_for"], report["bucket"])
        if incident not in self.warned:
            self.warned.add(incident)
            try:
                warnings.warn(message + "\nStill waiting (on_hang=" + repr(mode) + ").", RuntimeWarning, stacklevel=1)
            except Warning as error:  # a filter made warnings errors: raise it, as on_hang="raise" does
                self._publish(dict(report, kind="raised", was=report["kind"]))
                return str(error)
        return None

    def _publish(self, report: dict) -> Optional[str]:
        if self.channel is None:
            return "no store: the process group was not made by torch.distributed"
        try:
            self.channel.publish(report)
        except StoreUnreachable as e:
            return str(e)
        return None

    @staticmethod
    def _relevant(own: dict, other: dict) -> bool:
        # A report of this incident: not one resolved since, nor one of an
        # earlier step than the one before this rank's.
        return other["kind"] != "resolved" and other["step"] >= own["step"] - 1


def _group_name(process_group) -> str:
    try:
        return str(process_group.group_name)
    except Exception:
        return ""


def proposed_number(process_group) -> int:
    """The number this rank would give the next wrapper over `process_group`."""
    return _next_numbers.get(_group_name(process_group), 0)


def store_key(process_group, agreed: Optional[int] = None) -> str:
    """The key under which a wrapper over `process_group` meets its peers in
    the store (its hang reports, the 8-bit exchange's companion group).

    Numbers are counted per group, so a wrapper that some ranks build over
    another group (an evaluation model on rank 0) shifts nothing here; and
    `agreed` is the largest of every rank's `proposed_number`, which the
    construction's model check gathers in the allgather it runs anyway, so a
    wrapper built on some ranks only over this group (without init_sync)
    shifts nothing either: from then on every rank counts on from there.
    Without `agreed` (init_sync=False, a new process group, an unpickled
    copy), this rank's own count."""
    name = _group_name(process_group)
    number = agreed if agreed is not None else _next_numbers.get(name, 0)
    _next_numbers[name] = max(_next_numbers.get(name, 0), number + 1)
    return f"{name}/{number}"


def attach(ddp, hang_timeout_s: Optional[float] = None, on_hang: Optional[str] = None, settings=None,
           key: Optional[str] = None):
    """Gives `ddp.reducer` a HangDiagnosis (or none, when off or alone);
    returns it. `key`: the wrapper's `store_key`, agreed at construction;
    None takes a new one (after the process group changed)."""
    settings = settings if settings is not None else resolve_hang_settings(hang_timeout_s, on_hang)
    reducer, group = ddp.reducer, ddp.process_group
    ddp._store_key = key if key is not None else store_key(group)
    if reducer is None:
        return None
    # On CUDA, waits only order streams (NCCL's host-side wait with a timeout
    # has other effects): hang attribution covers CPU modules only.
    if not settings.on or group.size() == 1 or getattr(ddp, "device_type", "cpu") != "cpu":
        reducer._set_stall_handler(0, None)
        return None
    store = store_of(group)
    channel = None
    if store is not None:
        channel = SideChannel(
            store, group.rank(), group.size(), f"ddp_ext/diagnosis/{ddp._store_key}"
        )
        channel.introduce()
    diagnosis = HangDiagnosis(settings, channel, group.rank(), group.size())
    reducer._set_stall_handler(max(1, round(settings.timeout_s * 1000)), diagnosis)
    return diagnosis
