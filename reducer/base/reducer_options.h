#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <optional>
#include <vector>

#include "reducer/base/bucket_rebuild.h"

namespace ddp_ext::reducer {

// Knobs of one Reducer: the caps its bucket layout starts from, and what
// happens during each iteration.
struct ReducerOptions {
  // Search the autograd graph after each synchronising forward for parameters
  // that will get no gradient, and allreduce a per-parameter "used" bitmap so
  // that parameters no rank used keep their .grad untouched.
  // See Note [Unused parameters]. Default: false.
  bool find_unused_parameters = false;

  // Make each parameter's .grad a view into its bucket, so no copy is needed
  // on the way in or out. Default: false (.grad is a tensor of its own).
  bool gradient_as_bucket_view = false;

  // Launch each bucket's allreduce as soon as its last gradient arrives
  // (true), or hold every allreduce until the backward pass has finished
  // (false; only useful to measure what overlap buys). Can be changed between
  // iterations with Reducer::set_overlap_with_backward.
  // See Note [Overlap and bucket order]. Default: true.
  bool overlap_with_backward = true;

  // With find_unused_parameters, do not allreduce a bucket whose parameters
  // all went unused on this rank. Only correct when every rank leaves the
  // same parameters unused in every iteration (torch's
  // skip_all_reduce_unused_params). Default: false.
  bool skip_all_reduce_unused_params = false;

  // Whether the wrapper broadcasts buffers before forwards (each one behind a
  // step check of its own). Off, the backward's step check rides on bucket
  // 0's allreduce where it can: Note [The step check on bucket 0] in
  // reducer/agreement/step_check.h. Default: true.
  bool buffers_broadcast = true;

  // Copy gradients into their bucket only when the bucket's last gradient
  // has arrived (one pass over the bucket, then one scaling of the whole
  // bucket) instead of one fused copy-and-scale per gradient (torch's
  // batched_grad_copy). Same values either way. Default: false.
  bool batched_grad_copy = false;

  // dtype of the buckets, and so of the reduction (mixed precision's
  // reduce_dtype); gradients are cast on their way in and out. Unset: each
  // bucket has its parameters' dtype. Default: unset.
  std::optional<c10::ScalarType> reduce_dtype;

  // When to lay the buckets out again in the order gradients arrive; see
  // Note [Gradient order prediction]. Default: kNever (the Python wrapper's
  // default is continuous).
  BucketRebuild rebuild_buckets = BucketRebuild::kNever;

  // The caps buckets are cut with, first layout and rebuilds alike (the k-th
  // bucket of each kind capped at bucket_caps[k], the last repeating; see
  // assign_buckets). Required. See Note [Agreeing on the bucket layout].
  std::vector<int64_t> bucket_caps;

  // The caps of the first layout, cut as torch's DDP cuts its first buckets
  // (assign_buckets_as_torch_first, Note [torch's first buckets] in
  // reducer/layout/bucket_assignment.h). Empty: the first layout is cut with
  // bucket_caps from reverse registration order, as a rebuild would cut it
  // from that order. Default: empty.
  std::vector<int64_t> first_layout_caps;

  // Per parameter, the droppable layer it belongs to, -1 for none: rebuilds
  // keep each layer's parameters in buckets of their own. See Note [Layer
  // dropping] in reducer/participation/layer_drop.h. Empty: no droppable layers.
  std::vector<int64_t> layer_units;
};

} // namespace ddp_ext::reducer
