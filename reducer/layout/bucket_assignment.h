#pragma once

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include <cstddef>
#include <cstdint>
#include <vector>

namespace ddp_ext::reducer {

// What bucket assignment needs to know about one tensor.
struct TensorSpec {
  int64_t nbytes = 0; // bytes the tensor occupies in a bucket
  c10::ScalarType dtype = c10::ScalarType::Float;
  c10::Device device = c10::Device(c10::DeviceType::CPU);
  bool sparse = false; // its gradients are sparse: a bucket of its own
  // The droppable layer it belongs to, or -1 (Note [Layer dropping] in
  // reducer/participation/layer_drop.h): tensors of different units never share a bucket.
  int64_t unit = -1;
};

// Groups tensors into buckets for collective communication.
//
// Tensors are visited in reverse order (the order their gradients are
// expected to become ready, see Note [Overlap and bucket order]). Each
// (device, dtype) pair has one open bucket; a tensor joins the open bucket of
// its kind, and a bucket is closed as soon as its bytes reach its cap, so a
// bucket holds at least its cap's worth of bytes (all but the last of each
// kind) and overshoots it by less than one tensor. This is torch's rule, so
// the same caps and order give torch's buckets. A tensor of another droppable
// layer than the open bucket's tensors (see TensorSpec::unit) also closes it.
// The first bucket of each kind is capped at `first_cap_bytes`, the others
// at `cap_bytes`: a small first bucket starts communicating early in the
// backward pass. Every sparse tensor gets a bucket of its own.
// Buckets never mix devices or dtypes.
//
// Returns the buckets in the order they were opened, each as the indices of
// its tensors in the order they are laid out in the bucket. Pure: the same
// input gives the same output on every rank.
std::vector<std::vector<size_t>> assign_buckets(
    const std::vector<TensorSpec>& tensors,
    int64_t cap_bytes,
    int64_t first_cap_bytes);

// The same with a cap per bucket: the k-th bucket of each kind is capped at
// caps[k], and every bucket past the end of `caps` at its last entry (so
// {first, cap} is the two-cap form above, and {cap} one cap for all).
std::vector<std::vector<size_t>> assign_buckets(
    const std::vector<TensorSpec>& tensors,
    const std::vector<int64_t>& caps);

// Note [torch's first buckets]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// torch's DDP cuts its first buckets otherwise than assign_buckets does: it
// visits the parameters in registration order (same closing rule, kinds and
// caps per kind), lists the buckets by their first parameter and reverses
// the list. So the last-registered parameters' bucket launches first, each
// bucket holds its parameters in registration order, and the bucket with the
// first cap is the one launched last. Its caps for that layout (see
// first_layout_caps in ddp_ext/_arguments.py): bucket_cap_mb_list if given;
// else, with find_unused_parameters and no static_graph (whose buckets torch
// never rebuilds), the construction caps; else one unlimited cap, one bucket
// per kind, until the first rebuild.
//
// Why ddp_ext cuts the same buckets: with more than two ranks the sum a ring
// allreduce (Gloo's) gives an element depends on the order it adds the
// ranks' values, and that order on the bucket's size and the element's
// offset in it (the ring splits the bucket into chunks by size). Other cuts
// or offsets round differently in the last bits; the same ones give torch's
// bits from the first iteration on.
//
// Buckets as torch's DDP cuts its first ones: as described in the Note
// (caps per kind as in assign_buckets, droppable layers kept apart), in
// launch order, each bucket's tensors in registration order. Pure.
std::vector<std::vector<size_t>> assign_buckets_as_torch_first(
    const std::vector<TensorSpec>& tensors,
    const std::vector<int64_t>& caps);

// Bucket assignment for an observed gradient order (a rebuild, see Note
// [Gradient order prediction]): tensors are visited in `order` (a
// permutation of their indices, first-ready first) and grouped with the
// same rules and caps as above. Buckets are returned in the order their last
// tensor becomes ready, so that each can launch as soon as it is full. Pure.
std::vector<std::vector<size_t>> assign_buckets_in_order(
    const std::vector<TensorSpec>& tensors,
    const std::vector<size_t>& order,
    const std::vector<int64_t>& caps);

} // namespace ddp_ext::reducer
