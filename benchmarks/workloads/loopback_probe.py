"""The loopback's bandwidth for one bulk transfer, measured over the
transport a fault-tolerant heal uses: a Gloo process group of two processes
on this host, rank 0 sending one uint8 tensor of the heal's size to rank 1
point to point (the heal's send/recv), rank 1 answering with one byte.

    python -m benchmarks.workloads.loopback_probe --port P --rank R --bytes N --repeats K

(started twice by measure(), which hosts the store). Rank 0 prints one JSON
line: the seconds of each transfer (from the send to the answer's arrival)."""

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time

WARMUP = 1


def _probe(port: int, rank: int, nbytes: int, repeats: int) -> None:
    import torch
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=120))
    group = dist.ProcessGroupGloo(dist.PrefixStore("probe/", store), rank, 2, datetime.timedelta(seconds=120))
    payload = torch.zeros(nbytes, dtype=torch.uint8)
    answer = torch.zeros(1, dtype=torch.uint8)
    seconds = []
    for i in range(WARMUP + repeats):
        if rank == 0:
            started = time.perf_counter()
            group.send([payload], 1, 0).wait()
            group.recv([answer], 1, 1).wait()
            if i >= WARMUP:
                seconds.append(time.perf_counter() - started)
        else:
            group.recv([payload], 0, 0).wait()
            group.send([answer], 0, 1).wait()
    if rank == 0:
        print(json.dumps({"seconds": seconds}), flush=True)


def measure(nbytes: int, repeats: int = 5) -> dict:
    """Bytes per second of `nbytes` sent once over Gloo on loopback: the
    median over `repeats` transfers (after one unmeasured)."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=120))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, "-m", "benchmarks.workloads.loopback_probe", "--port",
                               str(store.port), "--rank", str(rank), "--bytes", str(nbytes), "--repeats",
                               str(repeats)], stdout=subprocess.PIPE, text=True, env=env) for rank in (0, 1)]
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    if any(p.returncode != 0 for p in procs):
        raise RuntimeError(f"loopback probe failed: exit codes {[p.returncode for p in procs]}")
    seconds = json.loads(outputs[0].strip().splitlines()[-1])["seconds"]
    median = statistics.median(seconds)
    return {"bytes": nbytes, "seconds": seconds, "median_s": median, "bytes_per_s": nbytes / median}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--bytes", type=int, required=True)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    _probe(args.port, args.rank, args.bytes, args.repeats)


if __name__ == "__main__":
    main()
