#include "reducer/bucket_assignment.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <utility>

namespace ddp_ext::reducer {

namespace {

struct OpenBucket {
  TensorSpec kind; // device and dtype shared by every member
  size_t position = 0; // index of this bucket in the result
  int64_t nbytes = 0;
  size_t ordinal = 0; // how many buckets of its kind came before it
};

bool same_kind(const TensorSpec& a, const TensorSpec& b) {
  return a.dtype == b.dtype && a.device == b.device;
}

} // namespace

std::vector<std::vector<size_t>> assign_buckets(
    const std::vector<TensorSpec>& tensors,
    int64_t cap_bytes,
    int64_t first_cap_bytes) {
  TORCH_CHECK(
      cap_bytes > 0 && first_cap_bytes > 0,
      "bucket caps must be positive, got ", first_cap_bytes, " bytes for the "
      "first bucket and ", cap_bytes, " for the others");
  return assign_buckets(tensors, std::vector<int64_t>{first_cap_bytes, cap_bytes});
}

std::vector<std::vector<size_t>> assign_buckets(
    const std::vector<TensorSpec>& tensors,
    const std::vector<int64_t>& caps) {
  TORCH_CHECK(!caps.empty(), "assign_buckets needs at least one bucket cap");
  for (size_t k = 0; k < caps.size(); ++k) {
    TORCH_CHECK(caps[k] > 0, "bucket caps must be positive, got ", caps[k],
                " bytes for bucket ", k);
  }
  const auto cap_of = [&caps](size_t ordinal) {
    return caps[std::min(ordinal, caps.size() - 1)];
  };
  std::vector<std::vector<size_t>> buckets;
  // Few kinds exist in practice (one or two dtypes per device): a linear
  // scan beats a map.
  std::vector<OpenBucket> open;
  for (size_t i = tensors.size(); i-- > 0;) {
    const TensorSpec& spec = tensors[i];
    OpenBucket* target = nullptr;
    for (auto& candidate : open) {
      if (same_kind(candidate.kind, spec)) {
        target = &candidate;
        break;
      }
    }
    const bool fits = target != nullptr &&
        target->nbytes + spec.nbytes <=
            cap_of(target->ordinal);
    if (!fits) {
      if (target == nullptr) {
        open.push_back(OpenBucket{spec, buckets.size(), 0, 0});
        target = &open.back();
      } else {
        target->position = buckets.size();
        target->nbytes = 0;
        ++target->ordinal;
      }
      buckets.emplace_back();
    }
    buckets[target->position].push_back(i);
    target->nbytes += spec.nbytes;
  }
  return buckets;
}

} // namespace ddp_ext::reducer
