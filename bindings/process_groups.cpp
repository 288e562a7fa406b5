// Bindings of the c10d backends (round robin, hierarchical) and of the
// process-group helpers (the coalesced broadcast, the release at exit).

#include <pybind11/chrono.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include "bindings/bindings.h"
#include "process_groups/broadcast_coalesced.h"
#include "process_groups/exit_release.h"
#include "process_groups/hierarchical/backend.h"
#include "process_groups/round_robin/backend.h"

namespace ddp_ext::bindings {

void bind_process_groups(py::module& m) {
  using namespace ddp_ext::process_groups;
  m.def(
      "broadcast_coalesced", &ddp_ext::reducer::broadcast_coalesced, py::arg("process_group"),
      py::arg("tensors"), py::arg("chunk_bytes"), py::arg("root") = 0, NoGil());

  // See Note [Exit after training] in ddp_ext/_exit.py.
  m.def("release_process_groups", &ddp_ext::release_process_groups, py::arg("groups"),
        py::arg("timeout"), NoGil());

  // The c10d base classes must be registered with pybind11 before classes
  // deriving from them are.
  py::module::import("torch.distributed");

  py::class_<RoundRobinBackendOptions>(m, "RoundRobinBackendOptions")
      .def(py::init<>())
      .def_readwrite("owns_children", &RoundRobinBackendOptions::owns_children)
      .def_readwrite("timeout", &RoundRobinBackendOptions::timeout);

  py::class_<RoundRobinBackend, c10d::Backend, c10::intrusive_ptr<RoundRobinBackend>>(
      m, "RoundRobinBackend",
      "c10d Backend that sends each collective to the next of its child "
      "process groups in turn; see process_groups/round_robin/backend.h.")
      .def(py::init<std::vector<ProcessGroupPtr>, RoundRobinBackendOptions>(),
           py::arg("children"), py::arg("options") = RoundRobinBackendOptions())
      .def_property_readonly("children", &RoundRobinBackend::children)
      .def_property_readonly("next_child_index", &RoundRobinBackend::next_child_index)
      .def_property_readonly("forwarded_calls", &RoundRobinBackend::forwarded_calls)
      .def_property_readonly(
          "owns_children",
          [](const RoundRobinBackend& b) { return b.options().owns_children; })
      .def_property_readonly(
          "timeout", [](const RoundRobinBackend& b) { return b.options().timeout; });

  using ddp_ext::hierarchical::HierarchicalBackend;
  using ddp_ext::hierarchical::HierarchicalGroups;
  py::class_<HierarchicalBackend, c10d::Backend, c10::intrusive_ptr<HierarchicalBackend>>(
      m, "HierarchicalBackend",
      "c10d Backend whose allreduce runs inside each host, across hosts, and inside "
      "again, and whose all-gather runs across hosts, then inside; see "
      "process_groups/hierarchical/backend.h.")
      .def(py::init([](ProcessGroupPtr flat, ProcessGroupPtr intra, ProcessGroupPtr inter,
                       ProcessGroupPtr intra_gather, ProcessGroupPtr gather_across,
                       ProcessGroupPtr gather_inside) {
             return c10::make_intrusive<HierarchicalBackend>(HierarchicalGroups{
                 std::move(flat), std::move(intra), std::move(inter), std::move(intra_gather),
                 std::move(gather_across), std::move(gather_inside)});
           }),
           py::arg("flat"), py::arg("intra"), py::arg("inter"), py::arg("intra_gather"),
           py::arg("gather_across") = ProcessGroupPtr(), py::arg("gather_inside") = ProcessGroupPtr())
      .def_property_readonly("hierarchical_calls", &HierarchicalBackend::hierarchical_calls)
      .def_property_readonly("hierarchical_gathers", &HierarchicalBackend::hierarchical_gathers);
}

} // namespace ddp_ext::bindings
