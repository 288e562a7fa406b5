#include "reducer/agreement/step_check.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cstring>
#include <utility>
#include <vector>

#include "reducer/base/cuda_streams.h"

namespace ddp_ext::reducer {

namespace {

// Copies `n` elements from `src` at element `from` to `dst` at element
// `to`, both contiguous CPU tensors of one dtype. The carrier's pieces move
// on every backward: a memcpy keeps them off the dispatcher (a narrow and a
// copy_ per piece) on the per-iteration path.
void copy_elements(const at::Tensor& dst, int64_t to, const at::Tensor& src, int64_t from, int64_t n) {
  TORCH_INTERNAL_ASSERT(
      dst.is_cpu() && src.is_cpu() && dst.scalar_type() == src.scalar_type() &&
      dst.is_contiguous() && src.is_contiguous() && to >= 0 && from >= 0 &&
      to + n <= dst.numel() && from + n <= src.numel());
  const auto size = static_cast<int64_t>(dst.element_size());
  std::memcpy(
      static_cast<char*>(dst.data_ptr()) + to * size,
      static_cast<const char*>(src.const_data_ptr()) + from * size,
      static_cast<size_t>(n * size));
}

} // namespace

bool rides_on_bucket0(const Bucket& first, const c10d::ProcessGroup& group, bool own_check) {
  // At three ranks or more, where a carrier keeps Gloo's ring chunks: see
  // point 3 of the Note.
  if (own_check || group.getBackendType() != c10d::ProcessGroup::BackendType::GLOO ||
      first.sparse || !first.flat.defined() || !first.flat.device().is_cpu() ||
      (first.flat.scalar_type() != at::kFloat && first.flat.scalar_type() != at::kDouble) ||
      first.flat.numel() == 0) {
    return false;
  }
  const int64_t tail = kPieces * StepSlots(group.getSize()).size();
  return ChunkedCarrier::plan(
             first.flat.numel(), tail, first.flat.element_size(), group.getSize())
      .has_value();
}

StepCheck::StepCheck(int rank, int world_size, c10::Device device)
    : rank_(rank), world_size_(world_size), layout_(world_size) {
  host_ = at::zeros({layout_.size()}, at::kLong);
  slots_ = device.is_cpu() ? host_ : host_.to(device);
}

void StepCheck::start(c10d::ProcessGroup& group, const StepEntry& entry) {
  TORCH_INTERNAL_ASSERT(!launched(), "a step check is already in flight");
  written_ = entry.position;
  summed_rider_ = 0;
  layout_.write(host_.data_ptr<int64_t>(), rank_, entry);
  if (!slots_.is_same(host_)) {
    // See Note [CUDA streams], point 5: no host wait in the backward pass.
    const bool snapshot = slots_.is_cuda();
    slots_.copy_(
        snapshot ? host_snapshot_for_copy(host_, slots_.device()) : host_,
        /*non_blocking=*/snapshot);
  }
  std::vector<at::Tensor> tensors{slots_};
  flight_ = InFlight{group.allreduce(tensors), /*from_tail=*/false};
}

StepEntry StepCheck::backward_entry(int64_t step) {
  StepEntry entry;
  entry.position = encode_position(CheckKind::kBackward, step);
  return entry;
}

namespace {
void check_backward_entry(const StepEntry& entry) {
  TORCH_INTERNAL_ASSERT(entry.plan > 0 && entry.hooks > 0, "fingerprints are positive");
}
} // namespace

void StepCheck::launch_backward(c10d::ProcessGroup& group, const StepEntry& entry) {
  check_backward_entry(entry);
  start(group, entry);
}

void StepCheck::launch_forward(c10d::ProcessGroup& group, int64_t backwards) {
  start(group, StepEntry{encode_position(CheckKind::kForward, backwards)});
}

void StepCheck::launch_as_joined(c10d::ProcessGroup& group) {
  start(group, StepEntry{});
}

bool StepCheck::launched() const {
  return !std::holds_alternative<Idle>(flight_);
}

void StepCheck::write_tail(const StepEntry& entry, c10::ScalarType dtype) {
  TORCH_INTERNAL_ASSERT(!launched(), "a step check is already in flight");
  TORCH_INTERNAL_ASSERT(
      dtype == at::kFloat || dtype == at::kDouble, "a step check rides on float buckets only");
  written_ = entry.position;
  summed_rider_ = 0;
  layout_.write(host_.data_ptr<int64_t>(), rank_, entry);
  const int64_t numel = kPieces * layout_.size();
  if (!tail_.defined() || tail_.scalar_type() != dtype) {
    tail_ = at::empty({numel}, at::TensorOptions(dtype));
  }
  if (dtype == at::kFloat) {
    encode_pieces(host_.data_ptr<int64_t>(), layout_.size(), tail_.data_ptr<float>());
  } else {
    encode_pieces(host_.data_ptr<int64_t>(), layout_.size(), tail_.data_ptr<double>());
  }
}

void StepCheck::ride_on_bucket0(const StepEntry& entry, c10::ScalarType dtype) {
  check_backward_entry(entry);
  write_tail(entry, dtype);
  flight_ = Riding{};
}

const ChunkedCarrier& StepCheck::layout_for(const at::Tensor& flat) {
  const int64_t n = flat.numel();
  if (!carried_ || carried_->elements != n || carried_->tail != tail_.numel() ||
      !carrier_.defined() || carrier_.scalar_type() != flat.scalar_type()) {
    carried_ = ChunkedCarrier::plan(n, tail_.numel(), flat.element_size(), world_size_);
    TORCH_INTERNAL_ASSERT(carried_, "no carrier keeps bucket 0's ring chunks"); // see rides_on_bucket0
    // Zeros where neither bucket 0 nor the tail goes: they stay zeros.
    carrier_ = at::zeros({carried_->numel()}, flat.options());
  }
  return *carried_;
}

void StepCheck::pack(const at::Tensor& flat) {
  const ChunkedCarrier& layout = layout_for(flat);
  for (int64_t c = 0; c < layout.chunks; ++c) {
    if (const int64_t n = layout.bucket_length(c); n > 0) {
      copy_elements(carrier_, c * layout.padded, flat, c * layout.chunk, n);
    }
    if (const int64_t n = layout.tail_length(c); n > 0) {
      copy_elements(carrier_, c * layout.padded + layout.chunk, tail_, c * layout.room(), n);
    }
  }
}

const at::Tensor& StepCheck::carry(const at::Tensor& flat) {
  TORCH_INTERNAL_ASSERT(riding() && tail_.scalar_type() == flat.scalar_type());
  pack(flat);
  return carrier_;
}

void StepCheck::unpack(const at::Tensor& flat) const {
  TORCH_INTERNAL_ASSERT(riding(), "no step check rides on bucket 0");
  const ChunkedCarrier& layout = *carried_;
  for (int64_t c = 0; c < layout.chunks; ++c) {
    if (const int64_t n = layout.bucket_length(c); n > 0) {
      copy_elements(flat, c * layout.chunk, carrier_, c * layout.padded, n);
    }
  }
}

std::string StepCheck::read_ridden() {
  TORCH_INTERNAL_ASSERT(riding(), "no step check rides on bucket 0");
  flight_ = Idle{};
  return read(/*from_tail=*/true);
}

void StepCheck::start_shaped_like(
    c10d::ProcessGroup& group, const at::Tensor& flat, const StepEntry& entry) {
  TORCH_INTERNAL_ASSERT(flat.device().is_cpu(), "a step check rides on CPU buckets only");
  write_tail(entry, flat.scalar_type());
  carried_.reset(); // a fresh carrier of zeros, then the tail
  pack(at::zeros({flat.numel()}, flat.options()));
  std::vector<at::Tensor> tensors{carrier_};
  flight_ = InFlight{group.allreduce(tensors), /*from_tail=*/true};
}

void StepCheck::launch_backward_shaped_like(
    c10d::ProcessGroup& group, const at::Tensor& flat, const StepEntry& entry) {
  check_backward_entry(entry);
  start_shaped_like(group, flat, entry);
}

std::string StepCheck::check_forward_shaped_like(
    c10d::ProcessGroup& group, const at::Tensor& flat, int64_t backwards,
    StallWatch* watch) {
  drop();
  start_shaped_like(group, flat, StepEntry{encode_position(CheckKind::kForward, backwards)});
  return wait(watch);
}

std::string StepCheck::wait(StallWatch* watch) {
  auto* flight = std::get_if<InFlight>(&flight_);
  TORCH_INTERNAL_ASSERT(flight, "no step check in flight");
  InFlight taken = std::move(*flight);
  flight_ = Idle{};
  if (watch != nullptr) {
    watch->wait(*taken.work, "step check", -1);
  } else {
    taken.work->wait();
  }
  return read(taken.from_tail);
}

std::string StepCheck::read(bool from_tail) {
  if (written_ == 0) {
    return std::string(); // A rank that joined has no position to compare.
  }
  at::Tensor slots = slots_.is_same(host_) ? host_ : slots_.cpu();
  if (from_tail) { // See Note [The step check on bucket 0].
    slots = host_;
    const ChunkedCarrier& layout = *carried_;
    for (int64_t c = 0; c < layout.chunks; ++c) {
      if (const int64_t n = layout.tail_length(c); n > 0) {
        copy_elements(tail_, c * layout.room(), carrier_, c * layout.padded + layout.chunk, n);
      }
    }
    if (tail_.scalar_type() == at::kFloat) {
      decode_pieces(tail_.data_ptr<float>(), layout_.size(), host_.data_ptr<int64_t>());
    } else {
      decode_pieces(tail_.data_ptr<double>(), layout_.size(), host_.data_ptr<int64_t>());
    }
  }
  StepReading reading = layout_.read(slots.data_ptr<int64_t>(), rank_, written_);
  summed_rider_ = reading.summed_rider;
  timings_ = std::move(reading.timings);
  return reading.error;
}

void StepCheck::drop() {
  const auto* flight = std::get_if<InFlight>(&flight_);
  if (flight && !slots_.is_same(host_)) {
    // See Note [CUDA streams], point 7: it may still be writing slots_.
    slots_ = at::empty_like(slots_);
  }
  if ((flight && flight->from_tail) || riding()) {
    carrier_ = at::Tensor(); // an abandoned allreduce may still be writing it
    carried_.reset();
  }
  flight_ = Idle{};
}

std::string StepCheck::check_forward(
    c10d::ProcessGroup& group, int64_t backwards, StallWatch* watch) {
  drop();
  launch_forward(group, backwards);
  return wait(watch);
}

void StepCheck::match_as_joined(c10d::ProcessGroup& group) {
  drop();
  launch_as_joined(group);
  wait();
}

} // namespace ddp_ext::reducer
