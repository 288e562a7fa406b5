"""Hang attribution's Python side: the handler the reducer calls when one of
its waits passes `hang_timeout_s`, fails, or lasts another probe slice, or
when a backward ends with buckets never launched (Note [Hang attribution] in
reducer/observation/stall_watch.h).

Each call but a probe publishes this rank's report through the store; a rank
that stopped also reads the others' (waiting up to a short window for them)
and returns the message to raise, or warns once and returns None to wait on.
A probe publishes nothing: see Note [Proven hangs].
"""

import os
import socket
import time
import warnings
from typing import Dict, Optional

from ddp_ext._diagnosis.messages import hang_message, proven, step_of
from ddp_ext._diagnosis.settings import HangSettings, resolve_hang_settings
from ddp_ext._diagnosis.side_channel import SideChannel, StoreUnreachable, store_of

MAX_NAMES = 64  # parameter names a report carries; the rest are counted
# Reports that prove the waits of the other ranks endless at once; publishing
# one moves the store's proof counter. See Note [Proven hangs].
PROOF_KINDS = ("abandoned", "raised")
# A wait this long, while a rank's backward of the same step ended without
# launching every bucket, cannot be a second backward on its way.
UNFINISHED_PROOF_S = 3.0
# Per process group (by name): the number the next wrapper over it proposes.
# See `store_key`.
_next_numbers: Dict[str, int] = {}


# Note [Proven hangs]
# ~~~~~~~~~~~~~~~~~~~
# hang_timeout_s (60 s by default) is how long a rank that is merely late may
# keep the others waiting before they say so. A wait that the reports prove
# endless should not last it: a rank that abandoned buckets (its next forward
# began without them: it raised) or raised and left the collectives will
# never send what the others wait for. A rank that died closes its
# connections, so the others' waits fail at once (kFailed), and the survivors
# raise after a short window; a rank that raises then publishes "raised",
# which reaches ranks whose wait did not fail (not paired with the dead one).
#
# So each wait, short of its deadline, reports kWaiting every probe slice
# (1 s), and the probe reads one counter in the store, which publishing a
# proof (PROOF_KINDS) increments: one round trip a second, and only in waits
# longer than a slice; a wait that completes within its first slice, the
# healthy iteration, costs nothing more, and no report is written for it.
# When the counter moved, the probe reads every other rank's report once and
# raises if one of the same training step is a proof.
#
# A backward that ended with buckets unlaunched ("unfinished") is not a proof
# at once: a second backward over the same forward (two losses, reentrant
# activation checkpointing whose inner backward ended first) may still launch
# them. It moves no counter (with reentrant checkpointing it is published on
# every iteration, and the counter would add a store write to each); a probe
# reads the reports every UNFINISHED_PROOF_S of its wait instead, and an
# "unfinished" report of its step counts as proof once the wait has lasted
# that long. Its rank's next forward makes it "abandoned", a proof at once.
#
# A probe publishes nothing (a rank waiting short of its hang_timeout_s is
# silent to the others, as before), is silent when the store is unreachable
# (the report at the deadline says so), and does not run with
# on_hang="warn", which waits on whatever the reports say. Proofs count only
# for the training step of the wait, so one left in the store by an earlier
# incident that the job survived proves nothing later. A report's training
# step is the one its wait belongs to (messages.step_of): the first bucket
# rebuild's broadcast, at a forward, belongs to the step that forward begins.


# Note [Repeated reports]
# ~~~~~~~~~~~~~~~~~~~~~~~
# A wait that passed hang_timeout_s and was warned about reports again every
# further hang_timeout_s (StallWatch::slice_passed), to refresh what it
# published and, with on_hang="auto", to look for a proof. The first report
# waits up to window_s for the others' reports; a repeat reads them in one
# pass. Its wait may complete while the handler runs (the late rank arrives),
# and the handler runs on the thread that waits: a repeat that waited a
# window would keep this rank from its next collective for that long after it
# could go on, and with a short hang_timeout_s the rank that just arrived
# would wait on it there and report this rank, behind by one step, as late.
# The others had a whole hang_timeout_s to publish since the first report.


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
        self.proofs_seen = 0  # the store's proof counter at the last probe
        self.swept = None  # (incident, n): the probe read every report after n * UNFINISHED_PROOF_S
        self.probes = 0  # probes run, and how many read the reports (for tests)
        self.probe_reads = 0

    def __call__(self, report: dict) -> Optional[str]:
        report = dict(report)
        unready = report["unready"]
        report["unready_count"] = len(unready)
        report["unready"], report["unready_buckets"] = unready[:MAX_NAMES], report["unready_buckets"][:MAX_NAMES]
        report.update(host=socket.gethostname(), pid=os.getpid(), time=time.time())
        if report["kind"] == "waiting":
            return self._probe(report)
        store_error = self._publish(report)
        if report["kind"] in ("unfinished", "abandoned", "resolved"):
            return None
        incident = (report["step"], report["waiting_for"], report["bucket"])
        window = self.settings.failed_window_s if report["kind"] == "failed" else self.settings.window_s
        if incident in self.warned:
            window = 0.0  # a repeat: see Note [Repeated reports]
        reports: Dict[int, Optional[dict]] = {r: None for r in range(self.world_size) if r != self.rank}
        if store_error is None:
            try:
                reports.update(self.channel.gather(lambda other: self._relevant(report, other), window))
            except StoreUnreachable as e:
                store_error = str(e)
        alive = {r: self.channel.alive(r) for r, rep in reports.items() if rep is None} if store_error is None else {}
        # A repeat's others had the whole wait to report, not a window.
        message = hang_message(report, reports, self.settings.timeout_s, window or report["waited_s"], alive)
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
        if incident not in self.warned:
            self.warned.add(incident)
            try:
                warnings.warn(message + "\nStill waiting (on_hang=" + repr(mode) + ").", RuntimeWarning, stacklevel=1)
            except Warning as error:  # a filter made warnings errors: raise it, as on_hang="raise" does
                self._publish(dict(report, kind="raised", was=report["kind"]))
                return str(error)
        return None

    def _probe(self, own: dict) -> Optional[str]:
        """A wait lasted another slice, short of hang_timeout_s: the message
        to raise if a proof ended it, else None. See Note [Proven hangs]."""
        if self.channel is None or self.settings.on_hang == "warn":
            return None  # "warn": wait on whatever the reports say
        self.probes += 1
        incident = (own["step"], own["waiting_for"], own["bucket"])
        sweep = (incident, int(own["waited_s"] // UNFINISHED_PROOF_S))
        try:
            count = self.channel.proofs()
            if count == self.proofs_seen and (sweep[1] == 0 or sweep == self.swept):
                return None
            self.proofs_seen, self.swept = count, sweep
            self.probe_reads += 1
            found = self.channel.gather(lambda other: self._relevant(own, other), 0.0)
        except StoreUnreachable:
            return None  # the report at hang_timeout_s says so
        unfinished_proves = own["waited_s"] >= UNFINISHED_PROOF_S
        if not any(
            step_of(rep) == step_of(own)
            and (rep["kind"] in PROOF_KINDS or (rep["kind"] == "unfinished" and unfinished_proves))
            for rep in found.values()
        ):
            return None
        own = dict(own, kind="stalled")
        reports: Dict[int, Optional[dict]] = {r: None for r in range(self.world_size) if r != self.rank}
        reports.update(found)
        alive = {r: self.channel.alive(r) for r, rep in reports.items() if rep is None}
        message = hang_message(own, reports, self.settings.timeout_s, own["waited_s"], alive)
        self.messages.append(message)
        self._publish(dict(own, kind="raised", was="proven"))
        return message

    def _publish(self, report: dict) -> Optional[str]:
        if self.channel is None:
            return "no store: the process group was not made by torch.distributed"
        try:
            self.channel.publish(report, proof=report["kind"] in PROOF_KINDS)
        except StoreUnreachable as e:
            return str(e)
        return None

    @staticmethod
    def _relevant(own: dict, other: dict) -> bool:
        # A report of this incident: not one resolved since, nor one of an
        # earlier step than the one before this rank's.
        return other["kind"] != "resolved" and step_of(other) >= step_of(own) - 1


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


def attach(reducer, group, key: str, device_type: str = "cpu", hang_timeout_s: Optional[float] = None,
           on_hang: Optional[str] = None, settings=None):
    """Gives `reducer`, over `group`, a HangDiagnosis (or none, when off or
    alone); returns it. `key`: the wrapper's `store_key`, where the ranks'
    reports meet in the store."""
    settings = settings if settings is not None else resolve_hang_settings(hang_timeout_s, on_hang)
    if reducer is None:
        return None
    # On CUDA, waits only order streams (NCCL's host-side wait with a timeout
    # has other effects): hang attribution covers CPU modules only.
    if not settings.on or group.size() == 1 or device_type != "cpu":
        reducer._set_stall_handler(0, None)
        return None
    store = store_of(group)
    channel = None
    if store is not None:
        channel = SideChannel(
            store, group.rank(), group.size(), f"ddp_ext/diagnosis/{key}"
        )
        channel.introduce()
    diagnosis = HangDiagnosis(settings, channel, group.rank(), group.size())
    reducer._set_stall_handler(max(1, round(settings.timeout_s * 1000)), diagnosis)
    return diagnosis
