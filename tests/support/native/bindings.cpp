// The test extension's Python entry point (see tests/support/native_extensions.py):
// bindings only, for the test doubles beside this file.

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/csrc/utils/pybind.h>

#include "recording_backend.h"

namespace py = pybind11;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace ddp_ext_tests;
  m.doc() = "ddp_ext's C++ test doubles; built by the tests, never shipped";

  py::class_<RecordedCall>(m, "RecordedCall")
      .def_readonly("method", &RecordedCall::method)
      .def_readonly("tensors", &RecordedCall::tensors)
      .def_readonly("options", &RecordedCall::options)
      .def("__repr__", [](const RecordedCall& c) {
        return "RecordedCall(" + c.method + ")";
      });

  py::class_<RecordingBackendOptions>(m, "RecordingBackendOptions")
      .def(py::init<>())
      .def_readwrite("complete_immediately", &RecordingBackendOptions::complete_immediately);

  py::class_<RecordingBackend, c10d::Backend, c10::intrusive_ptr<RecordingBackend>>(
      m, "RecordingBackend",
      "c10d Backend that communicates nothing and records every call.")
      .def(py::init<int, int, RecordingBackendOptions>(), py::arg("rank"),
           py::arg("size"), py::arg("options") = RecordingBackendOptions())
      .def("calls", &RecordingBackend::calls)
      .def("clear_calls", &RecordingBackend::clear_calls)
      .def("complete_pending", &RecordingBackend::complete_pending,
           py::call_guard<py::gil_scoped_release>());

  m.def(
      "accumulator_post_hook_count",
      [](const at::Tensor& param) -> size_t {
        const auto accumulator = torch::autograd::impl::try_get_grad_accumulator(param);
        return accumulator ? accumulator->post_hooks().size() : 0;
      },
      py::arg("param"),
      "Post hooks on the gradient accumulator of leaf tensor `param` (0 without "
      "one): what a reducer installs, one per parameter.");
}
