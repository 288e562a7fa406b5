#include "comm_hooks/compression/residuals.h"

#include <ATen/ATen.h>

#include <utility>

namespace ddp_ext::compression {

at::Tensor& Residuals::of(size_t index, const std::vector<at::Tensor>& params,
                          const at::Tensor& like) {
  Entry& entry = entry_for(index, params, like);
  if (!entry.values.defined()) {
    entry.values = at::zeros({like.numel()}, like.options().dtype(at::kFloat));
  }
  return entry.values;
}

at::Tensor Residuals::take(size_t index, const std::vector<at::Tensor>& params,
                           const at::Tensor& like) {
  if (index >= entries_.size() && orphans_.empty()) {
    return at::Tensor();
  }
  return std::exchange(entry_for(index, params, like).values, at::Tensor());
}

Residuals::Entry& Residuals::entry_for(size_t index, const std::vector<at::Tensor>& params,
                                       const at::Tensor& like) {
  if (entries_.size() <= index) {
    entries_.resize(index + 1);
  }
  std::vector<const void*> signature;
  std::vector<int64_t> numels;
  int64_t total = 0;
  for (const at::Tensor& param : params) {
    signature.push_back(param.unsafeGetTensorImpl());
    numels.push_back(param.numel());
    total += param.numel();
  }
  if (total != like.numel()) {
    // Not a plain concatenation of its parameters: keyed by size only.
    signature.clear();
    numels.assign(1, like.numel());
  }
  Entry& entry = entries_[index];
  bool current = entry.generation == generation_;
  if (current && (entry.params != signature || entry.numels != numels)) {
    // A new layout: every bucket's residual goes back to its parameters, and
    // each bucket takes its parameters' residuals when next sent.
    ++generation_;
    for (Entry& other : entries_) {
      release_to_orphans(other);
    }
    current = false;
  }
  if (!current) {
    entry.params = std::move(signature);
    entry.numels = std::move(numels);
    entry.generation = generation_;
    entry.values = adopt_orphans(params, like);
  }
  return entry;
}

at::Tensor Residuals::get(size_t index) const {
  return index < entries_.size() ? entries_[index].values : at::Tensor();
}

void Residuals::release_to_orphans(Entry& entry) {
  if (entry.values.defined() && !entry.params.empty()) {
    int64_t offset = 0;
    for (size_t p = 0; p < entry.params.size(); ++p) {
      orphans_[entry.params[p]] = entry.values.narrow(0, offset, entry.numels[p]);
      offset += entry.numels[p];
    }
  }
  entry.values = at::Tensor();
}

at::Tensor Residuals::adopt_orphans(const std::vector<at::Tensor>& params,
                                    const at::Tensor& like) {
  at::Tensor values;
  int64_t offset = 0;
  for (const at::Tensor& param : params) {
    auto found = orphans_.find(param.unsafeGetTensorImpl());
    if (found != orphans_.end()) {
      if (!values.defined()) {
        values = at::zeros({like.numel()}, like.options().dtype(at::kFloat));
      }
      values.narrow(0, offset, param.numel()).copy_(found->second);
      orphans_.erase(found);
    }
    offset += param.numel();
  }
  return values;
}

} // namespace ddp_ext::compression
