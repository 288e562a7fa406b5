#include "reducer/layout/bucket_memory.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <limits>

namespace ddp_ext::reducer {

namespace {

constexpr int64_t kBucketAlignmentBytes = 64;
constexpr size_t kNoBucket = std::numeric_limits<size_t>::max();

// The parameters of one kind and the arena they are laid out in.
struct Kind {
  c10::Device device;
  c10::ScalarType dtype;
  int64_t capacity = 0; // elements an arena of this kind needs
  size_t arena = 0; // index into the arenas
  int64_t cursor = 0; // next free element of the arena
};

int64_t alignment_elements(c10::ScalarType dtype) {
  return std::max<int64_t>(1, kBucketAlignmentBytes / c10::elementSize(dtype));
}

// The slice of `flat` starting at `offset` elements, strided like `param`
// when that is possible, so that a .grad pointing at it keeps the parameter's
// memory layout.
at::Tensor view_for(const at::Tensor& flat, int64_t offset, const at::Tensor& param) {
  if (param.is_non_overlapping_and_dense()) {
    return flat.as_strided(
        param.sizes(), param.strides(), flat.storage_offset() + offset);
  }
  return flat.narrow(0, offset, param.numel()).view(param.sizes());
}

Kind& kind_of(std::vector<Kind>& kinds, c10::Device device, c10::ScalarType dtype) {
  for (auto& kind : kinds) {
    if (kind.device == device && kind.dtype == dtype) {
      return kind;
    }
  }
  kinds.push_back(Kind{device, dtype});
  return kinds.back();
}

} // namespace

void release_bucket_memory(Bucket& bucket) {
  if (bucket.released || !bucket.flat.defined()) {
    return;
  }
  c10::StorageImpl* storage = bucket.flat.storage().unsafeGetStorageImpl();
  TORCH_INTERNAL_ASSERT(
      bucket.flat.storage_offset() == 0 && storage->nbytes() == bucket.flat.nbytes(),
      "only a separate bucket's memory can be released");
  storage->set_data_ptr_noswap(at::DataPtr(nullptr, bucket.flat.device()));
  storage->set_nbytes(0);
  bucket.released = true;
}

void regrow_bucket_memory(Bucket& bucket) {
  if (!bucket.released) {
    return;
  }
  c10::StorageImpl* storage = bucket.flat.storage().unsafeGetStorageImpl();
  const size_t bytes = bucket.flat.nbytes();
  storage->set_data_ptr_noswap(storage->allocator()->allocate(bytes));
  storage->set_nbytes(bytes);
  bucket.released = false;
}

size_t bucket_memory_bytes(const Bucket& bucket) {
  return bucket.flat.defined() ? bucket.flat.storage().nbytes() : 0;
}

bool is_bucket_view(const at::Tensor& grad, const at::Tensor& view) {
  return grad.is_alias_of(view) && grad.storage_offset() == view.storage_offset() &&
      grad.sizes() == view.sizes() && grad.strides() == view.strides();
}

std::vector<Bucket> lay_out_buckets(
    const LayoutInputs& inputs,
    const std::vector<std::vector<size_t>>& indices,
    std::vector<at::Tensor>& arenas) {
  const auto& params = inputs.params;
  const auto& names = inputs.names;
  const size_t n = params.size();
  const auto is_sparse = [&inputs](size_t index) {
    return !inputs.sparse.empty() && inputs.sparse.at(index);
  };
  const auto bucket_dtype = [&inputs](const at::Tensor& param) {
    return inputs.reduce_dtype.value_or(param.scalar_type());
  };

  // Check every bucket, and size the arena of each kind.
  std::vector<size_t> bucket_of(n, kNoBucket);
  std::vector<Kind> kinds;
  for (size_t b = 0; b < indices.size(); ++b) {
    const auto& members = indices[b];
    TORCH_CHECK(!members.empty(), "Reducer got an empty bucket");
    TORCH_CHECK(members.front() < n, "bucket holds parameter index ",
                members.front(), " but there are only ", n, " parameters");
    const at::Tensor& first = params[members.front()];
    const bool sparse = is_sparse(members.front());
    TORCH_CHECK(
        !sparse || members.size() == 1, "parameter ", names[members.front()],
        " has sparse gradients and must have a bucket of its own");
    for (size_t index : members) {
      TORCH_CHECK(index < n, "bucket holds parameter index ", index,
                  " but there are only ", n, " parameters");
      TORCH_CHECK(bucket_of[index] == kNoBucket, "parameter ", names[index],
                  " is in two buckets");
      bucket_of[index] = b;
      const at::Tensor& param = params[index];
      TORCH_CHECK(param.is_leaf() && param.requires_grad(), "parameter ",
                  names[index], " must be a leaf that requires grad");
      TORCH_CHECK(
          param.scalar_type() == first.scalar_type() &&
              param.device() == first.device(),
          "bucket mixes ", first.scalar_type(), " on ", first.device(),
          " with parameter ", names[index], " (", param.scalar_type(), " on ",
          param.device(), ")");
      TORCH_CHECK(
          !inputs.gradient_as_bucket_view ||
              bucket_dtype(param) == param.scalar_type(),
          "gradient_as_bucket_view needs buckets of the parameters' dtype, but "
          "parameter ", names[index], " is ", param.scalar_type(),
          " and its bucket ", bucket_dtype(param), " (a reduce dtype of mixed "
          "precision); turn one of them off");
      if (!sparse) {
        const c10::ScalarType dtype = bucket_dtype(param);
        kind_of(kinds, param.device(), dtype).capacity +=
            param.numel() + alignment_elements(dtype) - 1;
      }
    }
  }

  // Reuse an arena of each kind if one is large enough, else allocate one.
  for (auto& kind : kinds) {
    if (inputs.separate) {
      break; // no arena: each bucket gets its own memory
    }
    auto found = std::find_if(arenas.begin(), arenas.end(), [&kind](const at::Tensor& a) {
      return a.device() == kind.device && a.scalar_type() == kind.dtype &&
          a.numel() >= kind.capacity;
    });
    if (found == arenas.end()) {
      arenas.push_back(at::zeros(
          {kind.capacity}, at::TensorOptions(kind.dtype).device(kind.device)));
      found = std::prev(arenas.end());
    }
    kind.arena = static_cast<size_t>(found - arenas.begin());
  }

  at::NoGradGuard no_grad;
  std::vector<Bucket> buckets;
  buckets.reserve(indices.size());
  for (const auto& members : indices) {
    const at::Tensor& first = params[members.front()];
    Bucket bucket;
    bucket.sparse = is_sparse(members.front());
    bucket.param_indices = members;
    if (bucket.sparse) {
      // See Note [Sparse gradients]: no flat buffer, no views.
      bucket.params.push_back(first);
      buckets.push_back(std::move(bucket));
      continue;
    }
    const c10::ScalarType dtype = bucket_dtype(first);
    Kind& kind = kind_of(kinds, first.device(), dtype);
    const int64_t align = alignment_elements(dtype);
    kind.cursor = (kind.cursor + align - 1) / align * align;
    int64_t numel = 0;
    for (size_t index : members) {
      numel += params[index].numel();
    }
    if (inputs.separate) {
      bucket.flat = at::empty({numel}, at::TensorOptions(dtype).device(first.device()));
    } else {
      bucket.flat = arenas[kind.arena].narrow(0, kind.cursor, numel);
      kind.cursor += numel;
    }
    int64_t offset = 0;
    for (size_t index : members) {
      const at::Tensor& param = params[index];
      bucket.offsets.push_back(static_cast<size_t>(offset));
      bucket.lengths.push_back(static_cast<size_t>(param.numel()));
      bucket.sizes.push_back(param.sizes());
      bucket.params.push_back(param);
      bucket.views.push_back(view_for(bucket.flat, offset, param));
      offset += param.numel();
    }
    if (inputs.separate) {
      release_bucket_memory(bucket); // grown when its first gradient arrives
    }
    buckets.push_back(std::move(bucket));
  }
  return buckets;
}

} // namespace ddp_ext::reducer
