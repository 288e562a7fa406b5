#include "reducer/transport/bucket_transport.h"

#include <optional>
#include <utility>

namespace ddp_ext::reducer {

c10d::GradBucket grad_bucket_of(
    const Bucket& bucket, size_t index, size_t count, at::Tensor buffer) {
  return c10d::GradBucket(
      index, count, std::move(buffer), bucket.offsets, bucket.lengths, bucket.sizes,
      bucket.params, std::nullopt);
}

bool torch_backend(const c10d::ProcessGroup& group) {
  using Type = c10d::ProcessGroup::BackendType;
  switch (group.getBackendType()) {
    case Type::GLOO:
    case Type::NCCL:
    case Type::UCC:
    case Type::MPI:
    case Type::XCCL:
      return true;
    default:
      return false;
  }
}

} // namespace ddp_ext::reducer
