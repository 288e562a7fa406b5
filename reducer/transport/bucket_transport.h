#pragma once

#include <ATen/core/ivalue.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/comm.hpp>

#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "reducer/layout/bucket.h"
#include "reducer/observation/observer.h"
#include "reducer/observation/stall_watch.h"
#include "reducer/observation/timeline.h"

namespace ddp_ext::reducer {

// Note [Bucket transports]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// How a full bucket travels is one object the reducer holds, a
// BucketTransport; its type is the mode, as gloo's allreduce algorithms are
// sibling classes:
//
//   Allreduce             the default: an averaging allreduce of the bucket
//                         (dense, or a sparse bucket's gradient). Gradients
//                         are scaled by 1/world_size as they are copied in
//                         (Note [Gradient averaging] in reducer/base/averaging.h).
//   CarrierWithStepCheck  Allreduce, where bucket 0 may carry the step check
//                         (Note [The step check on bucket 0] in
//                         reducer/agreement/step_check.h): chosen wherever a
//                         world of more than one rank runs no hook, by its
//                         step check (Note [Step check policies]).
//   HookTransport         a communication hook (a BucketHook) replaces the
//                         allreduce; gradients are copied in undivided
//                         (Note [Communication hooks] in comm_hooks/comm_hook.h).
//   ReduceScatter         each rank receives the averaged gradient of its
//                         range of the bucket, Bucket::shard, and the bucket's
//                         memory is released (Note [Sharded buckets] in
//                         reducer/transport/reduce_scatter.h).
//
// The contract, which every sibling follows:
//  - launch(bucket) starts the bucket's collective and keeps what is in
//    flight in the bucket (Bucket::work or Bucket::future), so that the
//    reducer can drop it (abandon an iteration) or leave it on the wire
//    (Note [The next forward's buckets first]) without knowing the transport.
//  - finish(bucket) waits for it, through the StallWatch (Note [Hang
//    attribution]), in a window without the reducer's lock (Note [Windows
//    without the lock]), and leaves the reduced values in the bucket (its
//    shard, for ReduceScatter); a bucket with nothing in flight is left as
//    it is.
//  - averages_while_copying(): whether gradients are scaled by 1/world_size
//    while copied into the bucket (averaging transports) or handed over
//    undivided (hooks, which divide as they please).
//  - runs_hook(): a hook must see every bucket, so a world of one rank
//    still copies and launches (Note [A world of one rank]), no bucket is
//    left on the wire, and the step check does not ride on bucket 0
//    unless carries_step_check() says it does (a replicated bucket 0, Note
//    [Replicated small buckets]).
//  - reduce_for_joined(): what a rank that ran out of data (Join) runs to
//    shadow a peer's bucket: the same collective over zeros.
// The reducer decides when buckets launch (index order, the same on every
// rank) and where the values go afterwards (Note [The end of a backward]);
// a transport only moves them.

// Lets the reducer's lock go around a hook or a wait and takes it back; see
// Note [Windows without the lock] in reducer/core/state_lock.cpp. `what` (a
// string literal) names the window.
class LockWindows {
 public:
  virtual void open_window(const char* what) = 0;
  virtual void close_window() = 0;

 protected:
  ~LockWindows() = default;
};

// A window without the reducer's lock for as long as it lives (also when
// what runs in it raises).
class UnlockedWindow {
 public:
  UnlockedWindow(LockWindows& windows, const char* what) : windows_(windows) {
    windows_.open_window(what);
  }
  ~UnlockedWindow() {
    windows_.close_window();
  }
  UnlockedWindow(const UnlockedWindow&) = delete;
  UnlockedWindow& operator=(const UnlockedWindow&) = delete;

 private:
  LockWindows& windows_;
};

// What the reducer lends a transport for one call, under its lock.
struct TransportContext {
  c10d::ProcessGroup& group;
  Timeline& timeline;
  StallWatch& stall;
  ReducerObservers& observers;
  LockWindows& windows;
  const std::vector<std::string>& param_names;
};

class BucketTransport {
 public:
  virtual ~BucketTransport() = default;

  // Starts the reduction of bucket `index` of `count`; `range` is the
  // timeline's range of the launch, which learns the bytes sent.
  virtual void launch(
      size_t index, size_t count, Bucket& bucket, const TransportContext& context,
      TimelineRange& range) = 0;
  // Waits for bucket `index` and leaves its reduced values in it.
  virtual void finish(size_t index, Bucket& bucket, const TransportContext& context) = 0;

  virtual bool averages_while_copying() const = 0;
  virtual bool runs_hook() const = 0;
  virtual bool keeps_per_bucket_state() const = 0;
  // Whether bucket 0 `first`, over `ranks` ranks, travels by an allreduce
  // that may carry the backward's step check (Note [The step check on
  // bucket 0]): wherever no hook runs.
  virtual bool carries_step_check(const Bucket& /*first*/, int64_t /*ranks*/) const {
    return !runs_hook();
  }
  // The reducer replaced its step check (a new process group): `unhooked`
  // is the new policy's transport_without_hook(), for a transport that
  // sends some buckets by it (Note [Replicated small buckets]).
  virtual void step_check_replaced(std::shared_ptr<BucketTransport> /*unhooked*/) {}

  // Reduces `bucket` for a rank that shadows its peers (Join); called
  // without the reducer's lock.
  virtual c10::intrusive_ptr<c10::ivalue::Future> reduce_for_joined(
      c10d::GradBucket& bucket, c10d::ProcessGroup& group) = 0;
};

// What a communication hook is handed for bucket `index` of `count`, whose
// buffer is `buffer`.
c10d::GradBucket grad_bucket_of(
    const Bucket& bucket, size_t index, size_t count, at::Tensor buffer);

// Whether `group` is one of torch's own backends (Gloo, NCCL, UCC, MPI,
// XCCL), whose collectives do nothing but reduce; see Note [A world of one
// rank].
bool torch_backend(const c10d::ProcessGroup& group);

} // namespace ddp_ext::reducer
