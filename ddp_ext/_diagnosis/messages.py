"""The messages of hang attribution: one per rank that stopped, naming the
lagging or dead ranks, the training step and the parameters, from every
rank's report (ddp_ext/_diagnosis/hang.py gathers them)."""

from typing import Dict, List, Optional

TORCH_PHRASE = "Expected to have finished reduction in the prior iteration before starting a new one"
NAMED = 8  # parameters named per rank; the rest are counted
# A backward that ended without launching every bucket: "unfinished" at its
# end, "abandoned" once that rank's next forward began (and raised).
UNFINISHED = ("unfinished", "abandoned")


def ranks_text(ranks: List[int]) -> str:
    ranks = sorted(ranks)
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    shown = ", ".join(str(r) for r in ranks[:NAMED])
    more = f" and {len(ranks) - NAMED} more" if len(ranks) > NAMED else ""
    return f"ranks {shown}{more}"


def names_text(names: List[str], total: Optional[int] = None) -> str:
    total = len(names) if total is None else total
    shown = ", ".join(names[:NAMED])
    return shown + (f" and {total - min(total, NAMED)} more" if total > NAMED else "")


def waiting_text(report: dict) -> str:
    what = report.get("waiting_for", "")
    if what == "bucket":
        return f"the allreduce of bucket {report['bucket']}"
    if what == "reduce-scatter":
        return f"the reduce-scatter of bucket {report['bucket']} (overlap_optimizer(..., shard=True))"
    if what == "step check":
        return "the step check (the backward's first collective)"
    if what == "usage":
        return "the allreduce of the used-parameter bitmap"
    if what == "layout broadcast":
        return "the broadcast of the agreed bucket order (a bucket rebuild)"
    if what == "first layout broadcast":
        return "the broadcast of rank 0's gradient order (the first bucket rebuild)"
    return "a collective"


def _at_forward(report: dict) -> bool:
    # The first bucket rebuild happens at the forward after the first
    # backward; every other wait at the end of a backward.
    return report.get("waiting_for") == "first layout broadcast"


def step_of(report: dict) -> int:
    """The training step a report is about: a report counts finished
    backwards, so a wait in a forward belongs to the next step."""
    return report["step"] + 1 if _at_forward(report) else report["step"]


def place_text(report: dict) -> str:
    """Where in its iteration the rank waits."""
    part = "the forward" if _at_forward(report) else "the end of the backward"
    return f"{part} of training step {step_of(report)}"


def _buckets(report: dict) -> str:
    return f"{report['buckets_launched']} of {report['buckets_total']} buckets launched"


def report_line(rank: int, report: Optional[dict], window_s: float, alive: Optional[bool] = None) -> str:
    if report is None:
        state = {True: " (its process is alive)", False: " (its process is gone)", None: ""}[alive]
        return f"rank {rank}: reported nothing within {window_s:.1f} s{state}"
    kind, step = report["kind"], step_of(report)
    if kind == "stalled":
        return (
            f"rank {rank}: waiting {report['waited_s']:.1f} s for {waiting_text(report)} at "
            f"{place_text(report)}" + ("" if _at_forward(report) else f" ({_buckets(report)})")
        )
    if kind == "failed":
        return f"rank {rank}: its wait for {waiting_text(report)} in training step {step} failed: {report['error']}"
    if kind == "raised":
        why = {"failed": "failed", "proven": "was proven endless by the others' reports"}.get(
            report.get("was"), "passed hang_timeout_s"
        )
        return (
            f"rank {rank}: raised an error after its wait for {waiting_text(report)} in training step {step} "
            f"{why}, and left the collectives"
        )
    if kind in UNFINISHED:
        buckets = sorted(set(report["unready_buckets"]))
        return (
            f"rank {rank}: its backward of training step {step} ended with no gradient for "
            f"{names_text(report['unready'], report.get('unready_count'))}, so it never launched "
            f"bucket{'s' if len(buckets) > 1 else ''} {', '.join(map(str, buckets))} ({_buckets(report)})"
            + (", and it raised at its next forward" if kind == "abandoned" else "")
        )
    return f"rank {rank}: {kind} in training step {step}"


def hang_message(
    own: dict,
    reports: Dict[int, Optional[dict]],
    timeout_s: float,
    window_s: float,
    alive: Optional[Dict[int, Optional[bool]]] = None,
) -> str:
    """The message for rank own['rank'], which stopped (kind "stalled") or
    whose wait failed ("failed"); `reports`: every other rank's, None where
    it reported nothing; `alive`: for those, whether their process is alive
    (None: unknown, on another host)."""
    alive = alive or {}
    rank, step = own["rank"], step_of(own)
    everyone = dict(reports)
    everyone[rank] = own
    unfinished = [r for r, rep in everyone.items() if rep is not None and rep["kind"] in UNFINISHED]
    silent = [r for r, rep in everyone.items() if rep is None]
    gone = [r for r in silent if alive.get(r) is False]
    unknown = [r for r in silent if alive.get(r) is None]
    waiting = [r for r, rep in everyone.items() if rep is not None and rep["kind"] in ("stalled", "failed")]
    left = [r for r, rep in reports.items() if rep is not None and rep["kind"] == "raised"]
    # Still reporting a wait of the step before: it has not reached this one.
    behind = [r for r, rep in reports.items() if rep is not None and rep["kind"] == "stalled" and step_of(rep) < step]
    failed = own["kind"] == "failed"
    where = f"{waiting_text(own)} at {place_text(own)}"
    lines = []
    # A dead process comes first: a survivor's unfinished backward may be its
    # consequence (a ring of sends to the dead rank fails mid-backward).
    if gone:
        lines.append(_death_line(own, gone, True, failed, timeout_s, window_s))
    elif unfinished:
        how = "whose wait failed" if failed else f"which waited {own['waited_s']:.1f} s"
        lines.append(
            f"DistributedDataParallel: {ranks_text(unfinished)} left parameters without a gradient in the backward "
            f"of training step {everyone[unfinished[0]]['step']}, so {ranks_text(waiting)} "
            f"{'waits' if len(waiting) == 1 else 'wait'} for collectives that have no partner there "
            f"(this is rank {rank}, {how} "
            f"for {where}; hang_timeout_s={timeout_s:g})."
        )
        for r in sorted(unfinished):
            lines.append(
                f"Parameters that got no gradient on rank {r}: "
                f"{names_text(everyone[r]['unready'], everyone[r].get('unready_count'))}."
            )
        lines.append(
            f"torch's DDP reports this only on the ranks that skipped them, at their next forward, as "
            f"\"{TORCH_PHRASE}\", while the other ranks wait until the process group's timeout. "
            "If the forward does not use the same parameters on every rank (a branch taken on some ranks only, a "
            "frozen part, an output left out of the loss), pass find_unused_parameters=True to "
            "DistributedDataParallel; otherwise make sure every parameter takes part in the loss on every rank."
        )
    elif failed and unknown:
        lines.append(_death_line(own, unknown, False, failed, timeout_s, window_s))
    elif left:
        how = "its wait failed" if failed else f"waited {own['waited_s']:.1f} s"
        lines.append(
            f"DistributedDataParallel: {ranks_text(left)} raised an error in training step "
            f"{step_of(everyone[left[0]])} and left the collectives, so rank {rank} waits for {where} without a "
            f"partner ({how}; "
            f"hang_timeout_s={timeout_s:g}). Look at the error {ranks_text(left)} raised."
        )
    elif silent:
        lines.append(
            f"DistributedDataParallel: {ranks_text(silent)} did not reach {place_text(own)}: rank {rank} has "
            f"waited {own['waited_s']:.1f} s (hang_timeout_s={timeout_s:g}) for {where}, "
            f"and {ranks_text(silent)} reported nothing through the store within {window_s:.1f} s. "
            f"{'They are' if len(silent) > 1 else 'It is'} busy outside DistributedDataParallel (data loading, "
            "evaluation, a checkpoint, another collective), much slower, or dead without closing "
            f"{'their' if len(silent) > 1 else 'its'} connections; look at {'their' if len(silent) > 1 else 'its'} "
            "stack (py-spy dump --pid <pid>)."
        )
    elif behind:
        earlier = sorted({step_of(everyone[r]) for r in behind})
        lines.append(
            f"DistributedDataParallel: {ranks_text(behind)} did not reach {place_text(own)}: rank {rank} has "
            f"waited {own['waited_s']:.1f} s (hang_timeout_s={timeout_s:g}) for {where}, and "
            f"{ranks_text(behind)} last reported a wait in training step {', '.join(map(str, earlier))}. Either "
            f"{'they are' if len(behind) > 1 else 'it is'} slow to leave that step (a loaded machine, work outside "
            f"DistributedDataParallel), or {'they' if len(behind) > 1 else 'it'} still "
            f"wait{'' if len(behind) > 1 else 's'} there for a collective that rank {rank} passed, and the ranks "
            f"ran different collectives: compare the reports below, and look at "
            f"{'their' if len(behind) > 1 else 'its'} stack (py-spy dump --pid <pid>)."
        )
    elif _same_wait(everyone.values()):
        lines.append(
            f"DistributedDataParallel: every rank is waiting for {where} (this is rank {rank}, which has waited "
            f"{own['waited_s']:.1f} s; hang_timeout_s={timeout_s:g}). The ranks are in step and wait for the same "
            "collective, so it is slow rather than mismatched: a loaded machine, a slow or congested link, or a "
            "process group that stalled. If this recurs on a healthy machine, raise hang_timeout_s."
        )
    else:
        lines.append(
            f"DistributedDataParallel: every rank reported, but their collectives do not pair up in training step "
            f"{step} (this is rank {rank}, waiting for {where}; hang_timeout_s={timeout_s:g}). A rank ran a "
            "collective the others did not: compare the reports below."
        )
    if not failed and own["waited_s"] < timeout_s:
        lines.append(
            f"The reports prove that this wait cannot end, so rank {rank} raised without waiting for "
            f"hang_timeout_s ({timeout_s:g} s), which is for ranks that are merely late."
        )
    lines.append("What each rank reported:")
    for r in sorted(everyone):
        lines.append("  " + report_line(r, everyone[r], window_s, alive.get(r)))
    return "\n".join(lines)


def _death_line(own: dict, dead: List[int], gone: bool, failed: bool, timeout_s: float, window_s: float) -> str:
    """Ranks `dead` reported nothing; `gone`: their processes are proven gone."""
    rank, step = own["rank"], step_of(own)
    where = f"{waiting_text(own)} at {place_text(own)}"
    how = "died" if gone else "died or became unreachable"
    wait = "failed" if failed else f"has lasted {own['waited_s']:.1f} s (hang_timeout_s={timeout_s:g})"
    return (
        f"DistributedDataParallel: {ranks_text(dead)} {how} during training step {step}: on rank {rank} the "
        f"wait for {where} {wait}, and {ranks_text(dead)} reported nothing through the store within "
        f"{window_s:.1f} s{' (the process is gone)' if gone else ''}. Look at "
        f"{'their' if len(dead) > 1 else 'its'} output for why (an exception, the out-of-memory killer, a lost "
        f"host); the job cannot go on without {'them' if len(dead) > 1 else 'it'}: restart it from a checkpoint."
    )


def _same_wait(reports) -> bool:
    """Every rank waits (its wait not failed) for the same collective of the same step."""
    keys = {(step_of(r), r.get("waiting_for"), r.get("bucket")) if r["kind"] == "stalled" else None for r in reports}
    return len(keys) == 1 and None not in keys


def proven(own: dict, reports: Dict[int, Optional[dict]]) -> bool:
    """Whether the reports prove the wait can never end: a rank left
    parameters without a gradient, or (the wait failed) a rank is silent."""
    if any(rep is not None and rep["kind"] in UNFINISHED + ("raised",) for rep in reports.values()):
        return True
    return own["kind"] == "failed"
