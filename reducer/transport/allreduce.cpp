#include "reducer/transport/allreduce.h"

#include <c10/util/Exception.h>

#include <utility>
#include <vector>

namespace ddp_ext::reducer {

namespace {

// The Work's future, or null if it has none (c10d's default getFuture raises).
c10::intrusive_ptr<c10::ivalue::Future> future_of(c10d::Work& work) {
  try {
    return work.getFuture();
  } catch (const c10::Error&) {
    return nullptr;
  }
}

} // namespace

void Allreduce::start(Bucket& bucket, const at::Tensor& sent, const TransportContext& context) {
  std::vector<at::Tensor> tensors{sent};
  bucket.work = context.group.allreduce(tensors);
}

void Allreduce::record(
    size_t index, const Bucket& bucket, const at::Tensor& sent,
    const TransportContext& context, TimelineRange& range) {
  if (context.timeline.on()) {
    range.set_value(sent.is_sparse() ? sent._values().nbytes() : sent.nbytes());
    context.timeline.on_completion(*bucket.work, index);
  }
}

void Allreduce::launch(
    size_t index, size_t /*count*/, Bucket& bucket, const TransportContext& context,
    TimelineRange& range) {
  const at::Tensor& sent = bucket.sparse ? bucket.sparse_grad : bucket.flat;
  start(bucket, sent, context);
  record(index, bucket, sent, context, range);
}

c10::intrusive_ptr<c10::ivalue::Future> await_work(
    c10d::Work& work, size_t index, const TransportContext& context, const char* waiting_for) {
  // Over a group not built into torch (one written in Python), as torch's
  // reducer: through the Work's future, all such a Work must provide. Over
  // torch's own, and for a Work without a future, the Work itself (the
  // process group's timeout applies).
  const auto done = torch_backend(context.group) ? nullptr : future_of(work);
  if (done) {
    context.stall.wait(*done, waiting_for, static_cast<int64_t>(index));
  } else {
    context.stall.wait(work, waiting_for, static_cast<int64_t>(index));
  }
  context.timeline.awaited(index);
  return done;
}

void Allreduce::finish(size_t index, Bucket& bucket, const TransportContext& context) {
  if (!bucket.work) {
    return;
  }
  const auto done = await_work(*bucket.work, index, context);
  if (bucket.sparse) {
    bucket.sparse_grad =
        done ? done->value().toTensorVector().front() : bucket.work->result().front();
  }
  bucket.work.reset();
}

c10::intrusive_ptr<c10::ivalue::Future> Allreduce::reduce_for_joined(
    c10d::GradBucket& bucket, c10d::ProcessGroup& group) {
  std::vector<at::Tensor> tensors{bucket.getBufferRef()};
  return group.allreduce(tensors)->getFuture();
}

} // namespace ddp_ext::reducer
