#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace ddp_ext::compression {

// Note [Adaptive precision]
// ~~~~~~~~~~~~~~~~~~~~~~~~~
// The adaptive-precision hook (comm_hooks/compression/adaptive_precision.h) sends each
// float32 bucket in one of three formats, chosen per bucket for a window of
// `check_every` synchronising iterations:
//
//   kFull   float32, one allreduce (what DDP sends without a hook);
//   kHalf   float16, one allreduce, half the bytes;
//   kInt8   8-bit codes with one float32 scale per chunk of `int8_chunk`
//           elements. Each rank's scales differ, so the codes cannot be
//           summed on the wire: up to 3 ranks they are allgathered and
//           every rank decodes the payloads in rank order and sums them in
//           float32; from 4 ranks they are reduce-scattered (summed in
//           float32 on each segment's owner, encoded again, allgathered),
//           so the bytes per rank stay a quarter of float32's whatever the
//           world size. Either way all ranks get the same bits. See
//           Note [Eight bits at any world size] (int8_exchange.h).
//
// Error feedback: what rounding drops is kept per parameter (a residual)
// and added to the next gradient sent (the reduce-scatter's second
// rounding, too: it goes into the segment owner's residual), so the sum of what a rank sent over
// any stretch of iterations differs from the sum of its gradients by its
// current residual only: one rounding's worth, never an accumulation.
// Float16's allreduce also rounds the sum on the wire, which no rank sees;
// and a parameter no rank used keeps its .grad (find_unused_parameters), so
// what it owed and sent in that iteration is dropped. A full-precision
// window sends every residual and frees it.
//
// The choice follows two measurements, both agreed across ranks:
//
// 1. Critical regimes (Accordion, Agarwal et al., MLSys 2021): the squared
//    norm of each bucket's gradient, summed over the window's iterations and
//    over ranks. A bucket whose norm changed by more than `critical_change`
//    (relative) since the last window is in a critical regime and gets
//    kHalf; a steady one gets kInt8 (kHalf where kInt8 is not offered).
//    Buckets with no earlier figure count as critical.
// 2. Whether compression pays: the hook measures, per iteration, the time
//    it adds that the backward pass cannot hide (compressing on the
//    backward's thread, plus the time from the last bucket's launch until
//    its reduction, decoding included, is done). The mean of that over the
//    window and the ranks is the window's cost, recorded for full precision
//    or for compression, whichever the window ran. Compression is used
//    while its cost is below full precision's; otherwise every bucket is
//    sent at full precision. Every `reprobe_every` windows the other choice
//    is run for one window so that both figures stay current.
//
// The first `warmup_iterations` run at full precision (and measure it).
//
// Agreement: every rank calls the hook for the same buckets in the same
// order (DDP launches them in index order; ranks that joined shadow them),
// so every rank counts iterations alike. At the first bucket of each
// window's first iteration the hook allreduces, in one small float64
// tensor, the window's per-bucket squared norms and its cost; every rank
// then runs this pure policy on the same numbers and chooses the same
// formats for the same iterations. Every collective is issued from the hook
// call itself, never from a completion callback (decoding runs there), so
// the ranks issue them in bucket order whatever the timing.

enum class Precision : int8_t { kFull = 0, kHalf = 1, kInt8 = 2 };

const char* precision_name(Precision precision);

// What a window ran: compression as decided, or full precision.
enum class WindowMode : int8_t {
  kWarmup = 0,      // full precision, before compression is considered
  kCompressed = 1,  // per-bucket formats from the critical-regime test
  kFull = 2,        // full precision because compression did not pay
  kProbeFull = 3,   // one window of full precision to re-measure it
  kProbeCompressed = 4,  // one window of compression to re-measure it
};

const char* window_mode_name(WindowMode mode);

struct PolicyOptions {
  // Synchronising iterations sent at full precision first. Default: 20.
  int64_t warmup_iterations = 20;
  // Iterations per window: formats change only between windows, and the
  // statistics are agreed once per window. Default: 10.
  int64_t check_every = 10;
  // Relative change of a bucket's gradient norm between windows above which
  // the bucket is in a critical regime and gets float16. Default: 0.3.
  double critical_change = 0.3;
  // Windows between re-measurements of the choice not taken. Default: 10.
  int64_t reprobe_every = 10;
  // Whether kInt8 may be chosen (false without a way to exchange it that
  // pays; see Note [Eight bits at any world size]). Default: true.
  bool int8_allowed = true;
  // Send full precision while compression measures slower (2. above);
  // false keeps compressing whatever it costs. Default: true.
  bool off_when_slower = true;
};

// The agreed figures of one finished window.
struct WindowReport {
  // Per bucket: squared gradient norm summed over the window and the ranks;
  // 0 for a bucket that was not sent in the window.
  std::vector<double> bucket_sq_norms;
  // Mean exposed cost of an iteration in the window, milliseconds; unset if
  // no iteration was measured.
  std::optional<double> cost_ms;
};

// The decisions, as a pure function of the reports (see Note [Adaptive
// precision]); the same reports give the same decisions on every rank.
class PrecisionPolicy {
 public:
  explicit PrecisionPolicy(PolicyOptions options);

  // Concludes the window that ended at `iterations` synchronising iterations
  // and chooses the next window's mode and formats.
  void conclude_window(const WindowReport& report, int64_t iterations);

  // The format of bucket `index` in the current window.
  Precision format(size_t index) const;
  WindowMode mode() const { return mode_; }
  std::optional<double> full_cost_ms() const { return full_cost_ms_; }
  std::optional<double> compressed_cost_ms() const { return compressed_cost_ms_; }
  const PolicyOptions& options() const { return options_; }

 private:
  bool compression_preferred() const;
  std::vector<Precision> compressed_formats(const std::vector<double>& norms) const;

  PolicyOptions options_;
  WindowMode mode_ = WindowMode::kWarmup;
  std::vector<Precision> formats_;
  std::vector<double> last_sq_norms_;
  std::optional<double> full_cost_ms_;
  std::optional<double> compressed_cost_ms_;
  int64_t windows_since_probe_ = 0;
};

} // namespace ddp_ext::compression
