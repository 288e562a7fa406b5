#include "process_groups/mpi/communicator.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <sstream>

namespace ddp_ext::process_groups::mpi {

namespace {

// MPI_Comm_create_group's tag: group creations are issued one after the
// other by the same thread, so one tag serves them all.
constexpr int kCreateGroupTag = 0x6464;

std::string list(const std::vector<int64_t>& ranks) {
  std::ostringstream out;
  out << "[";
  for (std::size_t i = 0; i < ranks.size(); ++i) {
    out << (i ? ", " : "") << ranks[i];
  }
  out << "]";
  return out.str();
}

} // namespace

Communicator::Communicator(MPI_Comm comm) : comm_(comm) {
  check(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN),
        "MPI_Comm_set_errhandler");
  check(MPI_Comm_rank(comm_, &rank_), "MPI_Comm_rank");
  check(MPI_Comm_size(comm_, &size_), "MPI_Comm_size");
}

std::unique_ptr<Communicator> Communicator::world() {
  ensure_initialized();
  std::lock_guard<std::mutex> guard(mpi_lock());
  MPI_Comm comm = MPI_COMM_NULL;
  check(MPI_Comm_dup(MPI_COMM_WORLD, &comm), "MPI_Comm_dup");
  return std::unique_ptr<Communicator>(new Communicator(comm));
}

std::unique_ptr<Communicator> Communicator::of_world_ranks(
    const std::vector<int64_t>& world_ranks) {
  ensure_initialized();
  const int me = world_rank();
  const int world = world_size();
  for (const auto r : world_ranks) {
    TORCH_CHECK(
        r >= 0 && r < world, "ddp_ext_mpi: a group over global ranks ",
        list(world_ranks), " was asked for, but MPI_COMM_WORLD has ", world,
        " processes (ranks 0 to ", world - 1, "). torch.distributed's global "
        "ranks must be MPI's: launch with mpirun or srun and initialize with "
        "init_method=\"mpi://\".");
  }
  TORCH_CHECK(
      std::find(world_ranks.begin(), world_ranks.end(), me) !=
          world_ranks.end(),
      "ddp_ext_mpi: MPI rank ", me, " was asked to join a group over global "
      "ranks ", list(world_ranks), " it is not part of. torch.distributed's "
      "global ranks must be MPI's: launch with mpirun or srun and initialize "
      "with init_method=\"mpi://\".");
  std::lock_guard<std::mutex> guard(mpi_lock());
  MPI_Group world_group = MPI_GROUP_NULL;
  MPI_Group group = MPI_GROUP_NULL;
  check(MPI_Comm_group(MPI_COMM_WORLD, &world_group), "MPI_Comm_group");
  const std::vector<int> ranks(world_ranks.begin(), world_ranks.end());
  const int rc_incl = MPI_Group_incl(
      world_group, static_cast<int>(ranks.size()), ranks.data(), &group);
  MPI_Group_free(&world_group);
  check(rc_incl, "MPI_Group_incl");
  MPI_Comm comm = MPI_COMM_NULL;
  const int rc_create =
      MPI_Comm_create_group(MPI_COMM_WORLD, group, kCreateGroupTag, &comm);
  MPI_Group_free(&group);
  check(rc_create, "MPI_Comm_create_group");
  return std::unique_ptr<Communicator>(new Communicator(comm));
}

Communicator::~Communicator() {
  if (leaked_) {
    return;
  }
  std::lock_guard<std::mutex> guard(mpi_lock());
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) {
    MPI_Comm_free(&comm_);
  }
}

} // namespace ddp_ext::process_groups::mpi
