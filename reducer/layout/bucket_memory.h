#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include <optional>
#include <string>
#include <vector>

#include "reducer/layout/bucket.h"

namespace ddp_ext::reducer {

// Note [Bucket memory]
// ~~~~~~~~~~~~~~~~~~~~
// Every bucket of one kind (device and bucket dtype) is a slice of one flat
// tensor of that kind, its arena; each bucket starts 64-byte aligned. An
// arena holds all parameters of its kind plus the alignment padding of the
// most buckets that kind can have (one per parameter), so any layout of the
// same parameters fits in it. A rebuild (Note [Gradient order prediction])
// therefore re-slices the arenas it already has instead of allocating:
// between iterations the buckets hold nothing that must survive. With
// gradient_as_bucket_view the buckets hold the .grad values, and a .grad
// tensor the user kept from before the rebuild would alias another
// parameter's slice of a re-sliced arena, so that rebuild lays the buckets out
// over new arenas and moves the values; the old arenas are freed once
// nothing refers to them.

// What laying out buckets needs to know about the parameters.
struct LayoutInputs {
  const std::vector<at::Tensor>& params;
  const std::vector<std::string>& names; // for error messages
  const std::vector<bool>& sparse; // sparse[i]: own bucket, no flat; empty: none
  std::optional<c10::ScalarType> reduce_dtype; // unset: the parameters' dtype
  bool gradient_as_bucket_view = false; // views must have the params' dtype
  // Each bucket with memory of its own, released (Note [Sharded buckets]).
  bool separate = false;
};

// Buckets holding `indices` (parameter indices per bucket, in launch order),
// their flat buffers sliced from `arenas`. An arena of the right kind and
// size in `arenas` is reused (its contents are not preserved); for a kind
// with none, a zeroed arena is allocated and appended. Checks that every
// bucket holds parameters of one kind that require grad, each parameter in
// at most one bucket.
std::vector<Bucket> lay_out_buckets(
    const LayoutInputs& inputs,
    const std::vector<std::vector<size_t>>& indices,
    std::vector<at::Tensor>& arenas);

// Note [Released bucket memory]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A separate bucket (LayoutInputs::separate) owns its storage, which can be
// released (its bytes freed, its size set to 0) and grown again without
// touching `flat` or its views: they keep their sizes and point at the
// storage, whose memory is read afresh at every use, as FSDP does with
// its parameters. Grown again, the memory holds garbage until the bucket's
// gradients are copied in (every element of a bucket belongs to a view).
void release_bucket_memory(Bucket& bucket);
void regrow_bucket_memory(Bucket& bucket);
// The bytes `flat`'s storage holds now (0 when released).
size_t bucket_memory_bytes(const Bucket& bucket);

// Whether `grad` is exactly `view` (same memory, shape and strides), not
// merely another slice of the same arena.
bool is_bucket_view(const at::Tensor& grad, const at::Tensor& view);

} // namespace ddp_ext::reducer
