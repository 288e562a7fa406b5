#pragma once

#include <c10/core/Device.h>
#include <c10/util/FunctionRef.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "reducer/agreement/step_check.h"
#include "reducer/layout/bucket.h"
#include "reducer/transport/bucket_transport.h"

namespace ddp_ext::reducer {

// Note [Step check policies]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~
// Whether the ranks check their steps (Note [Ranks out of step] in
// reducer/agreement/step_check.h) is one object the reducer always holds,
// whose type is the mode:
//
//   NoStepCheck    a world of one rank: no peer to be out of step with, so
//                  every call does nothing and nothing is allocated.
//   PeerStepCheck  more ranks: a StepCheck at every synchronising backward
//                  (alone, or riding on bucket 0) and before a forward's
//                  buffer broadcast.
//
// The policy also chooses the transport of a reducer that runs no hook
// (Note [Bucket transports]): the carrier needs a check to carry. The
// reducer replaces both together when its process group changes.

class StepCheckPolicy {
 public:
  virtual ~StepCheckPolicy() = default;

  // The transport of a reducer that runs no hook; it may refer to this policy.
  virtual std::shared_ptr<BucketTransport> transport_without_hook() = 0;

  // At the start of a synchronising backward, whose bucket 0 is `first`:
  // starts its check with this rank's `entry()`. `own_check`: see
  // rides_on_bucket0; `transport`: the reducer's, which says whether bucket
  // 0 carries the check (carries_step_check). Returns whether a check started.
  virtual bool launch_backward(
      const Bucket& first, bool own_check, const BucketTransport& transport,
      const TransportContext& context, c10::function_ref<StepEntry()> entry) = 0;
  // Whether a backward's check is in flight (or rides on bucket 0, unread).
  virtual bool launched() const = 0;
  // Waits for the backward's check (finishing bucket 0 through `transport`
  // where it rides there): its message, empty when the ranks agree.
  virtual std::string await_backward(
      BucketTransport& transport, Bucket& first, const TransportContext& context) = 0;
  // Every rank's step timings from the last check awaited, or empty.
  virtual const std::vector<int64_t>& timings() const = 0;
  // The bucket-order votes summed by the last check (Note [Agreeing on the
  // bucket layout]); none where no check runs.
  virtual std::optional<int64_t> summed_votes() const = 0;
  // Forgets a check in flight without waiting.
  virtual void drop() = 0;

  // A whole check before a forward's buffer broadcast, after `backwards`
  // backwards begun: its message, empty when the ranks agree.
  virtual std::string check_forward(
      c10d::ProcessGroup& group, const Bucket& first, bool own_check, int64_t backwards,
      StallWatch& watch) = 0;
  // A whole check as a rank that joined.
  virtual void match_as_joined(c10d::ProcessGroup& group) = 0;
};

// NoStepCheck for a world of one rank, else PeerStepCheck; for parameters on `device`.
std::unique_ptr<StepCheckPolicy> step_check_policy(
    const c10d::ProcessGroup& group, c10::Device device);

} // namespace ddp_ext::reducer
