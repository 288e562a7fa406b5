"""Checks run on every rank under mpirun (tests/support/mpi/launch.py starts them; see
tests/process_groups/test_mpi.py): every collective of the MPI backend against Gloo's, on
the same inputs, bit for bit.

Inputs are small integers (in every dtype), so that sums and products are
exact whatever order the two backends add in: bitwise equality then tests
the data movement and the reduction, not rounding order. AVG, which Gloo
lacks, is checked against the exact sum divided by the group size.
"""

import os

import torch
import torch.distributed as dist

R = dist.ReduceOp
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.int32,
          torch.int64, torch.complex64]
REDUCE_OPS = [R.SUM, R.PRODUCT, R.MIN, R.MAX]


def inputs(rank: int, dtype: torch.dtype, n: int = 13, seed: int = 0) -> torch.Tensor:
    """Rank `rank`'s input: integers in [-2, 2] (0..3 for unsigned), the same on
    every run."""
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    low = 0 if dtype in (torch.uint8, torch.bool) else -2
    values = torch.randint(low, 3, (n,), generator=g)
    if dtype == torch.bool:
        return values > 0
    return values.to(dtype)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.is_complex():
        a, b = torch.view_as_real(a), torch.view_as_real(b)
    if a.dtype == torch.bool:
        return torch.equal(a, b)
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def _run(group, fn):
    """fn(group) -> tensors; waits on the Work it made and returns clones."""
    out = fn(group)
    return [t.clone() for t in out]


def _gloo_supports(gloo, fn) -> bool:
    try:
        _run(gloo, fn)
        return True
    except (RuntimeError, ValueError):
        return False


class Checker:
    def __init__(self, mpi, gloo, rank, size):
        self.mpi, self.gloo, self.rank, self.size = mpi, gloo, rank, size
        self.compared = 0

    def same(self, name, fn, expect=None):
        """fn over MPI equals fn over Gloo (or `expect`(outputs over Gloo))."""
        if os.environ.get("DDP_EXT_MPI_CHECK_VERBOSE"):
            print(f"rank {self.rank}: {name}", flush=True)
        ours = _run(self.mpi, fn)
        theirs = _run(self.gloo, fn) if expect is None else expect()
        assert len(ours) == len(theirs), name
        for i, (a, b) in enumerate(zip(ours, theirs)):
            assert same_bits(a, b), f"{name}: output {i} differs on rank {self.rank}:\nmpi  {a}\ngloo {b}"
        self.compared += 1


def check_collectives(mpi, gloo, rank, size) -> int:
    """Every collective over `mpi` against `gloo`; returns how many cases
    were compared."""
    c = Checker(mpi, gloo, rank, size)
    root = size - 1  # of the rooted collectives; not rank 0, where a default would hide a bug
    for dtype in DTYPES:
        x = inputs(rank, dtype)
        for op in REDUCE_OPS:
            if dtype.is_complex and op != R.SUM:
                continue  # torch.distributed allows only SUM (and AVG) on complex tensors

            def allreduce(g, op=op, x=x):
                t = x.clone()
                dist.all_reduce(t, op=op, group=g)
                return [t]

            # Gloo reduces neither float16 min/max nor some others on CPU:
            # there, the reference is the local reduction of every rank's input.
            if _gloo_supports(gloo, allreduce):
                c.same(f"all_reduce {dtype} {op}", allreduce)
            else:
                c.same(f"all_reduce {dtype} {op}", allreduce, lambda op=op, dtype=dtype: [_local_reduce(op, dtype, size)])

            def reduce(g, op=op, x=x):
                t = x.clone()
                dist.reduce(t, dst=root, op=op, group=g)
                return [t] if rank == root else []

            if _gloo_supports(gloo, reduce):
                c.same(f"reduce {dtype} {op}", reduce)

        if dtype.is_floating_point or dtype.is_complex:
            # Gloo has no AVG: against the exact sum divided here, equal up to
            # the division's last bit (ATen's C++ and Python entry points to
            # the same division round 5/3 differently in complex64).
            t = x.clone()
            dist.all_reduce(t, op=R.AVG, group=mpi)
            expected = _local_reduce(R.SUM, dtype, size).div_(size)
            torch.testing.assert_close(t, expected, rtol=2 ** -20, atol=0, msg=f"all_reduce {dtype} AVG")
            c.compared += 1

        def broadcast(g, x=x):
            t = x.clone()
            dist.broadcast(t, src=root, group=g)
            return [t]

        def all_gather(g, x=x):
            out = [torch.empty_like(x) for _ in range(size)]
            dist.all_gather(out, x, group=g)
            return out

        def all_gather_into_tensor(g, x=x):
            out = torch.empty(size * x.numel(), dtype=x.dtype)
            dist.all_gather_into_tensor(out, x, group=g)
            return [out]

        def gather(g, x=x):
            out = [torch.empty_like(x) for _ in range(size)] if rank == root else None
            dist.gather(x, out, dst=root, group=g)
            return out or []

        def scatter(g, x=x):
            out = torch.empty_like(x)
            parts = [x + i for i in range(size)] if rank == root else None
            dist.scatter(out, parts, src=root, group=g)
            return [out]

        def all_to_all_single(g, x=x):
            t = x.repeat(size)
            out = torch.empty_like(t)
            dist.all_to_all_single(out, t, group=g)
            return [out]

        def all_to_all_single_unequal(g, x=x):
            # Rank r sends i + r + 1 elements to rank i.
            send = [i + rank + 1 for i in range(size)]
            recv = [rank + i + 1 for i in range(size)]
            t = x[: 1].repeat(sum(send)) + torch.arange(sum(send)).to(x.dtype)
            out = torch.empty(sum(recv), dtype=x.dtype)
            dist.all_to_all_single(out, t, recv, send, group=g)
            return [out]

        def all_to_all(g, x=x):
            ins = [x[: i + 1].clone() for i in range(size)]
            outs = [torch.empty(rank + 1, dtype=x.dtype) for _ in range(size)]
            dist.all_to_all(outs, ins, group=g)
            return outs

        def send_recv(g, x=x):
            t = torch.empty_like(x)
            sent = dist.isend(x, dst=(rank + 1) % size, group=g)
            dist.recv(t, src=(rank - 1) % size, group=g)
            sent.wait()
            return [t]

        for fn in (broadcast, all_gather, all_gather_into_tensor, gather, scatter, all_to_all_single,
                   all_to_all_single_unequal, all_to_all, send_recv):
            if _gloo_supports(gloo, fn):
                c.same(f"{fn.__name__} {dtype}", fn)

        if dtype != torch.complex64:
            for op in (R.SUM, R.MAX):
                def reduce_scatter(g, op=op, x=x):
                    out = torch.empty_like(x)
                    dist.reduce_scatter(out, [x + i for i in range(size)], op=op, group=g)
                    return [out]

                def reduce_scatter_tensor(g, op=op, x=x):
                    out = torch.empty_like(x)
                    dist.reduce_scatter_tensor(out, x.repeat(size), op=op, group=g)
                    return [out]

                for fn in (reduce_scatter, reduce_scatter_tensor):
                    reference = None if _gloo_supports(gloo, fn) else _local_reduce_scatter(fn, op, dtype, size, rank)
                    c.same(f"{fn.__name__} {dtype} {op}", fn, None if reference is None else lambda r=reference: r)

    def coalesced(g):
        ts = [inputs(rank, torch.float32, n) for n in (3, 5, 7)]
        g.allreduce_coalesced(ts, dist.AllreduceCoalescedOptions()).wait()
        return ts

    c.same("allreduce_coalesced", coalesced)
    _check_misc(mpi, rank, size)
    return c.compared


def _local_reduce(op, dtype, size):
    """What an allreduce gives, computed from every rank's input here."""
    stack = torch.stack([inputs(r, dtype) for r in range(size)])
    wide = stack.to(torch.float32) if dtype in (torch.float16, torch.bfloat16) else stack
    if op == R.SUM:
        out = wide.sum(0, dtype=wide.dtype)
    elif op == R.PRODUCT:
        out = wide.prod(0, dtype=wide.dtype)
    elif op == R.MIN:
        out = wide.min(0).values
    else:
        out = wide.max(0).values
    return out.to(dtype)


def _local_reduce_scatter(fn, op, dtype, size, rank):
    parts = []
    for r in range(size):
        x = inputs(r, dtype)
        parts.append(x + rank if fn.__name__ == "reduce_scatter" else x)
    stack = torch.stack(parts).to(torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype)
    out = stack.sum(0, dtype=stack.dtype) if op == R.SUM else stack.max(0).values
    return [out.to(dtype)]


def _check_misc(mpi, rank, size):
    # Futures: a .then() chain, as DDP's communication hooks make.
    t = torch.full((4,), float(rank + 1))
    fut = dist.all_reduce(t, group=mpi, async_op=True).get_future().then(lambda f: f.value()[0] * 2)
    expected = torch.full((4,), float(size * (size + 1)))
    assert torch.equal(fut.wait(), expected), fut.wait()

    # recv from any source names the sender.
    if rank == 0:
        got = torch.empty(1)
        for _ in range(size - 1):
            sender = dist.recv(got, group=mpi)
            assert got.item() == sender, (got, sender)
    else:
        dist.send(torch.tensor([float(rank)]), dst=0, group=mpi)

    # Refusals: a dtype MPI cannot carry, bitwise and on floats, AVG on integers.
    for tensor, op, words in [
        (torch.zeros(2, dtype=torch.float8_e4m3fn), R.SUM, "MPI cannot carry tensors of dtype"),
        (torch.zeros(2, dtype=torch.float32), R.BAND, "bitwise operations need an integer"),
        (torch.zeros(2, dtype=torch.int32), R.AVG, "an average needs a floating-point"),
    ]:
        try:
            dist.all_reduce(tensor, op=op, group=mpi)
        except RuntimeError as e:
            assert words in str(e), str(e)
        else:
            raise AssertionError(f"all_reduce of {tensor.dtype} with {op} should have been refused")
    dist.barrier(group=mpi)
