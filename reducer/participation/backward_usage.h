#pragma once

#include <cstddef>
#include <vector>

#include "reducer/participation/layer_drop.h"

namespace ddp_ext::reducer {

// Note [Used by no rank]
// ~~~~~~~~~~~~~~~~~~~~~~
// A parameter that no rank gave a gradient in a synchronising backward keeps
// the .grad the user left: one whose layer every rank dropped (Note [Layer
// dropping]), or one that the allreduced usage bitmap (Note [Unused
// parameters]) or a learned static graph (Note [Static graph]) marks unused
// on every rank. The reducer works this out once per backward, when the
// bitmap's allreduce is in, as a BackwardUsage; whatever writes that
// backward's gradients back reads it: the write-back of every bucket at the
// end of the backward, a step per bucket, and a bucket left on the wire for
// the next forward.
class BackwardUsage {
 public:
  // Every parameter counts as used.
  BackwardUsage() = default;

  // `globally_used`: per parameter, whether some rank used it (empty: all
  // of them); `dropped`: the layers every rank dropped.
  BackwardUsage(size_t params, const std::vector<bool>& globally_used, const DropPlan& dropped) {
    if (globally_used.empty() && dropped.empty()) {
      return;
    }
    unused_.assign(params, false);
    for (size_t index = 0; index < params; ++index) {
      unused_[index] = dropped.dropped(index) || (!globally_used.empty() && !globally_used[index]);
    }
  }

  bool used_by_no_rank(size_t index) const {
    return !unused_.empty() && unused_[index];
  }

 private:
  std::vector<bool> unused_; // empty: every parameter was used
};

} // namespace ddp_ext::reducer
