#include "process_groups/broadcast_coalesced.h"

#include <ATen/ATen.h>

#include "reducer/layout/bucket_assignment.h"

namespace ddp_ext::reducer {

namespace {

struct Chunk {
  std::vector<at::Tensor> members;
  at::Tensor flat; // what travels; aliases members[0] when it is alone
  c10::intrusive_ptr<c10d::Work> work;
};

} // namespace

void broadcast_coalesced(
    const c10::intrusive_ptr<c10d::ProcessGroup>& process_group,
    const std::vector<at::Tensor>& tensors,
    int64_t chunk_bytes,
    int root) {
  if (tensors.empty()) {
    return;
  }
  at::NoGradGuard no_grad;
  std::vector<TensorSpec> specs;
  specs.reserve(tensors.size());
  for (const auto& t : tensors) {
    specs.push_back(TensorSpec{
        static_cast<int64_t>(t.numel() * t.element_size()), t.scalar_type(),
        t.device()});
  }
  std::vector<Chunk> chunks;
  for (const auto& indices : assign_buckets(specs, chunk_bytes, chunk_bytes)) {
    Chunk chunk;
    for (size_t i : indices) {
      chunk.members.push_back(tensors[i].detach());
    }
    if (chunk.members.size() == 1 && chunk.members[0].is_contiguous()) {
      chunk.flat = chunk.members[0];
    } else {
      std::vector<at::Tensor> flattened;
      flattened.reserve(chunk.members.size());
      for (const auto& t : chunk.members) {
        flattened.push_back(t.reshape({-1}));
      }
      chunk.flat = at::cat(flattened);
    }
    std::vector<at::Tensor> payload{chunk.flat};
    c10d::BroadcastOptions options;
    options.rootRank = root;
    chunk.work = process_group->broadcast(payload, options);
    chunks.push_back(std::move(chunk));
  }
  const bool receiving = process_group->getRank() != root;
  for (auto& chunk : chunks) {
    chunk.work->wait();
    if (!receiving || chunk.flat.is_same(chunk.members[0])) {
      continue;
    }
    int64_t offset = 0;
    for (auto& t : chunk.members) {
      t.copy_(chunk.flat.narrow(0, offset, t.numel()).view(t.sizes()));
      offset += t.numel();
    }
  }
}

} // namespace ddp_ext::reducer
