#pragma once

#include <ATen/core/ivalue.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include "reducer/transport/bucket_transport.h"

namespace ddp_ext::reducer {

// The default transport (Note [Bucket transports]): one allreduce of the
// bucket's flat buffer, or of a sparse bucket's gradient, whose gradients
// were divided by the world size as they were copied in, so the sum is the
// average (Note [Gradient averaging]). Its Work is kept in Bucket::work.
class Allreduce : public BucketTransport {
 public:
  void launch(
      size_t index, size_t count, Bucket& bucket, const TransportContext& context,
      TimelineRange& range) override;
  void finish(size_t index, Bucket& bucket, const TransportContext& context) override;

  bool averages_while_copying() const override {
    return true;
  }
  bool runs_hook() const override {
    return false;
  }
  bool keeps_per_bucket_state() const override {
    return false;
  }

  // A summing allreduce of the bucket (torch's _run_allreduce_hook).
  c10::intrusive_ptr<c10::ivalue::Future> reduce_for_joined(
      c10d::GradBucket& bucket, c10d::ProcessGroup& group) override;

 protected:
  // Starts the allreduce of `sent`, kept in Bucket::work.
  static void start(Bucket& bucket, const at::Tensor& sent, const TransportContext& context);
  // Records what bucket `index` sent: `sent`'s bytes.
  static void record(
      size_t index, const Bucket& bucket, const at::Tensor& sent,
      const TransportContext& context, TimelineRange& range);
};

// Waits for `work`, the allreduce of bucket `index` (also one left on the
// wire by an earlier backward); returns the future it waited through (null:
// the Work itself). `waiting_for` names the collective to the stall watch
// (its hang reports): "bucket" for an allreduce, "reduce-scatter" for a
// sharded bucket's.
c10::intrusive_ptr<c10::ivalue::Future> await_work(
    c10d::Work& work, size_t index, const TransportContext& context,
    const char* waiting_for = "bucket");

} // namespace ddp_ext::reducer
