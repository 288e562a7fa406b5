// Bindings of communication hooks: the CommHook a Reducer runs, and the
// functions that make one; see comm_hooks/comm_hook.h.

#include <torch/csrc/distributed/c10d/default_comm_hooks.hpp>
#include <torch/csrc/distributed/c10d/python_comm_hook.h>
#include <torch/csrc/utils/pybind.h>

#include "bindings/bindings.h"
#include "comm_hooks/builtin_hooks.h"
#include "comm_hooks/compression/adaptive_precision.h"

namespace ddp_ext::bindings {

// The one binding entry for hooks: ddp_ext/_comm_hooks.py builds a CommHook
// with one of these and hands it to Reducer._register_comm_hook.
void bind_comm_hooks(py::module& m) {
  using namespace ddp_ext::comm_hooks;

  py::class_<CommHook, std::shared_ptr<CommHook>>(
      m, "CommHook", "A communication hook for a Reducer; see comm_hooks/comm_hook.h.")
      .def_property_readonly("keeps_per_bucket_state", &CommHook::keeps_per_bucket_state);
  m.def(
      "python_comm_hook",
      [](py::object state, py::object hook) -> std::shared_ptr<CommHook> {
        return std::make_shared<TorchContractHook>(
            std::make_unique<c10d::PythonCommHook>(std::move(state), std::move(hook)));
      },
      py::arg("state"), py::arg("hook"));
  m.def(
      "builtin_comm_hook",
      [](c10d::BuiltinCommHookType type, ProcessGroupPtr group) {
        return make_builtin_comm_hook(static_cast<int>(type), std::move(group));
      },
      py::arg("comm_hook_type"), py::arg("process_group"), NoGil());
  m.def(
      "adaptive_precision_comm_hook",
      [](std::shared_ptr<ddp_ext::compression::AdaptivePrecision> state)
          -> std::shared_ptr<CommHook> {
        return std::make_shared<ddp_ext::compression::AdaptivePrecisionCommHook>(
            std::move(state));
      },
      py::arg("state"), NoGil());
}

} // namespace ddp_ext::bindings
