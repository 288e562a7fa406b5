#include "reducer/transport/hook_transport.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

namespace ddp_ext::reducer {

void HookTransport::launch(
    size_t index, size_t count, Bucket& bucket, const TransportContext& context,
    TimelineRange& range) {
  const at::Tensor& buffer = bucket.sparse ? bucket.sparse_grad : bucket.flat;
  c10d::GradBucket handed = grad_bucket_of(bucket, index, count, buffer);
  c10::intrusive_ptr<c10::ivalue::Future> future;
  {
    TimelineRange hook_range(context.timeline, TimelineEvent::kCommHook, index);
    // See Note [Windows without the lock]: the hook may read the wrapper,
    // and a later bucket waits until this one has been launched.
    UnlockedWindow window(context.windows, "its communication hook");
    future = hook_->runHook(handed);
  }
  bucket.future = std::move(future);
  if (context.timeline.on() && bucket.future) {
    range.set_value(buffer.is_sparse() ? buffer._values().nbytes() : buffer.nbytes());
    context.timeline.on_completion(bucket.future, index);
  }
}

void HookTransport::finish(size_t index, Bucket& bucket, const TransportContext& context) {
  if (!bucket.future) {
    return;
  }
  // The future's value may be a Python object: read and released without
  // the lock (Note [Windows without the lock]).
  auto future = std::move(bucket.future);
  bucket.future.reset();
  at::Tensor reduced;
  {
    UnlockedWindow window(context.windows, "a wait for its communication hook's future");
    context.stall.wait(*future, "bucket", static_cast<int64_t>(index));
    reduced = hook_->parseHookResult(future->value());
    future.reset();
  }
  if (bucket.sparse) {
    // See Note [Sparse gradients]: the hook's result becomes the .grad.
    TORCH_CHECK(
        reduced.is_sparse() && reduced.sizes() == bucket.params.front().sizes(),
        "the communication hook's future for bucket ", index, " holds a ",
        reduced.is_sparse() ? "sparse" : "dense", " tensor of shape ",
        reduced.sizes(), ", but the bucket holds the sparse gradient of ",
        context.param_names[bucket.param_indices.front()], " (shape ",
        bucket.params.front().sizes(), "): return the reduced bucket.buffer()");
    bucket.sparse_grad = reduced;
  } else if (!reduced.is_same(bucket.flat)) {
    TORCH_CHECK(
        reduced.numel() == bucket.flat.numel(),
        "the communication hook's future for bucket ", index, " holds ",
        reduced.numel(), " elements, but the bucket has ",
        bucket.flat.numel(), ": return the reduced bucket.buffer()");
    at::NoGradGuard no_grad;
    bucket.flat.copy_(reduced.reshape({-1}));
  }
}

c10::intrusive_ptr<c10::ivalue::Future> HookTransport::reduce_for_joined(
    c10d::GradBucket& bucket, c10d::ProcessGroup& /*group*/) {
  return hook_->runHook(bucket);
}

} // namespace ddp_ext::reducer
