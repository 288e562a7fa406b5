#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "process_groups/round_robin/options.h"
#include "process_groups/round_robin/selector.h"

namespace ddp_ext::process_groups {

// Note [Round-robin process group]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// One Gloo or NCCL process group may not keep every link busy, because of
// concurrency limits inside the backend (NCCL streams, Gloo threads). The
// paper (sections 3.3 and 5.4) therefore composes several groups over the
// same processes and deals collectives out to them in turn; three groups made
// BERT on 16 GPUs with NCCL 33% faster than one. RoundRobinBackend is that
// composite, as a c10d Backend that torch.distributed wraps in an ordinary
// ProcessGroup (Python side: ddp_ext/round_robin.py).
//
// 1. Construction checks that every child has the same rank and size, so that
//    child k on every rank talks to child k on every other rank.
// 2. Each collective goes to child selector_.next(): call 0 to child 0, call
//    1 to child 1, ..., call N to child 0 again. The turn is shared by all
//    kinds of collective (an allreduce then a broadcast use two children),
//    and a call the child rejects (Gloo refusing an op, say) still uses its
//    turn: every rank rejects it alike, so the ranks stay in step.
// 3. Ranks agree on the child without talking to each other, because c10d
//    already requires every rank to issue the same collectives in the same
//    order; the same sequence of calls gives the same sequence of turns.
// 4. The child's Work is returned unchanged, so wait(), is_completed(),
//    get_future() and .then() chains (DDP communication hooks) behave exactly
//    as the child's do.
// 5. Point-to-point calls (send, recv) are refused: only two ranks make them,
//    so the other ranks' turns would fall out of step. Use a child or a plain
//    group for those. Collectives this class does not override
//    (allgather_coalesced, the *_tensor_coalesced variants, allreduce_sparse)
//    are refused by c10d's Backend base class with "Backend round_robin does
//    not support <op>", before any child is involved.
// 6. barrier() is a collective like any other and goes to the next child. It
//    lines up the ranks; it does not wait for collectives still running on
//    the other children (wait on their Work for that).
// 7. setTimeout reaches every child. shutdown() and abort() reach them only
//    if the composite owns them (RoundRobinBackendOptions::owns_children).
//
// Children are ProcessGroups rather than Backends. A ProcessGroup keeps one
// backend object per backend type, so this one Backend serves every device
// the group is registered for; a child ProcessGroup then picks its own
// per-device backend (e.g. "cpu:gloo,cuda:nccl"), and any group
// torch.distributed hands out can be a child as it is. The cost is one more
// trip through the c10d op dispatcher per collective, microseconds next to
// the communication itself.
class RoundRobinBackend final : public c10d::Backend {
 public:
  using ProcessGroupPtr = c10::intrusive_ptr<c10d::ProcessGroup>;

  // The name c10d and torch.distributed know this backend by.
  static constexpr const char* kName = "round_robin";

  // `children` in the order their turns come; all must have the same rank
  // and size (that is this group's rank and size). Throws otherwise.
  explicit RoundRobinBackend(
      std::vector<ProcessGroupPtr> children,
      RoundRobinBackendOptions options = RoundRobinBackendOptions());
  ~RoundRobinBackend() override;

  const std::vector<ProcessGroupPtr>& children() const {
    return children_;
  }
  // Index of the child that gets the next collective.
  std::size_t next_child_index() const {
    return selector_.peek();
  }
  // How many calls have been handed to children, counting those a child then
  // rejected; calls this backend refuses itself (send, ...) do not count.
  std::uint64_t forwarded_calls() const {
    return selector_.taken();
  }
  const RoundRobinBackendOptions& options() const {
    return options_;
  }

  const std::string getBackendName() const override;
  c10::intrusive_ptr<c10d::Backend::Options> getBackendOptions() override;
  // Sets the timeout of every child (and the one getBackendOptions reports).
  void setTimeout(std::chrono::milliseconds timeout) override;
  // Passed on to the children only if options().owns_children; idempotent.
  void shutdown() override;
  void abort() override;

  // Collectives, each forwarded to the next child. See Note [Round-robin
  // process group].
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
  // all_gather_into_tensor.
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
  // reduce_scatter_tensor.
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(
      at::Tensor& output,
      at::Tensor& input,
      const c10d::ReduceScatterOptions& opts) override;
  // all_to_all_single.
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

  // Point-to-point: refused, see Note [Round-robin process group] step 5.
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
  // The child whose turn it is; moves the turn on.
  c10d::ProcessGroup& next_child();
  [[noreturn]] void refuse_point_to_point(const char* op) const;

  std::vector<ProcessGroupPtr> children_;
  RoundRobinBackendOptions options_;
  RoundRobinSelector selector_;
  std::atomic<bool> shut_down_{false};
};

} // namespace ddp_ext::process_groups
