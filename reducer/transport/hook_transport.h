#pragma once

#include <memory>
#include <utility>

#include "reducer/transport/bucket_hook.h"
#include "reducer/transport/bucket_transport.h"

namespace ddp_ext::reducer {

// A communication hook in place of the allreduce (Note [Bucket transports];
// torch's contract, Note [Communication hooks] in comm_hooks/comm_hook.h):
// gradients are copied into the bucket undivided; launch() hands the hook a
// c10d::GradBucket (a sparse bucket's buffer is its gradient: Note [Sparse
// gradients]) in a window without the reducer's lock, and keeps the future
// it returns in Bucket::future; finish() waits for that future, also
// without the lock (its value may be a Python object), and copies the
// reduced buffer into the bucket if it is another tensor.
class HookTransport final : public BucketTransport {
 public:
  explicit HookTransport(std::shared_ptr<BucketHook> hook) : hook_(std::move(hook)) {}

  void launch(
      size_t index, size_t count, Bucket& bucket, const TransportContext& context,
      TimelineRange& range) override;
  void finish(size_t index, Bucket& bucket, const TransportContext& context) override;

  bool averages_while_copying() const override {
    return false;
  }
  bool runs_hook() const override {
    return true;
  }
  bool keeps_per_bucket_state() const override {
    return hook_->keeps_per_bucket_state();
  }

  // The hook itself, over the zeros a joined rank shadows with.
  c10::intrusive_ptr<c10::ivalue::Future> reduce_for_joined(
      c10d::GradBucket& bucket, c10d::ProcessGroup& group) override;

 private:
  std::shared_ptr<BucketHook> hook_;
};

} // namespace ddp_ext::reducer
