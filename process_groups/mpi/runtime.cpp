#include "process_groups/mpi/runtime.h"

#include <c10/util/Exception.h>

#include <atomic>

namespace ddp_ext::process_groups::mpi {

namespace {

// Whether ddp_ext called MPI_Init_thread (and so owes MPI_Finalize).
bool initialized_here = false;
std::atomic<bool> abandoned{false};

std::string error_string(int rc) {
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  if (MPI_Error_string(rc, text, &length) != MPI_SUCCESS) {
    return "MPI error code " + std::to_string(rc);
  }
  return std::string(text, length);
}

void check_thread_level(int provided, const char* who) {
  TORCH_CHECK(
      provided >= MPI_THREAD_SERIALIZED,
      "ddp_ext_mpi: MPI (", library_version(), ") was initialized by ", who,
      " with thread level ", thread_level_name(provided),
      ", but the MPI backend calls MPI from its progress threads and needs "
      "at least MPI_THREAD_SERIALIZED. Use an MPI built with thread support "
      "(Open MPI and MPICH provide it by default)",
      (initialized_here ? "" : ", or initialize MPI with "
                               "MPI_Init_thread(MPI_THREAD_SERIALIZED or "
                               "higher), e.g. mpi4py's default"),
      ".");
}

} // namespace

std::mutex& mpi_lock() {
  static std::mutex lock;
  return lock;
}

void ensure_initialized() {
  std::lock_guard<std::mutex> guard(mpi_lock());
  int finalized = 0;
  MPI_Finalized(&finalized);
  TORCH_CHECK(
      !finalized,
      "ddp_ext_mpi: MPI has already been finalized in this process; no MPI "
      "process group can be created after that (MPI cannot be restarted).");
  int initialized = 0;
  MPI_Initialized(&initialized);
  int provided = MPI_THREAD_SINGLE;
  if (initialized) {
    MPI_Query_thread(&provided);
    check_thread_level(provided, "another library");
    return;
  }
  check(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_SERIALIZED, &provided),
        "MPI_Init_thread");
  initialized_here = true;
  // World-level errors (a bad rank in a group, say) come back as codes too.
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  check_thread_level(provided, "ddp_ext");
}

bool should_finalize() {
  std::lock_guard<std::mutex> guard(mpi_lock());
  int finalized = 0;
  MPI_Finalized(&finalized);
  return initialized_here && !finalized && !abandoned.load();
}

void finalize() {
  if (!should_finalize()) {
    return;
  }
  std::lock_guard<std::mutex> guard(mpi_lock());
  MPI_Finalize();
}

void mark_abandoned() {
  abandoned.store(true);
}

int world_rank() {
  std::lock_guard<std::mutex> guard(mpi_lock());
  int rank = -1;
  check(MPI_Comm_rank(MPI_COMM_WORLD, &rank), "MPI_Comm_rank");
  return rank;
}

int world_size() {
  std::lock_guard<std::mutex> guard(mpi_lock());
  int size = -1;
  check(MPI_Comm_size(MPI_COMM_WORLD, &size), "MPI_Comm_size");
  return size;
}

std::string thread_level_name(int level) {
  switch (level) {
    case MPI_THREAD_SINGLE:
      return "MPI_THREAD_SINGLE";
    case MPI_THREAD_FUNNELED:
      return "MPI_THREAD_FUNNELED";
    case MPI_THREAD_SERIALIZED:
      return "MPI_THREAD_SERIALIZED";
    case MPI_THREAD_MULTIPLE:
      return "MPI_THREAD_MULTIPLE";
    default:
      return "thread level " + std::to_string(level);
  }
}

std::string library_version() {
  char text[MPI_MAX_LIBRARY_VERSION_STRING];
  int length = 0;
  if (MPI_Get_library_version(text, &length) != MPI_SUCCESS) {
    return "unknown MPI";
  }
  std::string version(text, length);
  // The first line names the library and version; the rest is build detail.
  const auto end = version.find_first_of("\n,");
  return end == std::string::npos ? version : version.substr(0, end);
}

void check(int rc, const char* what) {
  if (rc == MPI_SUCCESS) {
    return;
  }
  int rank = -1;
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (initialized) {
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  }
  TORCH_CHECK(false, "ddp_ext_mpi: ", what, " failed on MPI rank ", rank, ": ",
              error_string(rc));
}

} // namespace ddp_ext::process_groups::mpi
