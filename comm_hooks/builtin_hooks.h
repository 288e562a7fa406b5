#pragma once

#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/comm.hpp>

#include <memory>

#include "comm_hooks/comm_hook.h"

namespace ddp_ext::comm_hooks {

// Communication hooks written in C++, so that they run without the GIL.
// Each follows torch's hook contract (see Note [Communication hooks] in
// comm_hooks/comm_hook.h): the bucket holds gradients not yet divided by the
// world size, and the returned future's value is the reduced buffer.

// What both built-in hooks share: the group they reduce over, a result that
// is a tensor or a list holding one, and no state kept between buckets.
class GroupCommHook : public CommHook {
 public:
  explicit GroupCommHook(c10::intrusive_ptr<c10d::ProcessGroup> group)
      : group_(std::move(group)) {}

  at::Tensor parseHookResult(const c10::IValue& result) override;
  bool keeps_per_bucket_state() const override {
    return false;
  }

 protected:
  c10::intrusive_ptr<c10d::ProcessGroup> group_;
};

// Divides the bucket by the world size and allreduces it in place.
class AllreduceCommHook : public GroupCommHook {
 public:
  using GroupCommHook::GroupCommHook;
  c10::intrusive_ptr<c10::ivalue::Future> runHook(
      c10d::GradBucket& bucket) override;
};

// Casts the bucket to float16, divides it by the world size, allreduces the
// half-precision copy (half the bytes on the wire) and writes the result
// back into the bucket in its own dtype.
class Fp16CompressCommHook : public GroupCommHook {
 public:
  using GroupCommHook::GroupCommHook;
  c10::intrusive_ptr<c10::ivalue::Future> runHook(
      c10d::GradBucket& bucket) override;
};

// The hook for `type`: 1 is allreduce, 2 is float16 compression (the values
// of torch.distributed.BuiltinCommHookType).
std::shared_ptr<CommHook> make_builtin_comm_hook(
    int type, c10::intrusive_ptr<c10d::ProcessGroup> group);

} // namespace ddp_ext::comm_hooks
