"""The MPI backend: torch.distributed over MPI for torch builds without it
(pip's wheels), for jobs launched by mpirun or srun.

    # mpirun -np 4 python train.py
    import torch.distributed as dist
    import ddp_ext

    dist.init_process_group("ddp_ext_mpi", init_method="mpi://")

Importing ddp_ext registers the backend name "ddp_ext_mpi" and the rendezvous
"mpi://" with torch.distributed. Neither loads MPI: the native module
(ddp_ext._mpi, or its JIT build) is loaded by the first group or rendezvous
that needs it, and says how to install MPI where there is none.

- "mpi://" takes rank and world size from MPI (nothing to set); the store
  torch.distributed keeps beside the group (for Gloo subgroups, say) is a
  TCPStore on rank 0, whose address ranks learn over MPI: rank 0's host name
  and a free port, or MASTER_ADDR and MASTER_PORT where set.
- "env://" (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) works too, when the
  job was launched by mpirun or srun and RANK is the MPI rank.
- Subgroups (dist.new_group(ranks, backend="ddp_ext_mpi")) get communicators
  of their own over those ranks. torch's global ranks must be MPI's.

See Note [MPI process group] in process_groups/mpi/backend.h.
"""

import atexit
import importlib
import os
import socket
from datetime import timedelta
from urllib.parse import parse_qs, urlparse

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

BACKEND_NAME = "ddp_ext_mpi"
RENDEZVOUS_SCHEME = "mpi"
DEVICES = ["cpu"]

_native_module = None


def native():
    """ddp_ext's MPI module, loaded (or JIT-built) on first use; MPI is
    initialized then, and finalized at interpreter exit."""
    global _native_module
    if _native_module is None:
        from ddp_ext._loader import mpi_module

        module = mpi_module()
        module.ensure_initialized()
        atexit.register(module.finalize)
        _native_module = module
    return _native_module


def _check_rank(what: str, given: int, mpi: int, hint: str) -> None:
    if given not in (-1, None) and given != mpi:
        raise ValueError(f"ddp_ext_mpi: {what} is {given}, but MPI says {mpi}. {hint}")


_SAME_RANKS = (
    "torch.distributed's ranks must be MPI's: launch with mpirun or srun, and initialize with "
    'init_method="mpi://" (or set RANK and WORLD_SIZE to the MPI rank and size).'
)


def _create_backend(options, pg_options):
    """The creator torch.distributed calls for backend "ddp_ext_mpi" (with
    ``extended_api=True``: `options` is a c10d._DistributedBackendOptions)."""
    if pg_options is not None:
        raise TypeError(f"the {BACKEND_NAME} backend takes no pg_options, got {type(pg_options).__name__}")
    module = native()
    backend_options = module.MpiBackendOptions()
    backend_options.timeout = options.timeout
    backend_options.group_name = options.group_id
    ranks = list(options.global_ranks_in_group)
    if dist.is_initialized():
        _check_rank("torch's global rank", dist.get_rank(), module.world_rank(), _SAME_RANKS)
    if not ranks:  # the default group
        _check_rank("the world size", options.group_size, module.world_size(), _SAME_RANKS)
        _check_rank("the rank", options.group_rank, module.world_rank(), _SAME_RANKS)
        return module.MpiBackend.world(backend_options)
    return module.MpiBackend.of_world_ranks(ranks, backend_options)


def _store_address(rank: int) -> str:
    """host:port rank 0 serves the store on (MASTER_ADDR and MASTER_PORT if set)."""
    host = os.environ.get("MASTER_ADDR") or socket.gethostname()
    return f"{host}:{os.environ.get('MASTER_PORT', '0')}" if rank == 0 else ""


def _mpi_rendezvous(url: str, timeout: timedelta = c10d.default_pg_timeout, **kwargs):
    """torch.distributed's rendezvous handler for "mpi://": yields (store,
    rank, world size), the rank and size MPI's."""
    module = native()
    rank, world_size = module.world_rank(), module.world_size()
    query = {k: v[0] for k, v in parse_qs(urlparse(url).query).items()}
    hint = 'With init_method="mpi://", MPI decides rank and world size: leave them out.'
    _check_rank("rank", int(query.get("rank", -1)), rank, hint)
    _check_rank("world_size", int(query.get("world_size", -1)), world_size, hint)
    store = None
    address = _store_address(rank)
    if rank == 0:
        host, port = address.rsplit(":", 1)
        store = dist.TCPStore(host, int(port), world_size, True, timeout, wait_for_workers=False)
        address = f"{host}:{store.port}"
    # Every rank waits here for rank 0's address, within the timeout.
    address = module.broadcast_from_rank0(address, timeout).decode()
    if rank != 0:
        host, port = address.rsplit(":", 1)
        store = dist.TCPStore(host, int(port), world_size, False, timeout)
    yield store, rank, world_size
    raise RuntimeError("ddp_ext_mpi: the mpi:// rendezvous cannot be restarted (MPI cannot replace ranks)")


def _register() -> None:
    """Makes "ddp_ext_mpi" a backend name and "mpi://" a rendezvous (idempotent)."""
    if BACKEND_NAME.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND_NAME, _create_backend, extended_api=True, devices=DEVICES)
    # The module, not the function torch.distributed also calls `rendezvous`.
    handlers = importlib.import_module("torch.distributed.rendezvous")._rendezvous_handlers
    if RENDEZVOUS_SCHEME not in handlers:
        dist.register_rendezvous_handler(RENDEZVOUS_SCHEME, _mpi_rendezvous)


_register()
