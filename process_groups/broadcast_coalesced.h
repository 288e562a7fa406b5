#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <cstdint>
#include <vector>

namespace ddp_ext::reducer {

// Overwrites `tensors` on every rank with their values on rank `root`.
//
// Tensors are packed into flat chunks of at most `chunk_bytes` (one device and
// dtype per chunk, grouped as assign_buckets groups gradients), so the cost is
// one collective per chunk rather than one per tensor. All chunks are launched
// before any is awaited. Every rank must pass tensors of the same shapes,
// dtypes and devices in the same order.
void broadcast_coalesced(
    const c10::intrusive_ptr<c10d::ProcessGroup>& process_group,
    const std::vector<at::Tensor>& tensors,
    int64_t chunk_bytes,
    int root);

} // namespace ddp_ext::reducer
