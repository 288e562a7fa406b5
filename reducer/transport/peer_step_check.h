#pragma once

#include "reducer/agreement/step_check.h"
#include "reducer/transport/step_check_policy.h"

namespace ddp_ext::reducer {

// A world of more than one rank: the step check of Note [Ranks out of step]
// (reducer/agreement/step_check.h), alone or riding on bucket 0 (Note [The
// step check on bucket 0]). See Note [Step check policies].
class PeerStepCheck final : public StepCheckPolicy {
 public:
  PeerStepCheck(int rank, int world_size, c10::Device device)
      : check_(rank, world_size, device) {}

  // CarrierWithStepCheck, which carries this policy's check on bucket 0.
  std::shared_ptr<BucketTransport> transport_without_hook() override;
  bool launch_backward(
      const Bucket& first, bool own_check, const BucketTransport& transport,
      const TransportContext& context, c10::function_ref<StepEntry()> entry) override;
  bool launched() const override {
    return check_.launched();
  }
  std::string await_backward(
      BucketTransport& transport, Bucket& first, const TransportContext& context) override;
  const std::vector<int64_t>& timings() const override {
    return check_.timings();
  }
  std::optional<int64_t> summed_votes() const override {
    return check_.summed_rider();
  }
  void drop() override {
    check_.drop();
  }
  std::string check_forward(
      c10d::ProcessGroup& group, const Bucket& first, bool own_check, int64_t backwards,
      StallWatch& watch) override;
  void match_as_joined(c10d::ProcessGroup& group) override {
    check_.match_as_joined(group);
  }

 private:
  StepCheck check_;
};

} // namespace ddp_ext::reducer
