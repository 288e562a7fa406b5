// The MPI backend's Python entry point (module ddp_ext._mpi): bindings only.
// Built only where MPI is found; see ddp_ext/_mpi_build.py.

#include <pybind11/chrono.h>
#include <pybind11/stl.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/utils/pybind.h>
#include <torch/version.h>

#include "process_groups/mpi/backend.h"
#include "process_groups/mpi/rendezvous.h"
#include "process_groups/mpi/runtime.h"

namespace py = pybind11;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace ddp_ext::process_groups::mpi;
  using NoGil = py::call_guard<py::gil_scoped_release>;
  m.doc() = "ddp_ext's MPI c10d backend; see process_groups/mpi/backend.h";
  m.attr("torch_version") = py::str(
      std::to_string(TORCH_VERSION_MAJOR) + "." +
      std::to_string(TORCH_VERSION_MINOR));
  // c10d's Backend must be registered with pybind11 before MpiBackend is.
  py::module::import("torch.distributed");

  m.def("ensure_initialized", &ensure_initialized, NoGil());
  m.def("finalize", &finalize, NoGil());
  m.def("should_finalize", &should_finalize, NoGil());
  m.def("world_rank", &world_rank, NoGil());
  m.def("world_size", &world_size, NoGil());
  m.def("library_version", &library_version);
  m.def("broadcast_from_rank0",
        [](const std::string& text, std::chrono::milliseconds timeout) {
          std::string shared;
          {
            py::gil_scoped_release no_gil;
            shared = broadcast_from_rank0(text, timeout);
          }
          return py::bytes(shared);
        },
        py::arg("text"), py::arg("timeout"));

  py::class_<MpiBackendOptions>(m, "MpiBackendOptions")
      .def(py::init<>())
      .def_readwrite("timeout", &MpiBackendOptions::timeout)
      .def_readwrite("group_name", &MpiBackendOptions::group_name);

  py::class_<MpiBackend, c10d::Backend, c10::intrusive_ptr<MpiBackend>>(
      m, "MpiBackend",
      "c10d Backend over MPI; see process_groups/mpi/backend.h.")
      .def_static(
          "world",
          [](MpiBackendOptions options) {
            return c10::make_intrusive<MpiBackend>(Communicator::world(),
                                                   std::move(options));
          },
          py::arg("options") = MpiBackendOptions(), NoGil(),
          "A group of every MPI process; all of them must call it.")
      .def_static(
          "of_world_ranks",
          [](const std::vector<int64_t>& ranks, MpiBackendOptions options) {
            return c10::make_intrusive<MpiBackend>(
                Communicator::of_world_ranks(ranks), std::move(options));
          },
          py::arg("world_ranks"), py::arg("options") = MpiBackendOptions(),
          NoGil(), "A group of these MPI_COMM_WORLD ranks; they all call it.")
      .def_property_readonly("broken", &MpiBackend::broken)
      .def_property_readonly(
          "timeout", [](const MpiBackend& b) { return b.options().timeout; })
      .def("shutdown", &MpiBackend::shutdown, NoGil());
}
