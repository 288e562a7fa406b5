"""python -m benchmarks.optimizer_overlap [--blocks N] [--world-size N] [--layers N] [--width N]

Per-iteration time of ddp_ext with and without `overlap_optimizer` (see
docs/OPTIMIZER_OVERLAP.md), side by side: two replicas of the same model
(a stack of Linear layers, Adam with foreach=True, 4 MiB buckets) on the same
ranks over Gloo, measured in alternating blocks (Note [Interleaved
measurement] in benchmarks/harness/interleave.py). An iteration is
zero_grad, forward, backward and optimizer.step(), timed on each rank; the
slowest rank's time counts. Prints the medians, their ratio and the ratio
per block pair, and checks that both replicas end with bitwise equal
parameters (they saw the same data and steps).
"""

import argparse
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.harness.interleave import merge_ranks, run_interleaved

VARIANTS = ("plain", "overlap")


class _Quiet:
    def say(self, *_):
        pass


def _rank(rank, args, store_path, results):
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, args.world_size), rank=rank,
                            world_size=args.world_size)
    import ddp_ext

    steps, modules = {}, {}
    for name in VARIANTS:
        torch.manual_seed(0)
        module = torch.nn.Sequential(*[torch.nn.Linear(args.width, args.width) for _ in range(args.layers)])
        ddp = ddp_ext.DistributedDataParallel(module, bucket_cap_mb=args.bucket_cap_mb)
        optimizer = torch.optim.Adam(module.parameters(), lr=1e-5, foreach=True)
        if name == "overlap":
            ddp.overlap_optimizer(optimizer)
        batch = torch.randn(args.batch, args.width, generator=torch.Generator().manual_seed(rank))

        def step(ddp=ddp, optimizer=optimizer, batch=batch):
            begin = time.perf_counter()
            optimizer.zero_grad()
            ddp(batch).pow(2).mean().backward()
            optimizer.step()
            return {"total": (time.perf_counter() - begin) * 1000.0}

        steps[name], modules[name] = step, module
    blocks = run_interleaved(steps, warmup=args.warmup, blocks=args.blocks, block_iterations=args.block_iterations,
                             discard_per_block=1, progress=_Quiet(), label="optimizer_overlap")
    equal = all(torch.equal(a, b) for a, b in zip(modules["plain"].parameters(), modules["overlap"].parameters()))
    results.put((rank, blocks, equal))
    dist.destroy_process_group()


def _median(samples) -> float:
    return statistics.median(s["total"] for s in samples)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.optimizer_overlap", description=__doc__.split("\n\n")[1])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--bucket-cap-mb", type=float, default=4.0)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--blocks", type=int, default=10)
    parser.add_argument("--block-iterations", type=int, default=5)
    args = parser.parse_args()
    context = mp.get_context("spawn")
    results = context.Queue()
    store_path = tempfile.mktemp(prefix="optimizer_overlap_store_")
    ranks = [context.Process(target=_rank, args=(r, args, store_path, results)) for r in range(args.world_size)]
    for process in ranks:
        process.start()
    per_rank = {}
    for _ in ranks:
        rank, blocks, equal = results.get(timeout=1800)
        per_rank[rank] = (blocks, equal)
    for process in ranks:
        process.join()
    merged = merge_ranks([per_rank[r][0] for r in range(args.world_size)])
    medians = {name: _median([s for block in merged[name] for s in block]) for name in VARIANTS}
    per_block = [_median(o) / _median(p) for p, o in zip(merged["plain"], merged["overlap"])]
    print(f"{args.world_size} ranks over Gloo, {args.layers} x Linear({args.width}, {args.width}), Adam (foreach), "
          f"{args.bucket_cap_mb} MiB buckets, {args.blocks} blocks of {args.block_iterations} iterations per variant")
    print(f"median ms per iteration: without overlap_optimizer {medians['plain']:.1f}, "
          f"with {medians['overlap']:.1f}; ratio {medians['overlap'] / medians['plain']:.3f} "
          f"[per block pair {min(per_block):.3f}-{max(per_block):.3f}]")
    equal = all(per_rank[r][1] for r in range(args.world_size))
    print(f"parameters bitwise equal between the two replicas on every rank: {equal}")
    if not equal:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
