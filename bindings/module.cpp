// The extension's Python entry point: bindings only, no logic. The binding
// files (bindings/bindings.h) are the only ones that include pybind11 or
// Python headers; every other file is plain C++.

#include <torch/csrc/utils/pybind.h>
#include <torch/version.h>

#include <string>

#include "bindings/bindings.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace bindings = ddp_ext::bindings;
  m.doc() = "ddp_ext native core: gradient reducer and process groups";
  m.attr("torch_version") = pybind11::str(
      std::to_string(TORCH_VERSION_MAJOR) + "." +
      std::to_string(TORCH_VERSION_MINOR));
  bindings::bind_reducer(m);
  bindings::bind_compression(m);
  bindings::bind_comm_hooks(m);
  bindings::bind_process_groups(m);
}
