#include "reducer/layout/bucket_assignment.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <utility>

namespace ddp_ext::reducer {

namespace {

struct OpenBucket {
  TensorSpec kind; // device, dtype and unit shared by every member
  size_t position = 0; // index of this bucket in the result
  int64_t nbytes = 0;
  size_t ordinal = 0; // how many buckets of its kind came before it
  bool full = false; // reached its cap: the next tensor of its kind opens one
};

bool same_kind(const TensorSpec& a, const TensorSpec& b) {
  return a.dtype == b.dtype && a.device == b.device;
}

// Buckets in the order they were opened, and when each got its last tensor.
struct Grouping {
  std::vector<std::vector<size_t>> buckets;
  std::vector<size_t> last_visit;
};

// Visits tensors in `visit_order` and groups them as assign_buckets describes.
Grouping group_in_visit_order(
    const std::vector<TensorSpec>& tensors,
    const std::vector<size_t>& visit_order,
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
  std::vector<size_t> last_visit; // per bucket: when its last tensor joined
  // Few kinds exist in practice (one or two dtypes per device): a linear
  // scan beats a map.
  std::vector<OpenBucket> open;
  for (size_t visit = 0; visit < visit_order.size(); ++visit) {
    const size_t i = visit_order[visit];
    const TensorSpec& spec = tensors[i];
    if (spec.sparse) {
      buckets.push_back({i});
      last_visit.push_back(visit);
      continue;
    }
    OpenBucket* target = nullptr;
    for (auto& candidate : open) {
      if (same_kind(candidate.kind, spec)) {
        target = &candidate;
        break;
      }
    }
    // A full bucket (or one of another droppable layer) takes no more.
    const bool joins = target != nullptr && !target->full &&
        target->kind.unit == spec.unit;
    if (!joins) {
      if (target == nullptr) {
        open.push_back(OpenBucket{spec, buckets.size(), 0, 0});
        target = &open.back();
      } else {
        target->position = buckets.size();
        target->kind.unit = spec.unit;
        target->nbytes = 0;
        target->full = false;
        ++target->ordinal;
      }
      buckets.emplace_back();
      last_visit.push_back(visit);
    }
    buckets[target->position].push_back(i);
    last_visit[target->position] = visit;
    target->nbytes += spec.nbytes;
    target->full = target->nbytes >= cap_of(target->ordinal);
  }
  return Grouping{std::move(buckets), std::move(last_visit)};
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
  std::vector<size_t> reverse(tensors.size());
  for (size_t k = 0; k < reverse.size(); ++k) {
    reverse[k] = reverse.size() - 1 - k;
  }
  return group_in_visit_order(tensors, reverse, caps).buckets;
}

std::vector<std::vector<size_t>> assign_buckets_as_torch_first(
    const std::vector<TensorSpec>& tensors,
    const std::vector<int64_t>& caps) {
  // See Note [torch's first buckets]. Buckets are opened in the order of
  // their first (lowest) index: reversed, that is torch's launch order.
  std::vector<size_t> registration(tensors.size());
  for (size_t k = 0; k < registration.size(); ++k) {
    registration[k] = k;
  }
  std::vector<std::vector<size_t>> buckets =
      group_in_visit_order(tensors, registration, caps).buckets;
  std::reverse(buckets.begin(), buckets.end());
  return buckets;
}

std::vector<std::vector<size_t>> assign_buckets_in_order(
    const std::vector<TensorSpec>& tensors,
    const std::vector<size_t>& order,
    const std::vector<int64_t>& caps) {
  TORCH_CHECK(
      order.size() == tensors.size(), "a gradient order must name each of the ",
      tensors.size(), " tensors once, got ", order.size(), " entries");
  std::vector<bool> seen(tensors.size(), false);
  for (size_t index : order) {
    TORCH_CHECK(index < tensors.size() && !seen[index],
                "a gradient order must name each tensor once; ", index,
                " is out of range or repeated");
    seen[index] = true;
  }
  Grouping grouping = group_in_visit_order(tensors, order, caps);
  // Launch order: by the position of each bucket's last tensor.
  std::vector<size_t> by_completion(grouping.buckets.size());
  for (size_t b = 0; b < by_completion.size(); ++b) {
    by_completion[b] = b;
  }
  std::stable_sort(
      by_completion.begin(), by_completion.end(), [&grouping](size_t a, size_t b) {
        return grouping.last_visit[a] < grouping.last_visit[b];
      });
  std::vector<std::vector<size_t>> result;
  result.reserve(by_completion.size());
  for (size_t b : by_completion) {
    result.push_back(std::move(grouping.buckets[b]));
  }
  return result;
}

} // namespace ddp_ext::reducer
