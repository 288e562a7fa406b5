#include "process_groups/mpi/rendezvous.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/tensor.h>

#include "process_groups/mpi/backend.h"

namespace ddp_ext::process_groups::mpi {

std::string broadcast_from_rank0(const std::string& text,
                                 std::chrono::milliseconds timeout) {
  MpiBackendOptions options;
  options.timeout = timeout;
  options.group_name = "mpi:// rendezvous";
  auto world = c10::make_intrusive<MpiBackend>(Communicator::world(), options);
  // Step 1: the length; step 2: the bytes.
  std::vector<at::Tensor> length{
      at::tensor({static_cast<int64_t>(text.size())}, at::kLong)};
  world->broadcast(length, c10d::BroadcastOptions())->wait();
  std::vector<at::Tensor> bytes{
      at::empty({length[0].item<int64_t>()}, at::kByte)};
  if (world->getRank() == 0) {
    std::copy(text.begin(), text.end(), bytes[0].data_ptr<uint8_t>());
  }
  world->broadcast(bytes, c10d::BroadcastOptions())->wait();
  const auto* data = bytes[0].data_ptr<uint8_t>();
  return std::string(data, data + bytes[0].numel());
}

} // namespace ddp_ext::process_groups::mpi
