#pragma once

#include "reducer/transport/allreduce.h"
#include "reducer/transport/step_check_policy.h"

namespace ddp_ext::reducer {

// A world of one rank: no step check (Note [Step check policies]).
class NoStepCheck final : public StepCheckPolicy {
 public:
  std::shared_ptr<BucketTransport> transport_without_hook() override {
    return std::make_shared<Allreduce>();
  }
  bool launch_backward(
      const Bucket&, bool, const BucketTransport&, const TransportContext&,
      c10::function_ref<StepEntry()>) override {
    return false;
  }
  bool launched() const override {
    return false;
  }
  std::string await_backward(BucketTransport&, Bucket&, const TransportContext&) override {
    return {};
  }
  const std::vector<int64_t>& timings() const override {
    return none_;
  }
  std::optional<int64_t> summed_votes() const override {
    return std::nullopt;
  }
  void drop() override {}
  std::string check_forward(
      c10d::ProcessGroup&, const Bucket&, bool, int64_t, StallWatch&) override {
    return {};
  }
  void match_as_joined(c10d::ProcessGroup&) override {}

 private:
  const std::vector<int64_t> none_;
};

} // namespace ddp_ext::reducer
