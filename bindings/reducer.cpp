// Bindings of the Reducer: its options, its methods by concern (the
// iteration, the bucket layout, hooks and Join, what it reports about
// itself), and the hang handler that calls into Python. Every method
// releases the GIL before it takes the reducer's lock: see Note [Windows
// without the lock] in reducer/core/state_lock.cpp.

#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "bindings/bindings.h"
#include "comm_hooks/comm_hook.h"
#include "reducer/core/reducer.h"
#include "reducer/layout/bucket_memory.h"

namespace ddp_ext::bindings {
namespace {

using ddp_ext::reducer::Bucket;
using ddp_ext::reducer::BucketLayout;
using ddp_ext::reducer::BucketRebuild;
using ddp_ext::reducer::bucket_memory_bytes;
using ddp_ext::reducer::phase_name;
using ddp_ext::reducer::Reducer;
using ddp_ext::reducer::ReducerOptions;
using ddp_ext::reducer::RuntimeTimes;
using ddp_ext::reducer::stall_kind_name;
using ddp_ext::reducer::StallReport;
using ddp_ext::reducer::TimelineEvent;
using ReducerClass = py::class_<Reducer, std::shared_ptr<Reducer>>;

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
auto without_gil(T (Reducer::*getter)() const) {
  return [getter](const Reducer& r) {
    py::gil_scoped_release no_gil;
    return (r.*getter)();
  };
}

// A getter of the bucket layout, read under the reducer's lock without the GIL.
template <typename Read>
auto layout_reader(Read read) {
  return [read](const Reducer& r) {
    py::gil_scoped_release no_gil;
    return r.read_layout(read);
  };
}

// A figure of the last observed backward, unset before one finished.
std::optional<double> observed(const BucketLayout& l, double figure) {
  if (l.order().observed_iterations() == 0) {
    return std::nullopt;
  }
  return figure;
}

// See Note [Hang attribution]: a StallReport as the dict the Python
// handler (ddp_ext/_diagnosis/) reads.
py::dict stall_report_dict(const StallReport& report) {
  py::dict d;
  d["kind"] = stall_kind_name(report.event.kind);
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
std::function<void(const StallReport&)> stall_handler(py::function handler) {
  std::shared_ptr<py::function> fn(new py::function(std::move(handler)), [](py::function* f) {
    if (Py_IsInitialized()) {
      py::gil_scoped_acquire gil;
      delete f;
    }
  });
  return [fn](const StallReport& report) {
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

// Calls `step(indices)` under the GIL; what it raises (a Python error)
// leaves backward as raised. See Note [Stepping reduced buckets] in
// reducer/finish/step_per_bucket.h.
Reducer::BucketStep bucket_step(py::function step) {
  std::shared_ptr<py::function> fn(new py::function(std::move(step)), [](py::function* f) {
    if (Py_IsInitialized()) {
      py::gil_scoped_acquire gil;
      delete f;
    }
  });
  return [fn](const std::vector<size_t>& indices) {
    py::gil_scoped_acquire gil;
    (*fn)(indices);
  };
}

// The step of reduce-scattered buckets (Note [Sharded buckets]): `step` is
// called with the parameters of a bucket that some rank used, the bucket's
// parameter indices, offsets and lengths, its length and its shard (the
// tensor the reducer fills again at every synchronising backward).
Reducer::BucketStep shard_step(std::weak_ptr<Reducer> weak, py::function step) {
  std::shared_ptr<py::function> fn(new py::function(std::move(step)), [](py::function* f) {
    if (Py_IsInitialized()) {
      py::gil_scoped_acquire gil;
      delete f;
    }
  });
  return [fn, weak = std::move(weak)](const std::vector<size_t>& used) {
    const std::shared_ptr<Reducer> reducer = weak.lock();
    if (used.empty() || !reducer) {
      return;
    }
    auto bucket = reducer->read_layout([&used](const BucketLayout& l) {
      const Bucket& b = l.buckets()[l.bucket_index_of(used.front())];
      return std::make_tuple(b.param_indices, b.offsets, b.lengths, b.flat.numel(), b.shard);
    });
    py::gil_scoped_acquire gil;
    (*fn)(used, std::get<0>(bucket), std::get<1>(bucket), std::get<2>(bucket),
          std::get<3>(bucket), std::get<4>(bucket));
  };
}

// Construction and the iteration: forward, backward, no_sync, static graphs,
// unused parameters, Join's divide factor, a new process group.
void bind_iteration(ReducerClass& cls) {
  cls
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
      .def_property_readonly("training_steps", without_gil(&Reducer::training_steps))
      .def("prepare_for_backward", &Reducer::prepare_for_backward,
           py::arg("outputs"), py::arg("dropped") = std::vector<size_t>{},
           py::arg("accumulated_only") = std::vector<size_t>{}, NoGil())
      .def("prepare_for_local_backward", &Reducer::prepare_for_local_backward, NoGil())
      .def("allow_local_accumulation", &Reducer::allow_local_accumulation, NoGil())
      .def_property_readonly("iterations", without_gil(&Reducer::iterations))
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
      .def("_get_local_used_map", &Reducer::local_used_map, NoGil())
      .def("_set_forward_pass_work_handle", &Reducer::set_forward_pass_work,
           py::arg("work"), py::arg("divide_by_initial_world_size"), NoGil())
      .def("_set_static_graph", &Reducer::set_static_graph, NoGil())
      .def("_delay_all_reduce", &Reducer::finish_learning_iteration, NoGil())
      .def("_check_reducer_finalized", &Reducer::check_finalized, NoGil())
      .def("_remove_autograd_hooks", &Reducer::remove_autograd_hooks, NoGil())
      .def("_update_process_group", &Reducer::update_process_group,
           py::arg("new_process_group"), NoGil())
      // See Note [Late gradients] in reducer/core/late_gradients.h.
      .def_property_readonly("_has_late_gradients", without_gil(&Reducer::has_late_gradients))
      .def("_take_late_gradients", &Reducer::take_late_gradients, NoGil());
}

// The bucket layout: the buckets, their caps, and the rebuilds in gradient
// order (Note [Agreeing on the bucket layout]).
void bind_layout(ReducerClass& cls) {
  cls
      .def("bucket_indices", layout_reader([](const BucketLayout& l) { return l.indices(); }))
      .def("bucket_sizes", layout_reader([](const BucketLayout& l) { return l.sizes(); }))
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

      // See Note [Agreeing on the bucket layout]: the first rebuild, at
      // torch's point; returns whether it happened now.
      .def(
          "_rebuild_buckets",
          [](Reducer& r) {
            // Raises first, under the read lock a hook may take, if a
            // reduction is under way (as torch's: called from a hook or its
            // callback it must not wait for the lock the backward holds).
            r.check_finalized();
            return r.rebuild_buckets();
          },
          NoGil())
      .def("_push_all_rebuilt_params", &Reducer::shadowed_backward, NoGil());
}

// Communication hooks, and the collectives a rank that joined (Join) shadows
// (Note [Ranks out of step]).
void bind_hooks_and_join(ReducerClass& cls) {
  cls
      .def(
          "_register_comm_hook",
          [](Reducer& r, std::shared_ptr<ddp_ext::comm_hooks::CommHook> hook) {
            r.register_comm_hook(std::move(hook));
          },
          py::arg("hook"), NoGil())
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
      .def("_match_step_check_as_joined", &Reducer::match_step_check_as_joined, NoGil())
      .def("_check_step_before_forward_collectives",
           &Reducer::check_step_before_forward_collectives, NoGil());
}

// What the reducer reports about itself: torch's runtime statistics, the
// straggler figures, the communication timeline and hang reports.
void bind_observation(ReducerClass& cls) {
  cls
      // See Note [Stragglers].
      .def("_set_straggler_every", &Reducer::set_straggler_every, py::arg("every"), NoGil())
      .def("_straggler_figures", &Reducer::straggler_figures, NoGil())
      // See Note [Runtime statistics]: (forward_start, backward_compute_start,
      // backward_comm_start, backward_compute_end, backward_comm_end), ns.
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
      .def("_set_timeline", &Reducer::set_timeline, py::arg("on"), NoGil())
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
          py::arg("wait_ms") = 0)
      .def(
          "_set_bucket_step",
          [](Reducer& r, std::optional<py::function> step) {
            Reducer::BucketStep call;
            if (step) {
              call = bucket_step(std::move(*step));
            }
            py::gil_scoped_release no_gil;
            r.set_bucket_step(std::move(call));
          },
          py::arg("step"))
      .def(
          "_set_reduce_scatter",
          [](Reducer& r, py::function step, int64_t replicated_below) {
            Reducer::BucketStep call = shard_step(r.weak_from_this(), std::move(step));
            py::gil_scoped_release no_gil;
            r.set_reduce_scatter(std::move(call), replicated_below);
          },
          py::arg("step"), py::arg("replicated_below") = 0)
      // Per bucket: the bytes its memory holds now, and its shard's.
      .def("_bucket_memory", layout_reader([](const BucketLayout& l) {
        std::vector<std::pair<int64_t, int64_t>> bytes;
        for (const Bucket& b : l.buckets()) {
          bytes.emplace_back(
              static_cast<int64_t>(bucket_memory_bytes(b)),
              b.shard.defined() ? static_cast<int64_t>(b.shard.nbytes()) : 0);
        }
        return bytes;
      }))
      .def(
          "_set_forward_tail",
          [](Reducer& r, double fraction) {
            py::gil_scoped_release no_gil;
            r.set_forward_tail(fraction);
          },
          py::arg("fraction"))
      .def(
          "_deferred_buckets",
          [](Reducer& r) {
            py::gil_scoped_release no_gil;
            return r.deferred_buckets();
          })
      .def(
          "_finish_deferred",
          [](Reducer& r, size_t bucket_index) {
            py::gil_scoped_release no_gil;
            r.finish_deferred(bucket_index);
          },
          py::arg("bucket_index"))
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
          py::arg("timeout_ms"), py::arg("handler"));
}

} // namespace

void bind_reducer(py::module& m) {
  py::enum_<BucketRebuild>(m, "BucketRebuild")
      .value("never", BucketRebuild::kNever)
      .value("once", BucketRebuild::kOnce)
      .value("continuous", BucketRebuild::kContinuous);

  py::class_<ReducerOptions>(m, "ReducerOptions")
      .def(py::init<>())
      .def_readwrite("find_unused_parameters", &ReducerOptions::find_unused_parameters)
      .def_readwrite("gradient_as_bucket_view", &ReducerOptions::gradient_as_bucket_view)
      .def_readwrite("overlap_with_backward", &ReducerOptions::overlap_with_backward)
      .def_readwrite("skip_all_reduce_unused_params",
                     &ReducerOptions::skip_all_reduce_unused_params)
      .def_readwrite("batched_grad_copy", &ReducerOptions::batched_grad_copy)
      .def_readwrite("buffers_broadcast", &ReducerOptions::buffers_broadcast)
      .def_readwrite("reduce_dtype", &ReducerOptions::reduce_dtype)
      .def_readwrite("rebuild_buckets", &ReducerOptions::rebuild_buckets)
      .def_readwrite("bucket_caps", &ReducerOptions::bucket_caps)
      .def_readwrite("first_layout_caps", &ReducerOptions::first_layout_caps)
      .def_readwrite("layer_units", &ReducerOptions::layer_units);

  // Methods with a leading underscore carry the names of torch's
  // torch._C._distributed_c10d.Reducer, which frameworks call.
  ReducerClass cls(m, "Reducer");
  bind_iteration(cls);
  bind_layout(cls);
  bind_hooks_and_join(cls);
  bind_observation(cls);
}

} // namespace ddp_ext::bindings
