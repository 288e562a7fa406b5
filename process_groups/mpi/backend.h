#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "process_groups/mpi/communicator.h"
#include "process_groups/mpi/progress.h"

namespace ddp_ext::process_groups::mpi {

struct MpiBackendOptions {
  // How long a collective may take once issued before it fails, unless its
  // own options set one (torch.distributed passes init_process_group's
  // `timeout`). Default 30 min, torch's default for CPU groups.
  std::chrono::milliseconds timeout = std::chrono::minutes(30);
  // Names the group in error messages (torch.distributed's group name).
  std::string group_name = "default_pg";
};

// Note [MPI process group]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// torch's pip wheels have no MPI backend; MpiBackend is one, built against
// the MPI found at build time, for processes launched by mpirun or srun.
//
// 1. Ranks and size are MPI's. A group gets its own communicator (see
//    Communicator): a duplicate of MPI_COMM_WORLD for the default group,
//    MPI_Comm_create_group over torch's global ranks for a subgroup, so
//    torch's global ranks must be MPI_COMM_WORLD's (the "mpi://"
//    rendezvous makes them so; ddp_ext/mpi.py).
// 2. Each collective checks its tensors on the caller's thread, then is
//    issued as a nonblocking MPI call by the group's progress thread and
//    returns at once. See Note [MPI progress thread].
// 3. Tensors: CPU, contiguous, one per call (as Gloo), of a dtype MPI can
//    carry. See Note [MPI dtypes]. Lists of tensors (allgather's outputs,
//    scatter's inputs, alltoall's) pass through one flat staging buffer.
// 4. A timeout breaks the group for good (MPI cannot cancel a collective);
//    its communicator is then never freed.
class MpiBackend final : public c10d::Backend {
 public:
  static constexpr const char* kName = "ddp_ext_mpi";

  // Takes `communicator` over; this group's rank and size are its.
  MpiBackend(std::unique_ptr<Communicator> communicator,
             MpiBackendOptions options = MpiBackendOptions());
  // Waits for collectives in flight (each within its timeout).
  ~MpiBackend() override;

  const std::string getBackendName() const override;
  c10::intrusive_ptr<c10d::Backend::Options> getBackendOptions() override;
  void setTimeout(std::chrono::milliseconds timeout) override;
  // Waits for the collectives in flight, then frees the communicator; later
  // calls fail. Idempotent.
  void shutdown() override;
  // Whether a collective timed out (see step 4).
  bool broken() const;
  const MpiBackendOptions& options() const {
    return options_;
  }

  c10::intrusive_ptr<c10d::Work> broadcast(
      std::vector<at::Tensor>& tensors,
      const c10d::BroadcastOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce(
      std::vector<at::Tensor>& tensors,
      const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(
      std::vector<at::Tensor>& tensors,
      const c10d::AllreduceCoalescedOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce(
      std::vector<at::Tensor>& tensors,
      const c10d::ReduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather(
      std::vector<std::vector<at::Tensor>>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(
      at::Tensor& output,
      at::Tensor& input,
      const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> gather(
      std::vector<std::vector<at::Tensor>>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::GatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> scatter(
      std::vector<at::Tensor>& outputs,
      std::vector<std::vector<at::Tensor>>& inputs,
      const c10d::ScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(
      std::vector<at::Tensor>& outputs,
      std::vector<std::vector<at::Tensor>>& inputs,
      const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(
      at::Tensor& output,
      at::Tensor& input,
      const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall_base(
      at::Tensor& output,
      at::Tensor& input,
      std::vector<int64_t>& output_split_sizes,
      std::vector<int64_t>& input_split_sizes,
      const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall(
      std::vector<at::Tensor>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> barrier(
      const c10d::BarrierOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> send(
      std::vector<at::Tensor>& tensors,
      int dst_rank,
      int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(
      std::vector<at::Tensor>& tensors,
      int src_rank,
      int tag) override;
  c10::intrusive_ptr<c10d::Work> recvAnysource(
      std::vector<at::Tensor>& tensors,
      int tag) override;

 private:
  // Queues a collective on the progress thread and returns its Work.
  c10::intrusive_ptr<c10d::Work> launch(
      c10d::OpType type,
      const char* name,
      std::chrono::milliseconds timeout,
      std::vector<at::Tensor> outputs,
      std::function<std::vector<MPI_Request>()> start,
      std::function<void()> finish = nullptr);
  // A reduction, as allreduce, reduce and the reduce-scatters make it. See
  // Note [MPI dtypes] for the reduction dtype.
  struct Reduction {
    c10d::OpType type;
    const char* name;
    std::chrono::milliseconds timeout;
    c10d::ReduceOp op;
    // The dtype of the tensors reduced.
    at::ScalarType dtype;
    // Run on the progress thread: the tensor this rank contributes.
    std::function<at::Tensor()> input;
    // Where the result goes; undefined where this rank receives nothing.
    at::Tensor output;
    // Whether MPI reduces in the input's buffer (MPI_IN_PLACE).
    bool in_place;
    // Issues the MPI call on (send, receive, type, op, request).
    std::function<int(const void*, void*, MPI_Datatype, MPI_Op, MPI_Request*)>
        start;
    // Run after the result is in `output` (may be empty).
    std::function<void()> after;
  };
  c10::intrusive_ptr<c10d::Work> launch_reduction(Reduction call);
  std::chrono::milliseconds timeout_or_default(
      std::chrono::milliseconds timeout) const;
  MpiProgress& progress();
  // The communicator; throws once the group was shut down.
  MPI_Comm comm() const;

  std::unique_ptr<Communicator> communicator_;
  MpiBackendOptions options_;
  mutable std::mutex mutex_; // guards progress_, communicator_ (shutdown)
  std::unique_ptr<MpiProgress> progress_;
};

} // namespace ddp_ext::process_groups::mpi
