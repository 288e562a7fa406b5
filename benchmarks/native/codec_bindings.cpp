// The benchmarks' own binding of the 8-bit codec (comm_hooks/compression/
// int8_codec.h), compiled with it by benchmarks/harness/product.py: the
// `compression` experiment times its steps one by one, which the shipped
// extension only runs inside the adaptive-precision hook.
#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>

#include <vector>

#include "comm_hooks/compression/int8_codec.h"

namespace py = pybind11;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace ddp_ext::compression;
  m.doc() = "ddp_ext's 8-bit codec, for the benchmarks; never shipped";
  m.def(
      "int8_encode",
      [](at::Tensor values, int64_t chunk) {
        at::Tensor payload = at::empty({int8_payload_bytes(values.numel(), chunk)},
                                       values.options().dtype(at::kByte));
        encode_int8(values, payload, chunk);
        return payload;
      },
      py::arg("values"), py::arg("chunk"), py::call_guard<py::gil_scoped_release>(),
      "Encodes values (1-D float32) in place of what the codes miss; returns the payload.");
  m.def(
      "int8_decode_sum",
      [](const std::vector<at::Tensor>& payloads, at::Tensor out, int64_t chunk) {
        decode_sum_int8(payloads, out, chunk);
      },
      py::arg("payloads"), py::arg("out"), py::arg("chunk"),
      py::call_guard<py::gil_scoped_release>());
}
