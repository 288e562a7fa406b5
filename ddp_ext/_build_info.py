"""Build facts: the one place both the ahead-of-time build (setup.py) and the
JIT loader (ddp_ext._loader) read them from.

This file imports nothing, so setup.py can execute it without importing the
package (which would try to load the extension it is about to build).
"""

VERSION = "0.1.0"

# Paths relative to the repository root. Listed by hand, never globbed.
SOURCES = [
    "bindings/comm_hooks.cpp",
    "bindings/compression.cpp",
    "bindings/module.cpp",
    "bindings/process_groups.cpp",
    "bindings/reducer.cpp",
    "comm_hooks/builtin_hooks.cpp",
    "comm_hooks/compression/accumulate.cpp",
    "comm_hooks/compression/adaptive_precision.cpp",
    "comm_hooks/compression/int8_codec.cpp",
    "comm_hooks/compression/int8_exchange.cpp",
    "comm_hooks/compression/precision_policy.cpp",
    "comm_hooks/compression/residuals.cpp",
    "process_groups/broadcast_coalesced.cpp",
    "process_groups/exit_release.cpp",
    "process_groups/hierarchical/all_gather.cpp",
    "process_groups/hierarchical/backend.cpp",
    "process_groups/hierarchical/future_work.cpp",
    "process_groups/ordered_launches.cpp",
    "process_groups/round_robin/backend.cpp",
    "reducer/agreement/ring_chunks.cpp",
    "reducer/agreement/step_check.cpp",
    "reducer/agreement/step_slots.cpp",
    "reducer/base/accumulator_hooks.cpp",
    "reducer/base/averaging.cpp",
    "reducer/base/errors.cpp",
    "reducer/core/end_of_backward.cpp",
    "reducer/core/gradient_copy.cpp",
    "reducer/core/hooks_and_join.cpp",
    "reducer/core/late_gradients.cpp",
    "reducer/core/observers.cpp",
    "reducer/core/phase.cpp",
    "reducer/core/rebuilds.cpp",
    "reducer/core/reducer.cpp",
    "reducer/core/settings_and_figures.cpp",
    "reducer/core/sharded_buckets.cpp",
    "reducer/core/stall_report.cpp",
    "reducer/core/state_lock.cpp",
    "reducer/core/static_graph_iteration.cpp",
    "reducer/core/step_agreement.cpp",
    "reducer/core/write_back.cpp",
    "reducer/finish/keep_shards.cpp",
    "reducer/finish/step_and_defer_tail.cpp",
    "reducer/finish/step_per_bucket.cpp",
    "reducer/finish/write_back_all.cpp",
    "reducer/layout/bucket_assignment.cpp",
    "reducer/layout/bucket_layout.cpp",
    "reducer/layout/bucket_memory.cpp",
    "reducer/layout/gradient_order.cpp",
    "reducer/observation/stall_watch.cpp",
    "reducer/observation/step_timings.cpp",
    "reducer/observation/timeline.cpp",
    "reducer/participation/layer_drop.cpp",
    "reducer/participation/static_graph.cpp",
    "reducer/participation/usage.cpp",
    "reducer/transport/allreduce.cpp",
    "reducer/transport/bucket_transport.cpp",
    "reducer/transport/carrier_with_step_check.cpp",
    "reducer/transport/hook_transport.cpp",
    "reducer/transport/reduce_scatter.cpp",
    "reducer/transport/ring_order_sum.cpp",
    "reducer/transport/ring_reduce_scatter.cpp",
    "reducer/transport/step_check_policy.cpp",
]

# The pybind11 bindings (module.cpp, the entry point, first), compiled as one
# generated unit; every other source is compiled as another (see
# ddp_ext/_translation_units.py).
BINDING_SOURCES = [
    "bindings/module.cpp",
    "bindings/comm_hooks.cpp",
    "bindings/compression.cpp",
    "bindings/process_groups.cpp",
    "bindings/reducer.cpp",
]

# The MPI backend, a module of its own (ddp_ext._mpi), built only where MPI
# is found (see ddp_ext/_mpi_build.py): binding source first, as above.
MPI_SOURCES = [
    "bindings/mpi.cpp",
    "process_groups/mpi/backend.cpp",
    "process_groups/mpi/communicator.cpp",
    "process_groups/mpi/datatype.cpp",
    "process_groups/mpi/progress.cpp",
    "process_groups/mpi/rendezvous.cpp",
    "process_groups/mpi/runtime.cpp",
    "process_groups/mpi/work.cpp",
]
MPI_BINDING_SOURCE = "bindings/mpi.cpp"

# Includes are rooted at the repository: `#include "reducer/core/reducer.h"`.
INCLUDE_DIRS = ["."]

CXX_FLAGS = ["-O2", "-g0"]

# With DDP_EXT_SANITIZE=1 in the environment, setup.py (and the tests' own
# C++ doubles, tests/support/native_extensions.py) add these flags to compiling and
# linking: AddressSanitizer and UndefinedBehaviorSanitizer, whose runtime must
# then be preloaded (see tools/sanitized_tests.sh). -fno-wrapv undoes Python's
# -fwrapv, so that signed overflow is checked too; -O0 -g1 compiles in a third
# of the time -O1 -g takes, with file:line traces.
SANITIZE_ENV = "DDP_EXT_SANITIZE"
SANITIZE_FLAGS = ["-fsanitize=address,undefined", "-fno-wrapv", "-fno-omit-frame-pointer", "-O0", "-g1"]
