#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <chrono>

namespace ddp_ext::process_groups {

// Knobs of one RoundRobinBackend. The children themselves are a constructor
// argument; these say how the composite treats them.
struct RoundRobinBackendOptions {
  // Whether shutdown() and abort() are passed on to the children. True when
  // the round-robin group created its children (ddp_ext.new_round_robin_group,
  // init_process_group("round_robin")); false when it borrows groups the
  // caller still owns (ddp_ext.round_robin_group), so that destroying the
  // round-robin group leaves them usable. Default: true.
  bool owns_children = true;

  // The timeout getBackendOptions() reports, in milliseconds. Informational:
  // each child enforces its own timeout on the collectives it runs.
  // Default: c10d's default of 30 minutes.
  std::chrono::milliseconds timeout = kBackendDefaultTimeout;
};

} // namespace ddp_ext::process_groups
