#pragma once

namespace ddp_ext::reducer {

// When the reducer lays its buckets out again in the order gradients arrive;
// see Note [Gradient order prediction] in reducer/layout/gradient_order.h.
enum class BucketRebuild {
  kNever, // keep the construction layout
  kOnce, // torch's DDP: rebuild once, at the second forward
  kContinuous, // once, then whenever the order persistently costs overlap
};

} // namespace ddp_ext::reducer
