#include "reducer/participation/layer_drop.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <utility>

namespace ddp_ext::reducer {

namespace {

// FNV-1a over the sorted indices, folded into [1, 2^62].
int64_t fingerprint_of(const std::vector<size_t>& sorted) {
  uint64_t hash = 14695981039346656037ULL;
  for (size_t index : sorted) {
    for (int byte = 0; byte < 8; ++byte) {
      hash ^= (static_cast<uint64_t>(index) >> (8 * byte)) & 0xffU;
      hash *= 1099511628211ULL;
    }
  }
  return 1 + static_cast<int64_t>(hash % ((uint64_t{1} << 62) - 1));
}

} // namespace

DropPlan::DropPlan(size_t params) : dropped_(params, false) {
  fingerprint_ = fingerprint_of(indices_);
}

void DropPlan::clear() {
  for (size_t index : indices_) {
    dropped_[index] = false;
  }
  indices_.clear();
  fingerprint_ = fingerprint_of(indices_);
}

void DropPlan::set(std::vector<size_t> dropped) {
  std::sort(dropped.begin(), dropped.end());
  for (size_t k = 0; k < dropped.size(); ++k) {
    TORCH_CHECK(
        dropped[k] < dropped_.size(), "dropped parameter index ", dropped[k],
        " is out of range for ", dropped_.size(), " parameters");
    TORCH_CHECK(k == 0 || dropped[k] != dropped[k - 1],
                "parameter ", dropped[k], " is dropped twice");
  }
  clear();
  for (size_t index : dropped) {
    dropped_[index] = true;
  }
  indices_ = std::move(dropped);
  fingerprint_ = fingerprint_of(indices_);
}

bool DropPlan::drops_all(const std::vector<size_t>& members) const {
  return !indices_.empty() &&
      std::all_of(members.begin(), members.end(),
                  [this](size_t index) { return dropped_[index]; });
}

} // namespace ddp_ext::reducer
