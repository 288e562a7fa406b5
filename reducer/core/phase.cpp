#include "reducer/core/phase.h"

namespace ddp_ext::reducer {

const char* phase_name(Phase phase) {
  switch (phase) {
    case Phase::kIdle:
      return "idle";
    case Phase::kAccumulating:
      return "accumulating";
    case Phase::kExpectingGradients:
      return "expecting gradients";
    case Phase::kReducing:
      return "reducing";
  }
  return "unknown";
}

} // namespace ddp_ext::reducer
