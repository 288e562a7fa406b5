"""The time one probe of a waiting rank takes when no proof was published:
the counter read of Note [Proven hangs] in ddp_ext/_diagnosis/hang.py, in
Python, against a TCPStore on this host (what init_process_group's env://
makes), for a world of 8.

    python tools/hang_probe_cost.py
"""

import os
import statistics
import sys
import time

import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from ddp_ext._diagnosis import HangDiagnosis, resolve_hang_settings  # noqa: E402
from ddp_ext._diagnosis.side_channel import SideChannel  # noqa: E402

CALLS = 2000


def main():
    store = dist.TCPStore("127.0.0.1", 0, 1, True)
    diagnosis = HangDiagnosis(resolve_hang_settings(None, None), SideChannel(store, 0, 8, "probe-cost"), 0, 8)
    report = dict(
        kind="waiting", rank=0, step=2, training_steps=2, phase="reducing", waiting_for="bucket", bucket=0,
        waited_s=1.0, error="", buckets_launched=1, buckets_total=1, unready=[], unready_buckets=[],
    )
    for _ in range(100):
        diagnosis(report)
    times = []
    for _ in range(CALLS):
        start = time.perf_counter()
        diagnosis(report)
        times.append(time.perf_counter() - start)
    times.sort()
    print(
        f"probe without a proof: median {statistics.median(times) * 1e6:.0f} us, "
        f"90th percentile {times[int(CALLS * 0.9)] * 1e6:.0f} us over {CALLS} calls; "
        f"reports read {diagnosis.probe_reads} times"
    )


if __name__ == "__main__":
    main()
