// The extension's Python entry point: bindings only, no logic.
// Every other file is plain C++ and includes no pybind11 or Python header.

#include <pybind11/chrono.h>
#include <pybind11/stl.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/default_comm_hooks.hpp>
#include <torch/csrc/distributed/c10d/python_comm_hook.h>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/version.h>

#include "comm_hooks/compression/adaptive_precision.h"
#include "comm_hooks/compression/int8_exchange.h"
#include "process_groups/hierarchical/backend.h"
#include "process_groups/round_robin/backend.h"

#include "process_groups/broadcast_coalesced.h"
#include "process_groups/exit_release.h"
#include "comm_hooks/builtin_hooks.h"
#include "reducer/gradient_order.h"
#include "reducer/reducer.h"

namespace py = pybind11;

namespace {

using ProcessGroupPtr = c10::intrusive_ptr<c10d::ProcessGroup>;
using FuturePtr = std::shared_ptr<torch::jit::PythonFutureWrapper>;
using NoGil = py::call_guard<py::gil_scoped_release>;

// Deletes an object that may hold the last reference to a process group
// with the GIL released: a Gloo group's destructor joins its worker
// threads, and a worker may need the GIL to release its last collective
// (a deadlock if this thread held it). Not once the interpreter is
// finalizing (it must keep the GIL then). See Note [Exit after training]
// in ddp_ext/_exit.py.
struct DeleteWithoutGil {
  template <typename T>
  void operator()(T* object) const {
    if (Py_IsInitialized() && PyGILState_Check()) {
      py::gil_scoped_release no_gil;
      delete object;
    } else {
      delete object;
    }
  }
};

// A property getter that releases the GIL (def_property takes no call_guard).
template <typename T>
auto without_gil(T (ddp_ext::reducer::Reducer::*getter)() const) {
  return [getter](const ddp_ext::reducer::Reducer& r) {
    py::gil_scoped_release no_gil;
    return (r.*getter)();
  };
}

// A getter of the bucket layout, read under the reducer's lock without the GIL.
template <typename Read>
auto layout_reader(Read read) {
  return [read](const ddp_ext::reducer::Reducer& r) {
    py::gil_scoped_release no_gil;
    return r.read_layout(read);
  };
}

// A figure of the last observed backward, unset before one finished.
std::optional<double> observed(const ddp_ext::reducer::BucketLayout& l, double figure) {
  if (l.order().observed_iterations() == 0) {
    return std::nullopt;
  }
  return figure;
}

// See Note [Hang attribution]: a StallReport as the dict the Python
// handler (ddp_ext/_diagnosis/) reads.
py::dict stall_report_dict(const ddp_ext::reducer::StallReport& report) {
  py::dict d;
  d["kind"] = ddp_ext::reducer::stall_kind_name(report.event.kind);
  d["waiting_for"] = report.event.waiting_for;
  d["bucket"] = report.event.bucket;
  d["waited_s"] = report.event.waited_s;
  d["error"] = report.event.error;
  d["rank"] = report.rank;
  d["step"] = report.step;
  d["training_steps"] = report.training_steps;
  d["phase"] = report.phase;
  d["buckets_launched"] = report.buckets_launched;
  d["buckets_total"] = report.buckets_total;
  d["unready"] = report.unready;
  d["unready_buckets"] = report.unready_buckets;
  return d;
}

// Calls `handler(report_dict)` under the GIL; a str it returns is raised
// from the reducer's wait. An exception inside the handler is reported as
// unraisable: diagnosis never breaks training.
std::function<void(const ddp_ext::reducer::StallReport&)> stall_handler(py::function handler) {
  std::shared_ptr<py::function> fn(new py::function(std::move(handler)), [](py::function* f) {
    if (Py_IsInitialized()) {
      py::gil_scoped_acquire gil;
      delete f;
    }
  });
  return [fn](const ddp_ext::reducer::StallReport& report) {
    std::optional<std::string> message;
    {
      py::gil_scoped_acquire gil;
      try {
        py::object result = (*fn)(stall_report_dict(report));
        if (!result.is_none()) {
          message = result.cast<std::string>();
        }
      } catch (py::error_already_set& error) {
        error.discard_as_unraisable("ddp_ext's hang diagnosis");
      }
    }
    TORCH_CHECK(!message, *message);
  };
}

void bind_reducer(py::module& m) {
  using namespace ddp_ext::reducer;

  m.def(
      "broadcast_coalesced", &broadcast_coalesced, py::arg("process_group"),
      py::arg("tensors"), py::arg("chunk_bytes"), py::arg("root") = 0,
      py::call_guard<py::gil_scoped_release>());

  // See Note [Exit after training] in ddp_ext/_exit.py.
  m.def("release_process_groups", &ddp_ext::release_process_groups, py::arg("groups"),
        py::arg("timeout"), NoGil());

  py::enum_<BucketRebuild>(m, "BucketRebuild")
      .value("never", BucketRebuild::kNever)
      .value("once", BucketRebuild::kOnce)
      .value("continuous", BucketRebuild::kContinuous);

  py::class_<ReducerOptions>(m, "ReducerOptions")
      .def(py::init<>())
      .def_readwrite("find_unused_parameters", &ReducerOptions::find_unused_parameters)
      .def_readwrite("gradient_as_bucket_view", &ReducerOptions::gradient_as_bucket_view)
      .def_readwrite("overlap_with_backward", &ReducerOptions::overlap_with_backward)
      .def_readwrite("static_graph", &ReducerOptions::static_graph)
      .def_readwrite("skip_all_reduce_unused_params",
                     &ReducerOptions::skip_all_reduce_unused_params)
      .def_readwrite("batched_grad_copy", &ReducerOptions::batched_grad_copy)
      .def_readwrite("buffers_broadcast", &ReducerOptions::buffers_broadcast)
      .def_readwrite("reduce_dtype", &ReducerOptions::reduce_dtype)
      .def_readwrite("rebuild_buckets", &ReducerOptions::rebuild_buckets)
      .def_readwrite("bucket_caps", &ReducerOptions::bucket_caps)
      .def_readwrite("layer_units", &ReducerOptions::layer_units);

  // Methods with a leading underscore carry the names of torch's
  // torch._C._distributed_c10d.Reducer, which frameworks call.
  py::class_<Reducer, std::shared_ptr<Reducer>>(m, "Reducer")
      .def(
          py::init([](std::vector<at::Tensor> params, std::vector<std::string> names,
                      ProcessGroupPtr group, ReducerOptions options,
                      const std::vector<bool>& sparse) {
            return std::shared_ptr<Reducer>(
                new Reducer(std::move(params), std::move(names), std::move(group),
                            std::move(options), sparse),
                DeleteWithoutGil{});
          }),
          py::arg("params"), py::arg("param_names"),
          py::arg("process_group"), py::arg("options"),
          py::arg("sparse_gradients") = std::vector<bool>{}, NoGil())
      .def("prepare_for_forward", &Reducer::prepare_for_forward,
           py::arg("training_step") = false, NoGil())
      .def("_match_step_check_as_joined", &Reducer::match_step_check_as_joined, NoGil())
      .def("_check_step_before_forward_collectives",
           &Reducer::check_step_before_forward_collectives, NoGil())
      .def_property_readonly("training_steps", without_gil(&Reducer::training_steps))
      .def("prepare_for_backward", &Reducer::prepare_for_backward,
           py::arg("outputs"), py::arg("dropped") = std::vector<size_t>{},
           py::arg("accumulated_only") = std::vector<size_t>{}, NoGil())
      .def("prepare_for_local_backward", &Reducer::prepare_for_local_backward, NoGil())
      .def("allow_local_accumulation", &Reducer::allow_local_accumulation, NoGil())
      .def("bucket_indices", layout_reader([](const BucketLayout& l) { return l.indices(); }))
      .def("bucket_sizes", layout_reader([](const BucketLayout& l) { return l.sizes(); }))
      .def_property_readonly("iterations", without_gil(&Reducer::iterations))
      // See Note [Runtime statistics]: (forward_start, backward_compute_start,
      // backward_comm_start, backward_compute_end, backward_comm_end), ns.
      // See Note [Stragglers].
      .def("_set_straggler_every", &Reducer::set_straggler_every, py::arg("every"), NoGil())
      .def("_straggler_figures", &Reducer::straggler_figures, NoGil())
      .def("_runtime_times", [](const Reducer& r) {
        RuntimeTimes t;
        {
          py::gil_scoped_release no_gil;
          t = r.runtime_times();
        }
        return std::make_tuple(t.forward_start, t.backward_compute_start,
                               t.backward_comm_start, t.backward_compute_end,
                               t.backward_comm_end);
      })
      // See Note [Gradient order prediction]: torch's has_rebuilt_buckets,
      // the rebuilds that changed the layout, and the last synchronising
      // backward's order, overlap fraction and launch delay (unset before one).
      .def_property_readonly("has_rebuilt_buckets", layout_reader([](const BucketLayout& l) {
        return l.order().has_rebuilt();
      }))
      .def_property_readonly("rebuilds", layout_reader([](const BucketLayout& l) {
        return l.order().rebuilds();
      }))
      .def_property_readonly("overlap_fraction", layout_reader([](const BucketLayout& l) {
        return observed(l, l.order().overlap_fraction());
      }))
      .def_property_readonly("launch_delay", layout_reader([](const BucketLayout& l) {
        return observed(l, l.order().launch_delay());
      }))
      .def("observed_order", layout_reader([](const BucketLayout& l) {
        return l.order().last_order();
      }))
      // See Note [Agreeing on the bucket layout]: the caps in use, and the
      // layout other caps would give the current order (nothing applied).
      .def_property_readonly("bucket_caps", layout_reader([](const BucketLayout& l) {
        return l.caps();
      }))
      .def(
          "_layout_for_caps",
          [](const Reducer& r, const std::vector<int64_t>& caps) {
            py::gil_scoped_release no_gil;
            return r.read_layout(
                [&caps](const BucketLayout& l) { return l.layout_for_caps(caps); });
          },
          py::arg("caps"))
      .def("_set_bucket_caps", &Reducer::set_bucket_caps, py::arg("caps"), NoGil())

      .def_property_readonly("learning_static_graph",
                             without_gil(&Reducer::learning_static_graph))
      .def_property_readonly("unused_parameters_stable",
                             without_gil(&Reducer::unused_parameters_stable))
      .def("queue_finish_learning_iteration", &Reducer::queue_finish_learning_iteration,
           NoGil())
      .def("set_overlap_with_backward", &Reducer::set_overlap_with_backward,
           py::arg("overlap"), NoGil())
      .def_property_readonly("phase", [](const Reducer& r) {
        py::gil_scoped_release no_gil;
        return std::string(phase_name(r.phase()));
      })
      .def("_register_comm_hook", &Reducer::register_comm_hook, py::arg("hook"), NoGil())
      .def("_set_comm_hook_fingerprint", &Reducer::set_comm_hook_fingerprint,
           py::arg("fingerprint"), py::arg("confirm"), NoGil())
      .def(
          "_run_comm_hook",
          [](Reducer& r, c10d::GradBucket& bucket) -> FuturePtr {
            return std::make_shared<torch::jit::PythonFutureWrapper>(
                r.run_comm_hook(bucket));
          },
          py::arg("bucket"), NoGil())
      .def(
          "_run_allreduce_hook",
          [](Reducer& r, c10d::GradBucket& bucket) -> FuturePtr {
            return std::make_shared<torch::jit::PythonFutureWrapper>(
                r.run_allreduce(bucket));
          },
          py::arg("bucket"), NoGil())
      .def("_get_zeros_like_grad_buckets", &Reducer::zeros_like_grad_buckets, NoGil())
      .def("_get_local_used_map", &Reducer::local_used_map, NoGil())
      .def("_set_forward_pass_work_handle", &Reducer::set_forward_pass_work,
           py::arg("work"), py::arg("divide_by_initial_world_size"), NoGil())
      .def("_set_static_graph", &Reducer::set_static_graph, NoGil())
      .def("_delay_all_reduce", &Reducer::finish_learning_iteration, NoGil())
      .def("_check_reducer_finalized", &Reducer::check_finalized, NoGil())
      .def(
          "_rebuild_buckets",
          [](Reducer& r) {
            // Rebuilds happen at the end of the backward pass that agrees on
            // them (Note [Gradient order prediction]); this call rebuilds
            // nothing. Like torch's, it checks that the last reduction finished.
            r.check_finalized();
            return false;
          },
          NoGil())
      .def("_push_all_rebuilt_params", [](Reducer&) {})
      .def("_remove_autograd_hooks", &Reducer::remove_autograd_hooks, NoGil())
      .def("_update_process_group", &Reducer::update_process_group,
           py::arg("new_process_group"), NoGil())
      .def("_set_timeline", &Reducer::set_timeline, py::arg("on"), NoGil())
      .def(
          "_set_stall_handler",
          [](Reducer& r, int64_t timeout_ms, std::optional<py::function> handler) {
            std::function<void(const StallReport&)> call;
            if (handler) {
              call = stall_handler(std::move(*handler));
            }
            py::gil_scoped_release no_gil;
            r.set_stall_handler(timeout_ms, std::move(call));
          },
          py::arg("timeout_ms"), py::arg("handler"))
      .def(
          "_take_timeline",
          [](Reducer& r, int64_t wait_ms) {
            // (kind, index, begin_ns, end_ns, value) tuples, and the count of
            // events dropped; see Note [Communication timeline].
            std::vector<TimelineEvent> events;
            int64_t dropped = 0;
            {
              py::gil_scoped_release no_gil;
              events = r.take_timeline(&dropped, wait_ms);
            }
            std::vector<std::tuple<int32_t, int32_t, int64_t, int64_t, int64_t>> rows;
            rows.reserve(events.size());
            for (const auto& e : events) {
              rows.emplace_back(e.kind, e.index, e.begin_ns, e.end_ns, e.value);
            }
            return std::make_pair(std::move(rows), dropped);
          },
          py::arg("wait_ms") = 0);
}

void bind_compression(py::module& m) {
  using namespace ddp_ext::compression;
  py::module::import("torch.distributed");

  py::class_<PolicyOptions>(m, "PolicyOptions")
      .def(py::init<>())
      .def_readwrite("warmup_iterations", &PolicyOptions::warmup_iterations)
      .def_readwrite("check_every", &PolicyOptions::check_every)
      .def_readwrite("critical_change", &PolicyOptions::critical_change)
      .def_readwrite("reprobe_every", &PolicyOptions::reprobe_every)
      .def_readwrite("int8_allowed", &PolicyOptions::int8_allowed)
      .def_readwrite("off_when_slower", &PolicyOptions::off_when_slower);

  py::class_<PrecisionDecision>(m, "PrecisionDecision")
      .def_readonly("iteration", &PrecisionDecision::iteration)
      .def_readonly("mode", &PrecisionDecision::mode)
      .def_readonly("formats", &PrecisionDecision::formats)
      .def_readonly("full_cost_ms", &PrecisionDecision::full_cost_ms)
      .def_readonly("compressed_cost_ms", &PrecisionDecision::compressed_cost_ms);

  py::class_<AdaptivePrecision, std::shared_ptr<AdaptivePrecision>>(
      m, "AdaptivePrecision",
      "State of the adaptive-precision communication hook; see "
      "comm_hooks/compression/adaptive_precision.h.")
      .def(py::init([](ProcessGroupPtr group, PolicyOptions policy, int64_t int8_chunk,
                       std::optional<std::string> int8_exchange, py::object companion) {
             std::optional<Int8Exchange> exchange;
             if (int8_exchange) {
               TORCH_CHECK(*int8_exchange == "allgather" || *int8_exchange == "reduce_scatter",
                           "int8_exchange is 'allgather' or 'reduce_scatter', got '",
                           *int8_exchange, "'");
               exchange = *int8_exchange == "allgather" ? Int8Exchange::kAllgather
                                                        : Int8Exchange::kReduceScatter;
             }
             return std::make_shared<AdaptivePrecision>(
                 std::move(group), AdaptivePrecisionOptions{policy, int8_chunk, exchange},
                 companion.is_none() ? ProcessGroupPtr() : companion.cast<ProcessGroupPtr>());
           }),
           py::arg("process_group"), py::arg("policy"), py::arg("int8_chunk"),
           py::arg("int8_exchange") = py::none(), py::arg("companion") = py::none())
      .def(
          "run",
          [](AdaptivePrecision& state, c10d::GradBucket& bucket) -> FuturePtr {
            return std::make_shared<torch::jit::PythonFutureWrapper>(state.run(bucket));
          },
          py::arg("bucket"), NoGil())
      .def_property_readonly("iterations", &AdaptivePrecision::iterations)
      .def_property_readonly("bytes_sent", &AdaptivePrecision::bytes_sent)
      .def_property_readonly("mode", &AdaptivePrecision::mode)
      .def_property_readonly("formats", &AdaptivePrecision::formats)
      .def("decisions", &AdaptivePrecision::decisions)
      .def("residual", &AdaptivePrecision::residual, py::arg("bucket_index"))
      .def_property_readonly("int8_exchange", [](const AdaptivePrecision& state) {
        return std::string(int8_exchange_name(state.int8_exchange()));
      });

  m.def(
      "int8_exchange_for",
      [](int64_t world_size) { return std::string(int8_exchange_name(int8_exchange_for(world_size))); },
      py::arg("world_size"));
}

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

void bind_process_groups(py::module& m) {
  using namespace ddp_ext::process_groups;
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
      "again; see process_groups/hierarchical/backend.h.")
      .def(py::init([](ProcessGroupPtr flat, ProcessGroupPtr intra, ProcessGroupPtr inter,
                       ProcessGroupPtr intra_gather) {
             return c10::make_intrusive<HierarchicalBackend>(HierarchicalGroups{
                 std::move(flat), std::move(intra), std::move(inter), std::move(intra_gather)});
           }),
           py::arg("flat"), py::arg("intra"), py::arg("inter"), py::arg("intra_gather"))
      .def_property_readonly("hierarchical_calls", &HierarchicalBackend::hierarchical_calls);
}

} // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "ddp_ext native core: gradient reducer and process groups";
  m.attr("torch_version") = py::str(
      std::to_string(TORCH_VERSION_MAJOR) + "." +
      std::to_string(TORCH_VERSION_MINOR));
  bind_reducer(m);
  bind_compression(m);
  bind_comm_hooks(m);
  bind_process_groups(m);
}
