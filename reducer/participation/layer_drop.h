#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace ddp_ext::reducer {

// Note [Layer dropping]
// ~~~~~~~~~~~~~~~~~~~~~
// LayerDrop, stochastic depth and progressive layer dropping skip whole
// layers in some iterations (paper section 6.2.2). A skipped layer's
// parameters get no gradient, yet a bucket is the unit of communication, so
// a DDP with a fixed parameter-to-bucket map still sends every byte. The
// paper offers two ways out: re-map parameters to bucket memory each
// iteration, or map layers to buckets and skip whole buckets. ddp_ext does
// the second:
//
// - Layers are units. ddp_ext.LayerDrop (ddp_ext/layer_drop.py) marks its
//   layers; the wrapper gives each parameter that belongs to one layer only
//   that layer's unit. Bucket assignment never puts parameters of different
//   units in one bucket (a layer larger than the cap spans several; a
//   parameter outside every layer, or shared by two, has no unit and is
//   never dropped). Rebuilds keep the rule (reducer/layout/bucket_assignment.h).
// - The plan is known before the backward, on every rank, with no
//   collective: each LayerDrop draws its plan from a seed every rank shares
//   (rank 0's, broadcast once when the wrapper is built) and a count of its
//   draws, so equal calls give equal plans. At the end of the forward the
//   wrapper hands the reducer the parameters of every dropped layer.
// - Under no_sync, a layer counts as dropped only if every forward since the
//   last synchronisation dropped it. One that an earlier forward ran but the
//   synchronising one dropped gets no gradient in this backward, yet its
//   .grad holds what the earlier ones accumulated: it is marked ready when
//   the backward starts and reduced like any other.
// - A dropped parameter is marked ready when the backward starts, like an
//   unused one, but nothing is copied for it. A bucket whose parameters were
//   all dropped is not launched: the bytes on the wire shrink with the drop
//   rate, and no bucket memory is allocated, freed or re-sliced, so
//   .grad views (gradient_as_bucket_view) never move.
// - .grad of a dropped parameter stays as the user left it: what torch's
//   DDP does for a parameter no rank used, and what local training with the
//   same drops leaves (no gradient reached it). A dropped parameter that
//   shares a bucket with kept ones (a layout made without units) travels as
//   stale bytes and is not written back; if its .grad is a view into that
//   bucket, it is saved before and restored after, as for unused ones.
// - If ranks disagree on the plan, their bucket allreduces would pair
//   buckets of different sizes (Gloo aborts the process on that). The step
//   check (Note [Ranks out of step]) carries each rank's plan fingerprint,
//   and in a module with droppable layers the first bucket waits for it
//   before it is launched: on a mismatch every rank raises from its
//   backward, having sent no bucket and written nothing to .grad. The wait
//   is one small allreduce's latency per iteration, paid only by such
//   modules; the check itself starts with the first gradient.
//
// Why not re-map parameters into packed buckets: the views handed out as
// .grad with gradient_as_bucket_view would move every iteration, each
// iteration would re-slice every bucket, and layout agreement would have to
// be recomputed per iteration. Skipping whole buckets costs only one more
// bucket boundary per layer, which for the layers that matter (megabytes
// each) is below the cap anyway.

// The parameters dropped in one synchronising backward.
class DropPlan {
 public:
  explicit DropPlan(size_t params = 0);

  // Replaces the plan. Checks that indices are in range and distinct.
  void set(std::vector<size_t> dropped);
  void clear();

  bool empty() const {
    return indices_.empty();
  }
  bool dropped(size_t index) const {
    return !indices_.empty() && dropped_[index];
  }
  // Whether every parameter in `members` was dropped (a bucket that is then
  // neither filled nor communicated).
  bool drops_all(const std::vector<size_t>& members) const;
  // Sorted.
  const std::vector<size_t>& indices() const {
    return indices_;
  }
  // A value in [1, 2^62] that equal plans share, compared across ranks by
  // the step check.
  int64_t fingerprint() const {
    return fingerprint_;
  }

 private:
  std::vector<bool> dropped_;
  std::vector<size_t> indices_;
  int64_t fingerprint_ = 1;
};

} // namespace ddp_ext::reducer
