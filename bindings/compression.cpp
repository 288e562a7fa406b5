// Bindings of the adaptive-precision hook's state and policy (see
// comm_hooks/compression/adaptive_precision.h) and of its 8-bit codec.

#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include <optional>
#include <string>
#include <vector>

#include "bindings/bindings.h"
#include "comm_hooks/compression/adaptive_precision.h"
#include "comm_hooks/compression/int8_codec.h"
#include "comm_hooks/compression/int8_exchange.h"

namespace ddp_ext::bindings {

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

  // The 8-bit codec itself, for callers that exchange payloads from Python
  // (DiLoCo's outer gradients, ddp_ext/diloco/int8.py).
  m.def("int8_payload_bytes", &int8_payload_bytes, py::arg("numel"), py::arg("chunk"));
  m.def(
      "encode_int8",
      [](at::Tensor values, at::Tensor payload, int64_t chunk) { encode_int8(values, payload, chunk); },
      py::arg("values"), py::arg("payload"), py::arg("chunk"), NoGil());
  m.def(
      "decode_sum_int8",
      [](const std::vector<at::Tensor>& payloads, at::Tensor out, int64_t chunk) {
        decode_sum_int8(payloads, out, chunk);
      },
      py::arg("payloads"), py::arg("out"), py::arg("chunk"), NoGil());

  m.def(
      "int8_exchange_for",
      [](int64_t world_size) { return std::string(int8_exchange_name(int8_exchange_for(world_size))); },
      py::arg("world_size"));
}

} // namespace ddp_ext::bindings
