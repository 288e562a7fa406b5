#include "process_groups/round_robin/backend.h"

#include <c10/util/Exception.h>

#include <utility>

#include "process_groups/single_tensor_collectives.h"

namespace ddp_ext::process_groups {

namespace {

struct GroupShape {
  int rank;
  int size;
};

// The rank and size every child shares. Throws, naming the first child that
// disagrees, if they do not all match.
GroupShape common_shape(
    const std::vector<RoundRobinBackend::ProcessGroupPtr>& children) {
  TORCH_CHECK(
      !children.empty(),
      "round_robin: needs at least one child process group, got none. Pass "
      "num_groups >= 1 or a non-empty list of groups.");
  for (std::size_t i = 0; i < children.size(); ++i) {
    TORCH_CHECK(
        children[i], "round_robin: child process group ", i, " is None.");
  }
  const GroupShape shape{children[0]->getRank(), children[0]->getSize()};
  for (std::size_t i = 1; i < children.size(); ++i) {
    const int rank = children[i]->getRank();
    const int size = children[i]->getSize();
    TORCH_CHECK(
        rank == shape.rank && size == shape.size,
        "round_robin: child process group ", i, " has rank ", rank,
        " of size ", size, ", but child 0 has rank ", shape.rank, " of size ",
        shape.size, ". Every child must span the same processes in the same "
        "order; build them all from the same ranks.");
  }
  return shape;
}

} // namespace

RoundRobinBackend::RoundRobinBackend(
    std::vector<ProcessGroupPtr> children,
    RoundRobinBackendOptions options)
    // common_shape validates; calling it twice keeps the checks ahead of any
    // use of children[0] whatever order the arguments are evaluated in.
    : c10d::Backend(common_shape(children).rank, common_shape(children).size),
      children_(std::move(children)),
      options_(options),
      selector_(children_.size()) {
  init();
}

RoundRobinBackend::~RoundRobinBackend() = default;

const std::string RoundRobinBackend::getBackendName() const {
  return kName;
}

c10::intrusive_ptr<c10d::Backend::Options> RoundRobinBackend::
    getBackendOptions() {
  return c10::make_intrusive<c10d::Backend::Options>(kName, options_.timeout);
}

void RoundRobinBackend::setTimeout(std::chrono::milliseconds timeout) {
  for (const auto& child : children_) {
    child->setTimeout(timeout);
  }
  options_.timeout = timeout;
}

void RoundRobinBackend::shutdown() {
  if (shut_down_.exchange(true) || !options_.owns_children) {
    return;
  }
  for (const auto& child : children_) {
    child->shutdown();
  }
}

void RoundRobinBackend::abort() {
  if (shut_down_.exchange(true) || !options_.owns_children) {
    return;
  }
  for (const auto& child : children_) {
    child->abort();
  }
}

c10d::ProcessGroup& RoundRobinBackend::next_child() {
  return *children_[selector_.next()];
}

c10::intrusive_ptr<c10d::Work> RoundRobinBackend::broadcast(
    std::vector<at::Tensor>& tensors,
    const c10d::BroadcastOptions& opts) {
  return next_child().broadcast(tensors, opts);
}

c10::intrusive_ptr<c10d::Work> RoundRobinBackend::allreduce(
    std::vector<at::Tensor>& tensors,
    const c10d::AllreduceOptions& opts) {
  return next_child().allreduce(tensors, opts);
}

c10::intrusive_ptr<c10d::Work> RoundRobinBackend::allreduce_coalesced(
    std::vector<at::Tensor>& tensors,
    const c10d::AllreduceCoalescedOptions& opts) {
  return next_child().allreduce_coalesced(tensors, opts);
}

c10::intrusive_ptr<c10d::Work> RoundRobinBackend::reduce(
    std::vector<at::Tensor>& tensors,
    const c10d::ReduceOptions& opts) {
  return next_child().reduce(tensors, opts);
}

c10::intrusive_ptr<c10d::Work> RoundRobinBackend::allgather(
    std::vector<std::vector<at::Tensor>>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  return next_child().allgather(outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> RoundRobinBackend::_allgather_base(
    at::Tensor& output,
    at::Tensor& input,
    const c10d::AllgatherOptions& opts) {
  // See Note [Single-tensor collective names].
  return process_groups::all_gather_single(next_child(), output, input, opts);
}

c10::intrusive_ptr<c10d::Work> RoundRobinBackend::gather(
    std::vector<std::vector<at::Tensor>>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::GatherOptions& opts) {
  return next_child().gather(outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> RoundRobinBackend::scatter(
    std::vector<at::Tensor>& outputs,
    std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ScatterOptions& opts) {
  return next_child().scatter(outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> RoundRobinBackend::reduce_scatter(
    std::vector<at::Tensor>& outputs,
    std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  return next_child().reduce_scatter(outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> RoundRobinBackend::_reduce_scatter_base(
    at::Tensor& output,
    at::Tensor& input,
    const c10d::ReduceScatterOptions& opts) {
  // See Note [Single-tensor collective names].
  return process_groups::reduce_scatter_single(next_child(), output, input, opts);
}

c10::intrusive_ptr<c10d::Work> RoundRobinBackend::alltoall_base(
    at::Tensor& output,
    at::Tensor& input,
    std::vector<int64_t>& output_split_sizes,
    std::vector<int64_t>& input_split_sizes,
    const c10d::AllToAllOptions& opts) {
  // See Note [Single-tensor collective names].
  return process_groups::all_to_all_single(
      next_child(), output, input, output_split_sizes, input_split_sizes, opts);
}

c10::intrusive_ptr<c10d::Work> RoundRobinBackend::alltoall(
    std::vector<at::Tensor>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::AllToAllOptions& opts) {
  return next_child().alltoall(outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> RoundRobinBackend::barrier(
    const c10d::BarrierOptions& opts) {
  return next_child().barrier(opts);
}

void RoundRobinBackend::refuse_point_to_point(const char* op) const {
  TORCH_CHECK(
      false, "Backend ", kName, " does not support ", op,
      ": only the two ranks involved make point-to-point calls, so the other "
      "ranks would disagree about which child group comes next. Send over "
      "one of the child groups, or a plain group, instead.");
}

c10::intrusive_ptr<c10d::Work> RoundRobinBackend::send(
    std::vector<at::Tensor>& /*tensors*/,
    int /*dst_rank*/,
    int /*tag*/) {
  refuse_point_to_point("send");
}

c10::intrusive_ptr<c10d::Work> RoundRobinBackend::recv(
    std::vector<at::Tensor>& /*tensors*/,
    int /*src_rank*/,
    int /*tag*/) {
  refuse_point_to_point("recv");
}

c10::intrusive_ptr<c10d::Work> RoundRobinBackend::recvAnysource(
    std::vector<at::Tensor>& /*tensors*/,
    int /*tag*/) {
  refuse_point_to_point("recvAnysource");
}

} // namespace ddp_ext::process_groups
