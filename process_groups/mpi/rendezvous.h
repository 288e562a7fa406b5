#pragma once

#include <chrono>
#include <string>

namespace ddp_ext::process_groups::mpi {

// `text` as MPI_COMM_WORLD's rank 0 has it, on every rank (the others' `text`
// is ignored): how the "mpi://" rendezvous hands out rank 0's store address
// (ddp_ext/mpi.py). Every MPI process must call it. Fails after `timeout`.
std::string broadcast_from_rank0(const std::string& text,
                                 std::chrono::milliseconds timeout);

} // namespace ddp_ext::process_groups::mpi
