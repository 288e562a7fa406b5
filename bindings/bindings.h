#pragma once

// What the binding files share. The bindings are the only files that
// include pybind11 or Python headers; each binds one concept, and
// bindings/module.cpp, the module's entry point, calls them in turn.

#include <pybind11/pybind11.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/jit/python/pybind_utils.h>

#include <memory>

namespace ddp_ext::bindings {

namespace py = pybind11;

using ProcessGroupPtr = c10::intrusive_ptr<c10d::ProcessGroup>;
using FuturePtr = std::shared_ptr<torch::jit::PythonFutureWrapper>;
// Releases the GIL for the call: see Note [Windows without the lock] in
// reducer/core/state_lock.cpp.
using NoGil = py::call_guard<py::gil_scoped_release>;

// The Reducer, its options and its hang handler (bindings/reducer.cpp).
void bind_reducer(py::module& m);
// The adaptive-precision hook's state and policy (bindings/compression.cpp).
void bind_compression(py::module& m);
// CommHook and the functions that make one (bindings/comm_hooks.cpp).
void bind_comm_hooks(py::module& m);
// The c10d backends and the process-group helpers (bindings/process_groups.cpp).
void bind_process_groups(py::module& m);

} // namespace ddp_ext::bindings
