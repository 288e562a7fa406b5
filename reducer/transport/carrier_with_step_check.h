#pragma once

#include "reducer/agreement/step_check.h"
#include "reducer/transport/allreduce.h"

namespace ddp_ext::reducer {

// The default allreduce, where bucket 0 carries the backward's step check
// when it rides there (Note [The step check on bucket 0] in
// reducer/agreement/step_check.h): bucket 0 is allreduced inside the
// check's carrier, and finish() copies it back out, leaving the check to be
// read. Every other bucket, and bucket 0 of a backward whose check travels
// on its own, is allreduced as Allreduce does. See Note [Bucket transports].
class CarrierWithStepCheck final : public Allreduce {
 public:
  // `check` outlives this transport (both belong to the reducer, which
  // replaces this one when it replaces the check).
  explicit CarrierWithStepCheck(StepCheck& check) : check_(check) {}

  void launch(
      size_t index, size_t count, Bucket& bucket, const TransportContext& context,
      TimelineRange& range) override;
  void finish(size_t index, Bucket& bucket, const TransportContext& context) override;

 private:
  StepCheck& check_;
};

} // namespace ddp_ext::reducer
