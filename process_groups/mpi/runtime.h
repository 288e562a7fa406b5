#pragma once

// MPI's C API only: the C++ bindings some MPIs still ship are deprecated and
// pull in headers of their own.
#define OMPI_SKIP_MPICXX 1
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>

#include <mutex>
#include <string>

namespace ddp_ext::process_groups::mpi {

// Note [MPI threads and the MPI lock]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Several threads call MPI: the thread that creates a group (communicator
// creation), and one progress thread per group (see Note [MPI progress
// thread]). They never call it at the same time: every MPI call in ddp_ext
// is made while holding mpi_lock(). MPI_THREAD_SERIALIZED is therefore
// enough, and is what ensure_initialized() asks for; it checks what MPI
// provides and refuses to go on below that, naming the fix.
//
// Progress threads hold the lock only for one short, nonblocking call at a
// time (MPI_Test, MPI_I*), never across a blocking one, so several groups'
// collectives are in flight at once, each group's thread testing its own.
//
// MPI is initialized once per process, by the first group or rendezvous that
// needs it, and finalized at interpreter exit (ddp_ext/mpi.py) unless a
// collective was abandoned after a timeout: MPI_Finalize would wait for it.
// If someone else (mpi4py, say) initialized MPI first, ddp_ext checks the
// level it got and leaves finalizing to them.

// The lock around every MPI call. See Note [MPI threads and the MPI lock].
std::mutex& mpi_lock();

// Initializes MPI (thread level MPI_THREAD_SERIALIZED) unless it already is,
// and checks the thread level. Throws if MPI provides less, or was finalized.
void ensure_initialized();

// Whether MPI_Finalize is ours to call: we initialized MPI, it is not
// finalized yet, and no collective was abandoned (see mark_abandoned).
bool should_finalize();

// Finalizes MPI if should_finalize(); otherwise does nothing.
void finalize();

// Records that a request was left pending after a timeout.
void mark_abandoned();

// MPI_COMM_WORLD's rank and size (after ensure_initialized()).
int world_rank();
int world_size();

// "MPI_THREAD_SERIALIZED", ... for a thread level.
std::string thread_level_name(int level);

// The library's own version string (MPI_Get_library_version).
std::string library_version();

// Throws with `what`, the rank, and MPI's message when rc != MPI_SUCCESS.
void check(int rc, const char* what);

} // namespace ddp_ext::process_groups::mpi
