#pragma once

#include <c10/util/intrusive_ptr.h>

#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "process_groups/mpi/runtime.h"
#include "process_groups/mpi/work.h"

namespace ddp_ext::process_groups::mpi {

// One operation for the progress thread: a nonblocking MPI call, and what to
// do once it has completed.
struct MpiOp {
  // The Work the caller holds; completed by the progress thread.
  c10::intrusive_ptr<MpiWork> work;
  // The collective's name, for errors ("allreduce").
  const char* name = "";
  // How long the call may take once issued before it fails.
  std::chrono::milliseconds timeout{0};
  // Issues the nonblocking call(s) and returns their requests. Runs on the
  // progress thread, holding the MPI lock; may allocate staging buffers.
  std::function<std::vector<MPI_Request>()> start;
  // Runs once every request has completed, without the MPI lock: copies
  // staging buffers into the outputs, divides for AVG. May be empty.
  std::function<void()> finish;
};

// Note [MPI progress thread]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~
// Each MPI process group owns one MpiProgress: a thread that makes all of
// the group's MPI calls, so that a collective never blocks its caller.
//
// 1. A collective validates its arguments on the caller's thread (errors are
//    raised there, at once), then enqueues an MpiOp and returns its Work.
// 2. The thread takes ops in FIFO order and issues each one's nonblocking
//    call (MPI_Iallreduce, MPI_Ibcast, MPI_Isend, ...) as soon as it is
//    queued. Every rank therefore starts the group's collectives in the
//    order its caller made them, which is the order MPI requires; several
//    may be in flight at once (DDP's buckets overlap), on this group as on
//    different groups (a round-robin group over MPI children).
// 3. It tests the in-flight requests (MPI_Testall) under the MPI lock (see
//    Note [MPI threads and the MPI lock]). Between tests that found nothing
//    new it backs off: it yields for the first ~100 us, then sleeps a
//    growing fraction of the time waited, at most 500 us, so an idle wait
//    costs little CPU while a fast collective is noticed quickly.
// 4. A completed op runs its finish step and completes its Work and Future;
//    `.then()` callbacks therefore run on this thread. A callback that waits
//    on another collective of the same group would wait for itself.
// 5. Timeouts: an op not complete `timeout` after it was issued fails with a
//    DistBackendError. MPI cannot cancel a collective, so its peers may be
//    anywhere in it and the communicator is no longer usable: the group is
//    marked broken, every op in flight or queued fails with the same
//    message, and later calls fail at once. The abandoned requests keep
//    their buffers alive until the process exits, and MPI is not finalized
//    (MPI_Finalize would wait for them).
class MpiProgress {
 public:
  // `description` names the group in errors ("rank 0 of 2 in group 'x'").
  explicit MpiProgress(std::string description);
  // Waits for the ops in flight or queued (each within its timeout), then
  // stops the thread.
  ~MpiProgress();

  MpiProgress(const MpiProgress&) = delete;
  MpiProgress& operator=(const MpiProgress&) = delete;

  // Queues `op`; its Work fails at once if the group is broken.
  void enqueue(MpiOp op);

  // Whether an op timed out (the communicator must not be used again).
  bool broken() const;

 private:
  struct InFlight {
    MpiOp op;
    std::vector<MPI_Request> requests;
    std::chrono::steady_clock::time_point deadline;
  };

  void run();
  // Issues `op`; completes its Work with the error if that fails.
  void start(MpiOp op);
  // Tests every op in flight; returns how many completed.
  std::size_t poll();
  // Fails ops past their deadline, and then every other op. See step 5.
  void expire(std::chrono::steady_clock::time_point now);
  void fail(MpiOp& op, std::exception_ptr error);

  const std::string description_;
  mutable std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<MpiOp> queue_; // guarded by mutex_
  bool stopping_ = false; // guarded by mutex_
  std::exception_ptr broken_; // guarded by mutex_; the first timeout
  // Only the progress thread touches these.
  std::vector<InFlight> in_flight_;
  std::vector<InFlight> abandoned_;
  std::thread thread_;
};

} // namespace ddp_ext::process_groups::mpi
