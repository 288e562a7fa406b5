#pragma once

#include <ATen/core/ivalue.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/distributed/c10d/comm.hpp>

#include <memory>
#include <utility>

#include "reducer/transport/bucket_hook.h"

namespace ddp_ext::comm_hooks {

// Note [Communication hooks]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~
// A communication hook replaces the default averaging allreduce of a bucket
// (torch's contract, paper section 6.2.3). Gradients are copied into the
// bucket without the 1/world_size scale; when the bucket is launched, the
// reducer hands the hook a c10d::GradBucket (index, the flat buffer,
// per-parameter offsets and shapes, the parameters) and the hook returns a
// future. At the end of the backward pass each future is awaited and its
// value, the reduced buffer, is copied into the bucket if it is another
// tensor, then written back to .grad like an allreduced bucket. A hook that
// raises, or returns no future, raises from the backward pass on the rank
// where it did.
//
// Every hook the reducer runs is a CommHook: a Python hook through torch's
// c10d::PythonCommHook (TorchContractHook below; it takes the GIL), the
// built-in hooks (comm_hooks/builtin_hooks.h) and the adaptive-precision
// hook (Note [Adaptive precision] in
// comm_hooks/compression/precision_policy.h), the last two plain C++.
// ddp_ext/_comm_hooks.py is the one place that builds them from what the
// user registers.
//
// The default reduction (no hook registered) is not a CommHook but the
// reducer's Allreduce transport: it scales gradients while copying them
// into the bucket (Note [Gradient averaging] in reducer/base/averaging.h) and
// reduces sparse buckets too. A CommHook runs through the HookTransport
// (Note [Bucket transports] in reducer/transport/bucket_transport.h), which
// knows hooks only as reducer::BucketHook: the reducer includes nothing
// from comm_hooks/.
//
// A hook that keeps state per bucket index (error feedback held by bucket,
// as PowerSGD does) would see that state handed to other parameters if the
// buckets were laid out again. keeps_per_bucket_state() is the one place
// that says so: such a hook stops the reducer's continuous rebuilding after
// the first rebuild (Note [Gradient order prediction] in
// reducer/layout/gradient_order.h) and the wrapper's bucket tuner (Note
// [Auto-tuned bucket caps] in ddp_ext/_auto_buckets.py).
class CommHook : public reducer::BucketHook {};

// A hook written against torch's interface only, such as a Python hook run
// through c10d::PythonCommHook. What it keeps is unknown, so it is taken to
// keep state per bucket.
class TorchContractHook final : public CommHook {
 public:
  explicit TorchContractHook(std::unique_ptr<c10d::CommHookInterface> hook)
      : hook_(std::move(hook)) {}

  c10::intrusive_ptr<c10::ivalue::Future> runHook(
      c10d::GradBucket& bucket) override {
    return hook_->runHook(bucket);
  }
  at::Tensor parseHookResult(const c10::IValue& result) override {
    return hook_->parseHookResult(result);
  }
  bool keeps_per_bucket_state() const override {
    return true;
  }

 private:
  std::unique_ptr<c10d::CommHookInterface> hook_;
};

} // namespace ddp_ext::comm_hooks
