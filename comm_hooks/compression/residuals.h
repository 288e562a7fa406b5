#pragma once

#include <ATen/core/Tensor.h>

#include <cstddef>
#include <cstdint>
#include <unordered_map>
#include <vector>

namespace ddp_ext::compression {

// Error feedback's memory (see Note [Adaptive precision]): per bucket, what
// rounding dropped from each element, in the units that were sent (the
// gradient divided by the world size), as one float32 tensor shaped like
// the bucket.
//
// Keyed by bucket index, but kept per parameter underneath: when a bucket's
// parameters change (buckets rebuilt in the order gradients arrive, or
// tuned), the residuals of its old parameters are carried to wherever those
// parameters went, so a new layout loses nothing.
class Residuals {
 public:
  // The residual of bucket `index`, whose parameters (in bucket order) are
  // `params` and which holds `numel` elements; zeros where nothing is owed.
  // Allocated on first use.
  at::Tensor& of(size_t index, const std::vector<at::Tensor>& params,
                 const at::Tensor& like);

  // What bucket `index` owes (undefined if nothing), forgotten here: for a
  // send at full precision, which adds it and leaves nothing behind.
  at::Tensor take(size_t index, const std::vector<at::Tensor>& params,
                  const at::Tensor& like);

  // The residual of bucket `index`, undefined if it owes nothing.
  at::Tensor get(size_t index) const;

 private:
  struct Entry {
    std::vector<const void*> params; // TensorImpl of each parameter
    std::vector<int64_t> numels;
    at::Tensor values;               // undefined: nothing owed
    int64_t generation = -1;         // the layout it was keyed in
  };

  Entry& entry_for(size_t index, const std::vector<at::Tensor>& params,
                   const at::Tensor& like);
  void release_to_orphans(Entry& entry);
  at::Tensor adopt_orphans(const std::vector<at::Tensor>& params,
                           const at::Tensor& like);

  std::vector<Entry> entries_;
  // Residuals of parameters whose bucket was laid out anew, until their new
  // bucket is next sent.
  std::unordered_map<const void*, at::Tensor> orphans_;
  // Bumped at each new layout; an entry of an older one is keyed anew.
  int64_t generation_ = 0;
};

} // namespace ddp_ext::compression
