#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "process_groups/mpi/runtime.h"

namespace ddp_ext::process_groups::mpi {

// An MPI communicator of one process group's own: collectives on different
// groups never match each other, whatever order they are issued in. Errors
// on it come back as codes (MPI_ERRORS_RETURN), never abort the job.
class Communicator {
 public:
  // A duplicate of MPI_COMM_WORLD. Every MPI process must call it.
  static std::unique_ptr<Communicator> world();
  // A communicator over `world_ranks` (ranks of MPI_COMM_WORLD; position i
  // becomes rank i). Only those processes call it; `world_ranks` must hold
  // this process's own rank. Throws naming the ranks otherwise.
  static std::unique_ptr<Communicator> of_world_ranks(
      const std::vector<int64_t>& world_ranks);

  // Frees the communicator, unless leak() was called.
  ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  MPI_Comm get() const {
    return comm_;
  }
  int rank() const {
    return rank_;
  }
  int size() const {
    return size_;
  }
  // Never free it: requests on it were abandoned after a timeout, and
  // MPI_Comm_free would wait for them.
  void leak() {
    leaked_ = true;
  }

 private:
  explicit Communicator(MPI_Comm comm);

  MPI_Comm comm_;
  int rank_ = -1;
  int size_ = -1;
  bool leaked_ = false;
};

} // namespace ddp_ext::process_groups::mpi
