#pragma once

#include <torch/csrc/distributed/c10d/comm.hpp>

namespace ddp_ext::reducer {

// What a communication hook is to the reducer: torch's hook contract (runHook
// hands back a future, parseHookResult reads the reduced buffer from its
// value), and whether it keeps state per bucket index. HookTransport runs
// one; comm_hooks::CommHook (comm_hooks/comm_hook.h) is the family of hooks
// that implement it. See Note [Bucket transports].
//
// A hook that keeps state per bucket index (error feedback held by bucket,
// as PowerSGD does) would see that state handed to other parameters if the
// buckets were laid out again: such a hook stops the reducer's continuous
// rebuilding after the first rebuild (Note [Gradient order prediction] in
// reducer/layout/gradient_order.h).
class BucketHook : public c10d::CommHookInterface {
 public:
  virtual bool keeps_per_bucket_state() const = 0;
};

} // namespace ddp_ext::reducer
