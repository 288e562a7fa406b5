#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Stream.h>
#include <c10/util/intrusive_ptr.h>
#include <ATen/core/ivalue.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <cstddef>
#include <optional>
#include <vector>

namespace ddp_ext::reducer {

// A flat buffer that holds the gradients of several parameters of one device
// and dtype, reduced with a single collective.
struct Bucket {
  // Holds one parameter with sparse gradients, and then no `flat` or
  // `views`; see Note [Sparse gradients].
  bool sparse = false;
  at::Tensor sparse_grad;

  // One-dimensional buffer on the parameters' device; every view below
  // aliases a slice of it.
  at::Tensor flat;

  // Indices (into the reducer's parameter list) of the parameters laid out in
  // this bucket, in layout order.
  std::vector<size_t> param_indices;

  // views[k]: the slice of `flat` for param_indices[k], shaped and strided
  // like the parameter.
  std::vector<at::Tensor> views;

  // Gradients still missing before the bucket can be reduced; refilled at the
  // start of every synchronising backward.
  size_t pending = 0;

  // Every parameter of the bucket was dropped in this iteration: it is
  // neither filled nor communicated. See Note [Layer dropping].
  bool dropped = false;

  // The device stream that last wrote gradients into `flat` this iteration
  // (none on the CPU); see Note [CUDA streams].
  std::optional<c10::Stream> filled_on;

  // Where each parameter's gradient lies in `flat`, and its shape: what a
  // communication hook's GradBucket describes.
  std::vector<size_t> offsets;
  std::vector<size_t> lengths;
  std::vector<c10::IntArrayRef> sizes;
  std::vector<at::Tensor> params;

  // The default allreduce in flight for this bucket, if launched this
  // iteration...
  c10::intrusive_ptr<c10d::Work> work;
  // ... or, with a communication hook, the future it returned.
  c10::intrusive_ptr<c10::ivalue::Future> future;

  // Only when the buckets are reduce-scattered (Note [Sharded buckets] in
  // reducer/transport/reduce_scatter.h): this rank's range of the reduced
  // bucket, and whether `flat`'s memory is released until its next gradient.
  at::Tensor shard;
  bool released = false;
};

} // namespace ddp_ext::reducer
