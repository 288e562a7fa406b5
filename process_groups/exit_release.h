#pragma once

#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <chrono>
#include <vector>

namespace ddp_ext {

// Drops every backend of `groups` (ProcessGroup::release_resources), so a
// Gloo backend that no one else holds is destroyed and joins its worker
// threads, which finish releasing their last collectives first. Runs on a
// thread of its own; returns true if it finished within `timeout`, else
// false, leaving that thread to finish (or not) on its own: a collective
// still waiting for a peer holds a Gloo worker until the group's timeout,
// and exit must not wait that long. The caller must not hold the GIL: a
// Gloo worker may need it to release what it holds. See Note [Exit after
// training] in ddp_ext/_exit.py.
bool release_process_groups(
    std::vector<c10::intrusive_ptr<c10d::ProcessGroup>> groups,
    std::chrono::milliseconds timeout);

} // namespace ddp_ext
