// The reducer's bucket transport as its hooks and Join see it (Note [Bucket
// transports] in reducer/transport/bucket_transport.h): the hook registered,
// and what a rank that ran out of data shadows its peers with.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <memory>
#include <utility>
#include <vector>

#include "reducer/core/gradient_copy.h"
#include "reducer/core/reducer.h"
#include "reducer/transport/hook_transport.h"

namespace ddp_ext::reducer {

void Reducer::register_comm_hook(std::shared_ptr<BucketHook> hook) {
  const auto lock = lock_state(Access::kChange);
  TORCH_CHECK(hook, "register_comm_hook needs a hook");
  TORCH_CHECK(!transport_->runs_hook(),
              "register_comm_hook or register_builtin_comm_hook can only be called once.");
  check_between_iterations("communication hook");
  transport_ = std::make_shared<HookTransport>(std::move(hook)); // sparse buckets too
  gradients_stay_local_ = stays_local();
  if (transport_->keeps_per_bucket_state()) {
    layout_.order().allow_continuous(false);
  }
}

TransportContext Reducer::transport_context() {
  return TransportContext{
      *process_group_, timeline_, stall_, observers_, *this, param_names_};
}

c10::intrusive_ptr<c10::ivalue::Future> Reducer::run_comm_hook(
    c10d::GradBucket& bucket) {
  std::shared_ptr<BucketTransport> transport;
  c10::intrusive_ptr<c10d::ProcessGroup> group;
  {
    const auto lock = lock_state(Access::kRead);
    transport = transport_;
    group = process_group_;
  }
  // Without the lock: Note [Windows without the lock].
  return transport->reduce_for_joined(bucket, *group);
}

c10::intrusive_ptr<c10::ivalue::Future> Reducer::run_allreduce(
    c10d::GradBucket& bucket) {
  const auto lock = lock_state(Access::kRead);
  std::vector<at::Tensor> tensors{bucket.getBufferRef()};
  return process_group_->allreduce(tensors)->getFuture();
}

std::vector<c10d::GradBucket> Reducer::zeros_like_grad_buckets() const {
  const auto lock = lock_state(Access::kRead);
  const auto& buckets = layout_.buckets();
  std::vector<c10d::GradBucket> result;
  result.reserve(buckets.size());
  for (size_t b = 0; b < buckets.size(); ++b) {
    const Bucket& bucket = buckets[b];
    const at::Tensor& param = bucket.params.front();
    at::Tensor zeros = bucket.sparse
        ? empty_sparse_like(param)
        : at::zeros_like(bucket.flat);
    result.push_back(grad_bucket_of(bucket, b, buckets.size(), std::move(zeros)));
  }
  return result;
}

void Reducer::set_forward_pass_work(
    c10::intrusive_ptr<c10d::Work> work, bool divide_by_initial_world_size) {
  const auto lock = lock_state(Access::kChange);
  averaging_.set_forward_pass_work(std::move(work), divide_by_initial_world_size);
}

void Reducer::shadowed_backward() {
  const auto lock = lock_state(Access::kChange);
  layout_.order().shadowed_backward();
}

} // namespace ddp_ext::reducer
