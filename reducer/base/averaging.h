#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <cstdint>

namespace ddp_ext::reducer {

// Note [Gradient averaging]
// ~~~~~~~~~~~~~~~~~~~~~~~~~
// Each gradient is multiplied by 1/world_size while it is copied into its
// bucket (one pass instead of a copy and a scale), and the buckets are then
// summed. Scaling before summing, as torch's DDP does, keeps low-precision
// sums in range and gives the same rounding as torch's DDP. With
// batched_grad_copy the copies wait until the bucket is launched and the
// whole bucket is scaled at once: the same products, so the same bits.
//
// Note [Join and the divide factor]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Under torch.distributed.algorithms.join.Join, every forward of a rank that
// still has data starts an allreduce of 1 (ranks that ran out of data add 0),
// and ddp_ext/_join.py hands its work to set_forward_pass_work. With
// divide_by_initial_world_size=False the first gradient of the backward waits
// for it and averages over that many ranks instead of the world size; the
// ranks that joined shadow each bucket's reduction with zeros (run_comm_hook
// on zeros_like_grad_buckets), so the sum is over the ranks with data.

// How many ranks the gradients are averaged over, and the factor that
// scales them. Not thread-safe: the reducer calls it under its lock.
class Averaging {
 public:
  explicit Averaging(int64_t ranks);

  // Averages over `ranks` from now on (a new process group).
  void set_ranks(int64_t ranks);
  // See Note [Join and the divide factor].
  void set_forward_pass_work(
      c10::intrusive_ptr<c10d::Work> work, bool divide_by_initial_world_size);
  void forget_forward_pass_work() {
    work_.reset();
  }
  // Whether this forward runs under Join (its work is not taken yet).
  bool under_join() const {
    return static_cast<bool>(work_);
  }
  // At the first gradient of a backward: the ranks to average over, from
  // the forward's work under Join, else `world_size`.
  void take(int64_t world_size);

  // 1 / ranks as a wrapped scalar, so that the scale is applied like a
  // Python number (no type promotion).
  const at::Tensor& factor() const {
    return factor_;
  }
  // The same as a count, for sparse gradients (divided, as torch's DDP does).
  int64_t ranks() const {
    return ranks_;
  }

 private:
  at::Tensor factor_;
  int64_t ranks_ = 0;
  c10::intrusive_ptr<c10d::Work> work_;
  bool divide_by_initial_world_size_ = true;
};

} // namespace ddp_ext::reducer
