#include "comm_hooks/builtin_hooks.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <vector>

namespace ddp_ext::comm_hooks {

at::Tensor GroupCommHook::parseHookResult(const c10::IValue& result) {
  return c10d::detail::parseCppCommHookResult(result);
}

c10::intrusive_ptr<c10::ivalue::Future> AllreduceCommHook::runHook(
    c10d::GradBucket& bucket) {
  at::Tensor& buffer = bucket.getBufferRef();
  buffer.div_(group_->getSize());
  std::vector<at::Tensor> tensors{buffer};
  return group_->allreduce(tensors)->getFuture();
}

c10::intrusive_ptr<c10::ivalue::Future> Fp16CompressCommHook::runHook(
    c10d::GradBucket& bucket) {
  at::Tensor buffer = bucket.getBuffer();
  at::Tensor compressed = buffer.to(at::kHalf).div_(group_->getSize());
  std::vector<at::Tensor> tensors{compressed};
  auto reduced = group_->allreduce(tensors)->getFuture();
  return reduced->then(
      [buffer, compressed](c10::ivalue::Future& done) -> c10::IValue {
        TORCH_CHECK(!done.hasError(), done.tryRetrieveErrorMessage());
        buffer.copy_(compressed);
        return c10::IValue(buffer);
      },
      c10::TensorType::get());
}

std::shared_ptr<CommHook> make_builtin_comm_hook(
    int type, c10::intrusive_ptr<c10d::ProcessGroup> group) {
  switch (type) {
    case 1:
      return std::make_shared<AllreduceCommHook>(std::move(group));
    case 2:
      return std::make_shared<Fp16CompressCommHook>(std::move(group));
    default:
      TORCH_CHECK(false, "Unknown built-in DDP comm hook type ", type,
                  "; expected torch.distributed.BuiltinCommHookType.ALLREDUCE "
                  "or FP16_COMPRESS");
  }
}

} // namespace ddp_ext::comm_hooks
