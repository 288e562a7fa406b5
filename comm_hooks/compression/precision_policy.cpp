#include "comm_hooks/compression/precision_policy.h"

#include <c10/util/Exception.h>

#include <cmath>

namespace ddp_ext::compression {

const char* precision_name(Precision precision) {
  switch (precision) {
    case Precision::kFull:
      return "fp32";
    case Precision::kHalf:
      return "fp16";
    case Precision::kInt8:
      return "int8";
  }
  return "?";
}

const char* window_mode_name(WindowMode mode) {
  switch (mode) {
    case WindowMode::kWarmup:
      return "warmup";
    case WindowMode::kCompressed:
      return "compressed";
    case WindowMode::kFull:
      return "full";
    case WindowMode::kProbeFull:
      return "probe_full";
    case WindowMode::kProbeCompressed:
      return "probe_compressed";
  }
  return "?";
}

PrecisionPolicy::PrecisionPolicy(PolicyOptions options) : options_(options) {
  TORCH_CHECK(options_.check_every >= 1, "check_every must be at least 1, got ",
              options_.check_every);
  TORCH_CHECK(options_.warmup_iterations >= 0,
              "warmup_iterations must be 0 or more, got ", options_.warmup_iterations);
  TORCH_CHECK(options_.critical_change >= 0,
              "critical_change must be 0 or more, got ", options_.critical_change);
  TORCH_CHECK(options_.reprobe_every >= 1, "reprobe_every must be at least 1, got ",
              options_.reprobe_every);
  if (options_.warmup_iterations == 0) {
    // Nothing measured yet: every bucket counts as critical.
    mode_ = WindowMode::kCompressed;
  }
}

Precision PrecisionPolicy::format(size_t index) const {
  if (mode_ == WindowMode::kCompressed || mode_ == WindowMode::kProbeCompressed) {
    if (index < formats_.size()) {
      return formats_[index];
    }
    return Precision::kHalf; // a bucket never seen: critical
  }
  return Precision::kFull;
}

bool PrecisionPolicy::compression_preferred() const {
  if (!options_.off_when_slower || !full_cost_ms_ || !compressed_cost_ms_) {
    return true; // not yet measured both: try compression
  }
  return *compressed_cost_ms_ < *full_cost_ms_;
}

std::vector<Precision> PrecisionPolicy::compressed_formats(
    const std::vector<double>& norms) const {
  const Precision steady =
      options_.int8_allowed ? Precision::kInt8 : Precision::kHalf;
  std::vector<Precision> formats(norms.size(), Precision::kHalf);
  for (size_t b = 0; b < norms.size(); ++b) {
    if (b >= last_sq_norms_.size() || last_sq_norms_[b] <= 0 || norms[b] <= 0) {
      continue; // no earlier figure: critical
    }
    const double before = std::sqrt(last_sq_norms_[b]);
    const double change = std::abs(std::sqrt(norms[b]) - before) / before;
    if (change <= options_.critical_change) {
      formats[b] = steady;
    }
  }
  return formats;
}

void PrecisionPolicy::conclude_window(const WindowReport& report, int64_t iterations) {
  if (report.cost_ms) {
    const bool compressed =
        mode_ == WindowMode::kCompressed || mode_ == WindowMode::kProbeCompressed;
    (compressed ? compressed_cost_ms_ : full_cost_ms_) = report.cost_ms;
  }
  formats_ = compressed_formats(report.bucket_sq_norms);
  last_sq_norms_ = report.bucket_sq_norms;

  if (iterations < options_.warmup_iterations) {
    mode_ = WindowMode::kWarmup;
    return;
  }
  const bool ran_compressed =
      mode_ == WindowMode::kCompressed || mode_ == WindowMode::kProbeCompressed;
  if (mode_ != WindowMode::kWarmup) {
    ++windows_since_probe_;
  }
  const bool preferred = compression_preferred();
  // Re-measure the choice not taken after running the preferred one for a
  // while (a window that just ran the other one measured it already).
  if (options_.off_when_slower && ran_compressed == preferred &&
      windows_since_probe_ >= options_.reprobe_every) {
    windows_since_probe_ = 0;
    mode_ = preferred ? WindowMode::kProbeFull : WindowMode::kProbeCompressed;
    return;
  }
  mode_ = preferred ? WindowMode::kCompressed : WindowMode::kFull;
}

} // namespace ddp_ext::compression
