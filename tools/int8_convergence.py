"""Convergence of 8 bits at 4 ranks (docs/COMPRESSION.md): ddp_ext at float32 against the
adaptive hook compressing always (8 bits by reduce-scatter from 4 ranks), on the digits task of
`python -m benchmarks compression` (narrow ResNet-50, small preset, 8 epochs), one run per seed.

    PYTHONPATH=. python tools/int8_convergence.py [seeds, comma-separated; default 0,1,2]

Prints rank 0's test accuracy per variant and seed, and the formats the hook used.
"""
import json, sys, time
from benchmarks.harness.launcher import launch
from benchmarks.workloads.compression_convergence import train_and_test
from benchmarks.workloads.compression_variants import HookSettings, OURS, ADAPTIVE_ALWAYS

SEEDS = [int(s) for s in sys.argv[1].split(",")] if len(sys.argv) > 1 else [0, 1, 2]

def fn(rank, world_size, job):
    out = {}
    for v in (OURS, ADAPTIVE_ALWAYS):
        out[v] = [train_and_test(rank, world_size, v, "small", s, HookSettings(), False) for s in SEEDS]
    return out

if __name__ == "__main__":
    t = time.time()
    res = launch(fn, 4, None, 1, 3600)
    r0 = res[0]
    summary = {v: [{"seed": s, "acc": run["test_accuracy"], "loss": run["test_loss"], "iters": run["iterations"],
                    "formats": sorted({f for d in run.get("decisions", []) for f in d["formats"]})}
                   for s, run in zip(SEEDS, r0[v])] for v in r0}
    summary["seconds"] = time.time() - t
    print(json.dumps(summary, indent=1))
