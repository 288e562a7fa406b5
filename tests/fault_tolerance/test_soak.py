"""2,000 iterations on 2 ranks: ddp_ext's memory stays flat.

Each rank trains the fault experiment's MLP (4 layers, one bucket each, see
benchmarks/workloads/soak.py) and samples its resident set size (RSS) and the
number of gc-tracked Python objects every 20 iterations. Over the second
half (the first warms up allocator and caches) the least-squares slope must
stay below:

- RSS_SLOPE_BOUND: 256 KiB per 100 iterations, about 2.6 KB per iteration.
  Measured here, ddp_ext and torch's DDP alike: about 5 KiB per 100
  iterations, with swings of about 50 KiB between samples, so 50 times
  below the bound. A leaked bucket (16,640 bytes: a Linear(64, 64)'s weight
  and bias) per iteration measures about 2,000 KiB per 100 iterations, 8
  times the bound; a leak of 2.6 KB per iteration reaches it.
- OBJECT_SLOPE_BOUND: 10 objects per 100 iterations. Measured: below 0.5;
  one leaked Python object per iteration gives 100.

test_slope_check_sees_a_leak is the positive control: the same loop leaking
one bucket-sized tensor per iteration must fail both bounds.

About 15 to 50 s on a shared 2-core machine, so it stays in the default
run (deselect with -k "not soak"). pytest -s prints the figures.
"""

from benchmarks.workloads import fault_injection
from benchmarks.workloads.fault_worlds import run_world
from benchmarks.workloads.soak import SoakJob, slope_per_100, soak

ITERATIONS = 2000
KIB = 1024
RSS_SLOPE_BOUND = 256 * KIB  # bytes per 100 iterations
OBJECT_SLOPE_BOUND = 10  # gc-tracked objects per 100 iterations
BUCKET_BYTES = fault_injection.LAYER_BYTES
PG_TIMEOUT_S = 60.0
DEADLINE_S = 600.0


def _soak(job: SoakJob):
    outcomes = run_world(soak, 2, job, PG_TIMEOUT_S, DEADLINE_S)
    for o in outcomes:
        assert o.returned and o.exitcode == 0, f"rank {o.rank}: exit {o.exitcode}\n{o.error}"
    return [o.value for o in outcomes]


def _slopes(result, iterations):
    samples = result["samples"]
    return slope_per_100(samples, 1, iterations / 2), slope_per_100(samples, 2, iterations / 2)


def test_rss_stays_flat():
    results = _soak(SoakJob("ddp_ext", ITERATIONS))
    for rank, result in enumerate(results):
        rss, objects = _slopes(result, ITERATIONS)
        first, last = result["samples"][0], result["samples"][-1]
        print(f"rank {rank}: {result['seconds']:.1f} s; RSS {first[1] / 2**20:.1f} -> {last[1] / 2**20:.1f} MiB, "
              f"second half {rss / KIB:.1f} KiB/100 it; gc objects {first[2]} -> {last[2]}, {objects:.2f}/100 it")
        assert rss < RSS_SLOPE_BOUND, f"rank {rank}: RSS grows {rss / KIB:.0f} KiB per 100 iterations"
        assert objects < OBJECT_SLOPE_BOUND, f"rank {rank}: {objects:.1f} more Python objects per 100 iterations"
    assert results[0]["parameter_sum"] == results[1]["parameter_sum"], "ranks ended with different parameters"


def test_slope_check_sees_a_leak():
    iterations = 400
    results = _soak(SoakJob("ddp_ext", iterations, leak_bytes=BUCKET_BYTES))
    rss, objects = _slopes(results[0], iterations)
    print(f"leaking {BUCKET_BYTES} bytes per iteration: {rss / KIB:.0f} KiB/100 it, {objects:.1f} objects/100 it")
    assert rss > RSS_SLOPE_BOUND
    assert objects > OBJECT_SLOPE_BOUND
