"""Every rank's communication timeline in one trace, the ranks one above the
other (docs/TIMELINE.md):

    python -m ddp_ext.timeline_merge traces/    # writes traces/timeline-all.json

Each rank's clock is its host's CLOCK_MONOTONIC, which hosts do not share, so
the ranks are aligned on the end of their first step check: an allreduce
ends on every rank at nearly the same moment (within one message's latency),
whatever each rank's clock says. A rank whose gradients became ready late
(a straggler) then shows its `gradient ready` instants to the right of the
others'.
"""

import glob
import json
import os
import re
import sys
from typing import Dict, List, Optional

MERGED_NAME = "timeline-all.json"
_RANK_FILE = re.compile(r"timeline-rank(\d+)\.json$")


def _first_step_check_end(trace: dict) -> Optional[float]:
    ends = [e["ts"] + e["dur"] for e in trace["traceEvents"] if e.get("ph") == "X" and e.get("name") == "step check"]
    return min(ends) if ends else None


def merge_timelines(directory: str, out: Optional[str] = None) -> str:
    """Writes the traces `timeline-rank{r}.json` of `directory` as one trace
    (default `directory/timeline-all.json`) and returns its path."""
    ranked = sorted((int(m.group(1)), p) for p in glob.glob(os.path.join(directory, "timeline-rank*.json"))
                    if (m := _RANK_FILE.search(p)))
    if not ranked:
        raise FileNotFoundError(f"no timeline-rank*.json in {directory!r}: record a timeline first")
    traces: List[dict] = []
    for _, path in ranked:
        with open(path) as f:
            traces.append(json.load(f))
    anchors = [_first_step_check_end(t) for t in traces]
    aligned = all(a is not None for a in anchors)
    shifts: Dict[int, float] = {}
    events = []
    for (rank, _), trace, anchor in zip(ranked, traces, anchors):
        shift = anchors[0] - anchor if aligned else 0.0
        shifts[rank] = shift
        for event in trace["traceEvents"]:
            events.append(event if event.get("ph") == "M" else dict(event, ts=event["ts"] + shift))
    merged = {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "ranks": [rank for rank, _ in ranked],
            "aligned_on": "the end of each rank's first step check" if aligned
            else "nothing: a trace holds no step check, so each rank keeps its own clock",
            "shift_us": {str(rank): shift for rank, shift in shifts.items()},
        },
    }
    out = out or os.path.join(directory, MERGED_NAME)
    partial = out + ".partial"
    with open(partial, "w") as f:
        json.dump(merged, f)
    os.replace(partial, out)
    return out


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m ddp_ext.timeline_merge DIRECTORY")
    print(merge_timelines(sys.argv[1]))
