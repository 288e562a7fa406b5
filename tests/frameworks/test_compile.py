"""torch.compile with ddp_ext's DDP, against torch's DDP compiled the same way.

Both ways of compiling, torch.compile(DDP(module)) and DDP(torch.compile(module)),
with default settings, find_unused_parameters=True and static_graph=True, on 2
ranks: the same parameters after a few steps; the same number of dynamo graphs,
of graphs handed to the backend (DDPOptimizer splits each graph at the DDP
module's bucket_bytes_cap, so this counts its pieces), of graph breaks and of
recompilations; and dynamo never compiles a frame of ddp_ext's own code. See
Note [torch.compile] in ddp_ext/distributed.py.
"""

import dataclasses
import os

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import ddp_ext
from tests.support.harness import CaseTable, assert_states_close

STEPS = 5
WIDTH = 384  # 6 layers of ~0.56 MiB: several buckets of bucket_cap_mb=1
LAYERS = 6
BUCKET_CAP_MB = 1  # DDPOptimizer's first bucket is 1 MiB whatever the cap


class Tower(nn.Module):
    """A stack of linear layers; `spare` is used only when `use_spare`, and
    `graph_break` makes dynamo split the forward in two."""

    def __init__(self, use_spare: bool, graph_break: bool):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS))
        self.spare = nn.Linear(WIDTH, WIDTH)
        self.use_spare = use_spare
        self.graph_break = graph_break

    def forward(self, x):
        half = LAYERS // 2
        for layer in self.layers[:half]:
            x = torch.tanh(layer(x))
        if self.graph_break:  # outside the loops: a break in a loop skips the frame
            torch._dynamo.graph_break()
        for layer in self.layers[half:]:
            x = torch.tanh(layer(x))
        return self.spare(x) if self.use_spare else x


@dataclasses.dataclass(frozen=True)
class CompileCase:
    how: str  # "compile_ddp": torch.compile(DDP(m)); "ddp_compiled": DDP(torch.compile(m))
    mode: str  # "default", "find_unused" or "static_graph"
    graph_break: bool = False  # a graph break in the module's own forward

    @property
    def id(self) -> str:
        return f"{self.how}-{self.mode}" + ("-graph_break" if self.graph_break else "")


CASES = [CompileCase(how, mode) for how in ("compile_ddp", "ddp_compiled") for mode in ("default", "find_unused", "static_graph")]
# A module that breaks its own graph: both graphs reach DDPOptimizer, as with torch's DDP.
CASES += [CompileCase("compile_ddp", "find_unused", graph_break=True)]

DDP_KWARGS = {
    "default": {},
    "find_unused": {"find_unused_parameters": True},
    "static_graph": {"static_graph": True},
}


def _train_compiled(wrapper, c: CompileCase, rank: int):
    """Trains a Tower under `wrapper` compiled as `c` says; returns its final
    parameters and what dynamo did."""
    from torch._dynamo.backends.registry import lookup_backend
    from torch._dynamo.utils import clear_compilation_metrics, counters, get_compilation_metrics

    torch._dynamo.reset()
    counters.clear()
    clear_compilation_metrics()
    aot_eager = lookup_backend("aot_eager")
    backend_graphs = []

    def counting_backend(gm, example_inputs):
        backend_graphs.append(gm)
        return aot_eager(gm, example_inputs)

    torch.manual_seed(0)
    module = Tower(use_spare=c.mode != "find_unused", graph_break=c.graph_break)
    kwargs = dict(bucket_cap_mb=BUCKET_CAP_MB, **DDP_KWARGS[c.mode])
    if c.how == "compile_ddp":
        model = torch.compile(wrapper(module, **kwargs), backend=counting_backend)
    else:
        model = wrapper(torch.compile(module, backend=counting_backend), **kwargs)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(STEPS):
        g = torch.Generator().manual_seed(100 * step + rank)  # different data on each rank
        x, y = torch.randn(8, WIDTH, generator=g), torch.randn(8, WIDTH, generator=g)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()

    metrics = get_compilation_metrics()
    return {
        "params": {n: p.detach().clone() for n, p in module.named_parameters()},
        "graphs": counters["stats"]["unique_graphs"],
        "backend_graphs": len(backend_graphs),
        "graph_breaks": sum(counters["graph_break"].values()),
        "recompiles": [f"{m.co_name}: {m.recompile_reason}" for m in metrics if m.recompile_reason],
        "compiled_frames": [f"{m.co_filename}:{m.co_name}" for m in metrics],
    }


def _case(rank, world_size, c):
    return {
        "ext": _train_compiled(ddp_ext.DistributedDataParallel, c, rank),
        "torch": _train_compiled(TorchDDP, c, rank),
    }


TABLE = CaseTable(_case, CASES)
WORLD_SIZE = 2


@pytest.mark.parametrize("c", CASES, ids=lambda c: c.id)
def test_compiled_trains_like_torch_ddp(c):
    for rank, r in enumerate(TABLE.results(WORLD_SIZE, c)):
        assert_states_close(r["ext"]["params"], r["torch"]["params"], f"{c.id}, rank {rank}, ddp_ext vs torch DDP")


@pytest.mark.parametrize("c", CASES, ids=lambda c: c.id)
def test_ddp_optimizer_splits_like_torch_ddp(c):
    r = TABLE.results(WORLD_SIZE, c)[0]
    ext, ref = r["ext"], r["torch"]
    assert ext["graphs"] == ref["graphs"], f"{c.id}: dynamo graphs {ext['graphs']} vs torch's {ref['graphs']}"
    # More backend graphs than dynamo graphs: DDPOptimizer split them by bucket.
    assert ref["backend_graphs"] > ref["graphs"], f"{c.id}: DDPOptimizer did not split torch's graph"
    assert ext["backend_graphs"] == ref["backend_graphs"], (
        f"{c.id}: {ext['backend_graphs']} graphs reached the backend, torch's DDP {ref['backend_graphs']}"
    )


@pytest.mark.parametrize("c", CASES, ids=lambda c: c.id)
def test_no_extra_graph_breaks_or_recompiles(c):
    r = TABLE.results(WORLD_SIZE, c)[0]
    ext, ref = r["ext"], r["torch"]
    # Fewer is allowed: torch's DDP breaks at its _inside_ddp_forward, a
    # context manager dynamo may not enter; ddp_ext writes it out inside a
    # frame dynamo skips (Note [torch.compile] in ddp_ext/distributed.py).
    assert ext["graph_breaks"] <= ref["graph_breaks"], (
        f"{c.id}: {ext['graph_breaks']} graph breaks, torch's DDP {ref['graph_breaks']}"
    )
    assert ext["recompiles"] == ref["recompiles"] == [], f"{c.id}: ddp_ext {ext['recompiles']}, torch {ref['recompiles']}"
    package = os.path.dirname(ddp_ext.__file__)
    traced = [f for f in ext["compiled_frames"] if f.startswith(package)]
    assert not traced, f"{c.id}: dynamo compiled frames of ddp_ext itself: {traced}"
