#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>

namespace ddp_ext::reducer {

// Note [Sparse gradients]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// A parameter whose module produces sparse gradients (an Embedding or
// EmbeddingBag with sparse=True) has a bucket of its own with no flat
// buffer: when it is ready its gradient is divided by the number of ranks
// (a division, as torch's DDP does for sparse gradients, so the values are
// the same) and reduced by the process group's sparse allreduce, whose
// result becomes .grad. A rank that did not use the parameter contributes an
// empty sparse tensor. A communication hook gets, as with torch's DDP, a
// GradBucket whose buffer() is the sparse gradient, undivided, with no
// per-parameter offsets (gradients() is empty); the sparse tensor its future
// holds becomes .grad.

// Moving gradients between .grad and the buckets; the callers hold a
// NoGradGuard. `name` names the parameter in errors only.

// A sparse gradient of `param`'s shape with no entries (sparse along the
// first dimension, as an embedding's).
at::Tensor empty_sparse_like(const at::Tensor& param);

// What this rank reduces for a parameter with sparse gradients: `grad`
// divided by `ranks`, or an empty sparse gradient if it has none.
at::Tensor sparse_contribution(
    const at::Tensor& param, const at::Tensor& grad, int64_t ranks,
    const std::string& name);

// Fills `view` (a bucket slice) from the dense `grad` (undefined: zeros),
// multiplied by `factor` unless it is null (Note [Gradient averaging]). A
// `grad` that is `view` already is scaled in place.
void copy_into_view(
    const at::Tensor& grad, const at::Tensor& view, const at::Tensor* factor,
    const std::string& name);

// Writes the reduced `view` to `grad`, the .grad of `param`: points it at
// the view with `as_view` (gradient_as_bucket_view), else copies.
void write_back_view(
    const at::Tensor& view, const at::Tensor& param, at::Tensor& grad, bool as_view);

} // namespace ddp_ext::reducer
