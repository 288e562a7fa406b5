#include "recording_backend.h"

#include <ATen/core/jit_type.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <utility>

namespace ddp_ext_tests {

namespace {

using Options = std::map<std::string, std::vector<int64_t>>;

std::vector<at::Tensor> flatten(const std::vector<std::vector<at::Tensor>>& lists) {
  std::vector<at::Tensor> flat;
  for (const auto& list : lists) {
    flat.insert(flat.end(), list.begin(), list.end());
  }
  return flat;
}

int64_t reduce_op_code(const c10d::ReduceOp& op) {
  return static_cast<int64_t>(op.op_);
}

Options with_timeout(std::chrono::milliseconds timeout, Options options = {}) {
  options["timeout_ms"] = {timeout.count()};
  return options;
}

} // namespace

RecordingBackend::RecordingBackend(
    int rank,
    int size,
    RecordingBackendOptions options)
    : c10d::Backend(rank, size), options_(options) {}

std::vector<RecordedCall> RecordingBackend::calls() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return calls_;
}

void RecordingBackend::clear_calls() {
  std::lock_guard<std::mutex> lock(mutex_);
  calls_.clear();
}

std::size_t RecordingBackend::complete_pending() {
  std::vector<Pending> pending;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    pending.swap(pending_);
  }
  // Outside the lock: completing a future runs its callbacks inline.
  for (auto& p : pending) {
    p.future->markCompleted(c10::IValue(p.outputs));
  }
  return pending.size();
}

const std::string RecordingBackend::getBackendName() const {
  return "recording";
}

void RecordingBackend::setTimeout(std::chrono::milliseconds timeout) {
  record({"setTimeout", {}, with_timeout(timeout)}, {});
}

void RecordingBackend::shutdown() {
  record({"shutdown", {}, {}}, {});
}

void RecordingBackend::abort() {
  record({"abort", {}, {}}, {});
}

c10::intrusive_ptr<c10d::Work> RecordingBackend::record(
    RecordedCall call,
    std::vector<at::Tensor> outputs) {
  auto future = c10::make_intrusive<c10::ivalue::Future>(
      c10::ListType::create(c10::TensorType::get()));
  bool complete_now = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    calls_.push_back(std::move(call));
    if (options_.complete_immediately) {
      complete_now = true;
    } else {
      pending_.push_back(Pending{future, outputs});
    }
  }
  if (complete_now) {
    future->markCompleted(c10::IValue(outputs));
  }
  return c10d::Work::create_from_future(future);
}

c10::intrusive_ptr<c10d::Work> RecordingBackend::broadcast(
    std::vector<at::Tensor>& tensors,
    const c10d::BroadcastOptions& opts) {
  return record(
      {"broadcast",
       {tensors},
       with_timeout(
           opts.timeout,
           {{"root_rank", {opts.rootRank}},
            {"root_tensor", {opts.rootTensor}}})},
      tensors);
}

c10::intrusive_ptr<c10d::Work> RecordingBackend::allreduce(
    std::vector<at::Tensor>& tensors,
    const c10d::AllreduceOptions& opts) {
  return record(
      {"allreduce",
       {tensors},
       with_timeout(opts.timeout, {{"reduce_op", {reduce_op_code(opts.reduceOp)}}})},
      tensors);
}

c10::intrusive_ptr<c10d::Work> RecordingBackend::allreduce_sparse(
    std::vector<at::Tensor>& tensors,
    const c10d::AllreduceOptions& opts) {
  return record(
      {"allreduce_sparse",
       {tensors},
       with_timeout(opts.timeout, {{"reduce_op", {reduce_op_code(opts.reduceOp)}}})},
      tensors);
}

c10::intrusive_ptr<c10d::Work> RecordingBackend::allreduce_coalesced(
    std::vector<at::Tensor>& tensors,
    const c10d::AllreduceCoalescedOptions& opts) {
  return record(
      {"allreduce_coalesced",
       {tensors},
       with_timeout(opts.timeout, {{"reduce_op", {reduce_op_code(opts.reduceOp)}}})},
      tensors);
}

c10::intrusive_ptr<c10d::Work> RecordingBackend::reduce(
    std::vector<at::Tensor>& tensors,
    const c10d::ReduceOptions& opts) {
  return record(
      {"reduce",
       {tensors},
       with_timeout(
           opts.timeout,
           {{"reduce_op", {reduce_op_code(opts.reduceOp)}},
            {"root_rank", {opts.rootRank}},
            {"root_tensor", {opts.rootTensor}}})},
      tensors);
}

c10::intrusive_ptr<c10d::Work> RecordingBackend::allgather(
    std::vector<std::vector<at::Tensor>>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  return record(
      {"allgather", {flatten(outputs), inputs}, with_timeout(opts.timeout)},
      flatten(outputs));
}

c10::intrusive_ptr<c10d::Work> RecordingBackend::_allgather_base(
    at::Tensor& output,
    at::Tensor& input,
    const c10d::AllgatherOptions& opts) {
  return record(
      {"_allgather_base", {{output}, {input}}, with_timeout(opts.timeout)},
      {output});
}

c10::intrusive_ptr<c10d::Work> RecordingBackend::allgather_coalesced(
    std::vector<std::vector<at::Tensor>>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  return record(
      {"allgather_coalesced",
       {flatten(outputs), inputs},
       with_timeout(opts.timeout)},
      flatten(outputs));
}

c10::intrusive_ptr<c10d::Work> RecordingBackend::allgather_into_tensor_coalesced(
    std::vector<at::Tensor>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  return record(
      {"allgather_into_tensor_coalesced",
       {outputs, inputs},
       with_timeout(opts.timeout)},
      outputs);
}

c10::intrusive_ptr<c10d::Work> RecordingBackend::gather(
    std::vector<std::vector<at::Tensor>>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::GatherOptions& opts) {
  return record(
      {"gather",
       {flatten(outputs), inputs},
       with_timeout(opts.timeout, {{"root_rank", {opts.rootRank}}})},
      flatten(outputs));
}

c10::intrusive_ptr<c10d::Work> RecordingBackend::scatter(
    std::vector<at::Tensor>& outputs,
    std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ScatterOptions& opts) {
  return record(
      {"scatter",
       {outputs, flatten(inputs)},
       with_timeout(opts.timeout, {{"root_rank", {opts.rootRank}}})},
      outputs);
}

c10::intrusive_ptr<c10d::Work> RecordingBackend::reduce_scatter(
    std::vector<at::Tensor>& outputs,
    std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  return record(
      {"reduce_scatter",
       {outputs, flatten(inputs)},
       with_timeout(opts.timeout, {{"reduce_op", {reduce_op_code(opts.reduceOp)}}})},
      outputs);
}

c10::intrusive_ptr<c10d::Work> RecordingBackend::_reduce_scatter_base(
    at::Tensor& output,
    at::Tensor& input,
    const c10d::ReduceScatterOptions& opts) {
  return record(
      {"_reduce_scatter_base",
       {{output}, {input}},
       with_timeout(opts.timeout, {{"reduce_op", {reduce_op_code(opts.reduceOp)}}})},
      {output});
}

c10::intrusive_ptr<c10d::Work> RecordingBackend::reduce_scatter_tensor_coalesced(
    std::vector<at::Tensor>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  return record(
      {"reduce_scatter_tensor_coalesced",
       {outputs, inputs},
       with_timeout(opts.timeout, {{"reduce_op", {reduce_op_code(opts.reduceOp)}}})},
      outputs);
}

c10::intrusive_ptr<c10d::Work> RecordingBackend::alltoall_base(
    at::Tensor& output,
    at::Tensor& input,
    std::vector<int64_t>& output_split_sizes,
    std::vector<int64_t>& input_split_sizes,
    const c10d::AllToAllOptions& opts) {
  return record(
      {"alltoall_base",
       {{output}, {input}},
       with_timeout(
           opts.timeout,
           {{"output_split_sizes", output_split_sizes},
            {"input_split_sizes", input_split_sizes}})},
      {output});
}

c10::intrusive_ptr<c10d::Work> RecordingBackend::alltoall(
    std::vector<at::Tensor>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::AllToAllOptions& opts) {
  return record(
      {"alltoall", {outputs, inputs}, with_timeout(opts.timeout)}, outputs);
}

c10::intrusive_ptr<c10d::Work> RecordingBackend::barrier(
    const c10d::BarrierOptions& opts) {
  return record(
      {"barrier", {}, with_timeout(opts.timeout, {{"device_ids", opts.device_ids}})},
      {});
}

c10::intrusive_ptr<c10d::Work> RecordingBackend::send(
    std::vector<at::Tensor>& tensors,
    int dst_rank,
    int tag) {
  return record(
      {"send", {tensors}, {{"dst_rank", {dst_rank}}, {"tag", {tag}}}}, tensors);
}

c10::intrusive_ptr<c10d::Work> RecordingBackend::recv(
    std::vector<at::Tensor>& tensors,
    int src_rank,
    int tag) {
  return record(
      {"recv", {tensors}, {{"src_rank", {src_rank}}, {"tag", {tag}}}}, tensors);
}

c10::intrusive_ptr<c10d::Work> RecordingBackend::recvAnysource(
    std::vector<at::Tensor>& tensors,
    int tag) {
  return record({"recvAnysource", {tensors}, {{"tag", {tag}}}}, tensors);
}

} // namespace ddp_ext_tests
