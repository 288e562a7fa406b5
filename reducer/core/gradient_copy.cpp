#include "reducer/core/gradient_copy.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <vector>

#include "reducer/layout/bucket_memory.h"

namespace ddp_ext::reducer {

at::Tensor empty_sparse_like(const at::Tensor& param) {
  std::vector<int64_t> value_sizes = param.sizes().vec();
  value_sizes[0] = 0;
  return at::sparse_coo_tensor(
      at::empty({1, 0}, param.options().dtype(at::kLong)),
      at::empty(value_sizes, param.options()), param.sizes());
}

at::Tensor sparse_contribution(
    const at::Tensor& param, const at::Tensor& grad, int64_t ranks,
    const std::string& name) {
  if (!grad.defined()) {
    return empty_sparse_like(param);
  }
  TORCH_CHECK(
      grad.is_sparse(), "parameter ", name, " was expected to "
      "get a sparse gradient (its module produces them) but got a dense one");
  return grad.div(ranks);
}

void copy_into_view(
    const at::Tensor& grad, const at::Tensor& view, const at::Tensor* factor,
    const std::string& name) {
  if (!grad.defined()) {
    view.zero_();
    return;
  }
  TORCH_CHECK(!grad.is_sparse(), "parameter ", name,
              " has a sparse gradient; ddp_ext reduces dense gradients only");
  if (is_bucket_view(grad, view)) {
    if (factor != nullptr) {
      view.mul_(*factor);
    }
  } else if (factor != nullptr) {
    at::Tensor out = view;
    at::mul_out(out, grad, *factor);
  } else {
    view.copy_(grad);
  }
}

void write_back_view(
    const at::Tensor& view, const at::Tensor& param, at::Tensor& grad, bool as_view) {
  if (as_view) {
    if (!grad.defined() || !is_bucket_view(grad, view)) {
      grad = view;
    }
  } else if (!grad.defined()) {
    grad = at::empty_like(param);
    grad.copy_(view);
  } else {
    grad.copy_(view);
  }
}

} // namespace ddp_ext::reducer
