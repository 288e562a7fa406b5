#pragma once

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "reducer/observation/stall_watch.h"
#include "reducer/layout/bucket.h"
#include "reducer/layout/bucket_memory.h"
#include "reducer/layout/gradient_order.h"
#include "reducer/base/reducer_options.h"
#include "reducer/observation/timeline.h"

namespace ddp_ext::reducer {

// Note [Overlap and bucket order]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Buckets hold parameters in reverse registration order, the order in which
// the backward pass usually produces their gradients (paper section 3.2.3).
// A hook copies its gradient into the bucket; when a bucket's last gradient
// arrives, its allreduce is launched asynchronously while autograd goes on
// computing earlier layers. Collectives must be issued in the same order on
// every rank, yet gradients may arrive in different orders on different
// ranks: so a full bucket is launched only once every bucket before it has
// been launched (the reducer's `next_bucket_`). When the last bucket is launched, a
// callback is queued on the autograd engine; it runs when the whole backward
// has finished, waits for every allreduce and writes the averages to .grad.

// Note [Agreeing on the bucket layout]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Collectives pair up by their order on each rank, so every rank must cut the
// same buckets at the same point, or their allreduces stop matching. The
// layout changes in three ways, and each is a pure function of what every
// rank holds alike:
//
// 1. The first layout, at construction: torch's first buckets
//    (assign_buckets_as_torch_first with options.first_layout_caps, Note
//    [torch's first buckets] in reducer/layout/bucket_assignment.h), or
//    without those caps assign_buckets over the parameters in reverse
//    registration order with the construction caps.
// 2. Order rebuilds (Note [Gradient order prediction] in
//    reducer/layout/gradient_order.h). The first one, as torch's DDP, is not voted
//    on: after the first synchronising backward (which every rank takes
//    part in or, having joined, shadows), at the start of the next forward
//    with gradients enabled, right after Join's notification, rank 0
//    broadcasts the order it observed and every rank assigns buckets from
//    it with assign_buckets_in_order (same caps, the first bucket keeping
//    its small cap). A rank that joined takes part from its Join hook, at
//    the same point of its shadow iteration (ddp_ext/_join.py). Later
//    (continuous) rebuilds are voted on: each rank's vote, as it stood at
//    the end of the previous backward, rides on that backward's step check
//    (the rider slot, Note [Ranks out of step] in reducer/agreement/step_check.h): the
//    allreduce starts with the first gradient and is awaited at the end of
//    the backward, so the vote costs no collective of its own. Such a
//    rebuild is agreed only if every rank voted for it (a rank that joined
//    under Join votes no). Then rank 0 broadcasts the order behind its vote
//    and every rank assigns buckets from it as above, at the end of
//    finalizing that backward. Ranks whose orders differ cannot be served
//    by one layout: rank 0's wins, as in torch's DDP, and once rank 0 is
//    content it stops voting, so the others cannot force rebuild after
//    rebuild.
// 3. Tuned caps (Note [Auto-tuned bucket caps] in ddp_ext/_auto_buckets.py):
//    set_caps re-cuts the buckets in their current order, between
//    iterations. The tuner's decisions fall due after the same number of
//    training steps on every rank (the step check keeps those equal); there,
//    at the start of the step's forward, before the forward's own
//    collectives, the ranks allreduce (MAX) their timing figure and their
//    step counts, one float64 triple per trial or window, never per
//    iteration, and every rank applies the same decision.
//
// The order of collectives. A forward with gradients enabled issues, in
// order: Join's notification, once the broadcast of rank 0's first order,
// the buffer broadcast's step check and broadcast, the tuner's allreduce
// when one falls due. A backward issues the step check (at its first
// gradient, carrying the rebuild vote), the bucket allreduces, the used
// bitmap; its end may add the broadcast of rank 0's order for a continuous
// rebuild. All sit at points every rank with data reaches in the same
// order, and a rank that joined under Join shadows them (ddp_ext/_join.py).
//
// Why two ways rather than one. The tuner's figure is a wall-clock time that
// must be compared across ranks (MAX, a float), and it is due only every
// few hundred iterations, at the start of a forward; the step check's rider
// is an int64 summed (SUM) once per backward, awaited only at the backward's
// end, after the buckets were launched with the current layout. Carrying the
// tuner's figure there would make every backward's check wider for a value
// needed rarely, and the decision would come a backward late, after this
// iteration's buckets already left; a cap change must come between
// iterations, which is where the tuner's own allreduce already is. So
// continuous order rebuilds agree at the end of a backward, caps at the
// start of a forward, and this Note is where that is argued. The first
// rebuild needs no agreement (every rank knows it is due) and sits where
// torch's DDP has it, so that _has_rebuilt_buckets and the layout match
// torch's iteration by iteration (torch's ZeRO overlap hook reads the flag).

// Bytes a parameter occupies in a bucket, per parameter, with what else
// assigning buckets needs: computed once, here, for every layout.
std::vector<TensorSpec> tensor_specs(
    const std::vector<at::Tensor>& params,
    std::optional<c10::ScalarType> reduce_dtype,
    const std::vector<bool>& sparse,
    const std::vector<int64_t>& units);

// The buckets and where each parameter lies in them: the caps, the first
// layout, the observed gradient order, and every rebuild. Not thread-safe:
// the reducer calls it under its lock, and re-arms its iteration state after
// any call that returns true (the buckets were replaced).
class BucketLayout {
 public:
  // Lays out the first buckets with options.bucket_caps (see the Note). With
  // gradient_as_bucket_view, a .grad that exists already moves into its view.
  // `params`, `names` and `sparse` must outlive the layout.
  BucketLayout(
      const std::vector<at::Tensor>& params,
      const std::vector<std::string>& names,
      const std::vector<bool>& sparse,
      const ReducerOptions& options);

  std::vector<Bucket>& buckets() {
    return buckets_;
  }
  const std::vector<Bucket>& buckets() const {
    return buckets_;
  }
  // The bucket of parameter `index` and its position there.
  Bucket& bucket_of(size_t index) {
    return buckets_[bucket_of_param_[index]];
  }
  size_t bucket_index_of(size_t index) const {
    return bucket_of_param_[index];
  }
  size_t slot_of(size_t index) const {
    return slot_of_param_[index];
  }
  // Parameter indices per bucket, in launch order, and each bucket's bytes.
  std::vector<std::vector<size_t>> indices() const;
  std::vector<int64_t> sizes() const;

  // See Note [Gradient order prediction].
  GradientOrder& order() {
    return order_;
  }
  const GradientOrder& order() const {
    return order_;
  }

  // The caps buckets are cut with (the k-th bucket of each kind capped at
  // caps[k], the last repeating), and the layout other caps would give the
  // current order.
  const std::vector<int64_t>& caps() const {
    return order_.caps();
  }
  std::vector<std::vector<size_t>> layout_for_caps(
      const std::vector<int64_t>& caps) const;
  // Cuts the buckets with `caps` from now on (between iterations only);
  // returns whether the layout changed.
  bool set_caps(const std::vector<int64_t>& caps, Timeline& timeline);

  // From now on each bucket has memory of its own, released between its
  // reduction and its next gradient, and no arena (Note [Sharded buckets]
  // in reducer/transport/reduce_scatter.h). Between iterations only.
  void separate_buckets();

  // This rank's rebuild vote for the backward starting now (0 if none is
  // asked for); the step check carries it.
  int64_t cast_vote();
  // After a finished synchronising backward: observes its order and, if a
  // vote was cast and `summed_votes` (unset: this rank's own, a world of one)
  // agree, rebuilds from rank 0's order (broadcast, awaited through `watch`
  // when given: Note [Hang attribution]). Returns whether the layout changed.
  bool conclude(
      bool launched_at_end,
      std::optional<int64_t> summed_votes,
      c10d::ProcessGroup& group,
      Timeline& timeline,
      StallWatch* watch = nullptr);
  // The first rebuild, at the start of a forward (see the Note, point 2):
  // if due, receives rank 0's first order (this rank's own, or its current
  // layout's if it has none, when it is rank 0) and rebuilds from it.
  struct FirstRebuild {
    bool done = false; // the first rebuild happened now
    bool changed = false; // and replaced the buckets
  };
  FirstRebuild rebuild_first(
      c10d::ProcessGroup& group, Timeline& timeline, StallWatch* watch = nullptr);
  // Forgets a vote cast for an iteration that will not conclude.
  void forget_vote() {
    vote_cast_ = false;
  }

 private:
  LayoutInputs inputs() const;
  void index_buckets();
  std::vector<size_t> current_order() const;
  // Rank 0's order, broadcast; `waiting_for` names the wait to the stall
  // watch (the first rebuild's happens at a forward, the later ones' at the
  // end of a backward).
  std::vector<size_t> agreed_order(
      const std::vector<size_t>& mine,
      c10d::ProcessGroup& group,
      StallWatch* watch,
      const char* waiting_for) const;
  bool rebuild(const std::vector<std::vector<size_t>>& layout, Timeline& timeline);

  const std::vector<at::Tensor>& params_;
  const std::vector<std::string>& names_;
  const std::vector<bool>& sparse_;
  const std::optional<c10::ScalarType> reduce_dtype_;
  const bool gradient_as_bucket_view_;
  bool separate_ = false; // see separate_buckets()
  GradientOrder order_;
  std::vector<Bucket> buckets_;
  // Where each parameter lives: bucket index and position within it.
  std::vector<size_t> bucket_of_param_;
  std::vector<size_t> slot_of_param_;
  // The flat tensors every bucket is a slice of; see Note [Bucket memory].
  std::vector<at::Tensor> arenas_;
  // Whether the backward under way carries a vote, and this rank's.
  bool vote_cast_ = false;
  int64_t own_vote_ = 0;
};

} // namespace ddp_ext::reducer
