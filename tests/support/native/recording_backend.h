#pragma once

// A test double, compiled only by the tests (tests/support/native_extensions.py),
// never into ddp_ext._C.

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

namespace ddp_ext_tests {

// One call as a RecordingBackend saw it.
struct RecordedCall {
  // The Backend method that ran, by its c10d name ("allreduce",
  // "_allgather_base", "alltoall_base", ...).
  std::string method;
  // One list per tensor argument, in the order the method declares them;
  // nested lists (allgather's outputs) are flattened in order.
  std::vector<std::vector<at::Tensor>> tensors;
  // The option fields the method got, by name ("root_rank", "reduce_op",
  // "timeout_ms", "output_split_sizes", ...). Scalars are one-element lists;
  // reduce_op is c10d::ReduceOp::RedOpType as an integer.
  std::map<std::string, std::vector<int64_t>> options;
};

struct RecordingBackendOptions {
  // Complete each call's Work as soon as it is recorded (true), or leave it
  // pending until complete_pending() (false), to observe wait(),
  // is_completed() and futures from the outside. Default: true.
  bool complete_immediately = true;
};

// A c10d Backend that communicates nothing and remembers every call: the
// recording fake that tests put behind RoundRobinBackend to check that each
// forwarded call reaches the matching child method with its arguments.
//
// Each call returns a Work whose future holds the call's output tensors
// (unchanged; nothing is computed), like Gloo's works do. It implements every
// collective and point-to-point method, including the ones RoundRobinBackend
// refuses, so a test can tell "refused by the composite" from "forwarded to a
// child that refused".
class RecordingBackend final : public c10d::Backend {
 public:
  RecordingBackend(
      int rank,
      int size,
      RecordingBackendOptions options = RecordingBackendOptions());

  // Every call so far, oldest first.
  std::vector<RecordedCall> calls() const;
  void clear_calls();
  // Completes every pending Work, oldest first, and returns how many.
  std::size_t complete_pending();

  const std::string getBackendName() const override;
  // Recorded as calls too ("setTimeout" with timeout_ms, "shutdown",
  // "abort"), so tests can see what a composite passes on.
  void setTimeout(std::chrono::milliseconds timeout) override;
  void shutdown() override;
  void abort() override;

  c10::intrusive_ptr<c10d::Work> broadcast(
      std::vector<at::Tensor>& tensors,
      const c10d::BroadcastOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce(
      std::vector<at::Tensor>& tensors,
      const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce_sparse(
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
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(
      std::vector<std::vector<at::Tensor>>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(
      std::vector<at::Tensor>& outputs,
      std::vector<at::Tensor>& inputs,
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
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(
      std::vector<at::Tensor>& outputs,
      std::vector<at::Tensor>& inputs,
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
  struct Pending {
    c10::intrusive_ptr<c10::ivalue::Future> future;
    std::vector<at::Tensor> outputs;
  };

  // Stores `call` and returns a Work whose future will hold `outputs`.
  c10::intrusive_ptr<c10d::Work> record(
      RecordedCall call,
      std::vector<at::Tensor> outputs);

  const RecordingBackendOptions options_;
  mutable std::mutex mutex_;
  std::vector<RecordedCall> calls_;
  std::vector<Pending> pending_;
};

} // namespace ddp_ext_tests
