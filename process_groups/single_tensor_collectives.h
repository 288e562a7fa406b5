#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

namespace ddp_ext::process_groups {

// Note [Single-tensor collective names]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// torch 2.13 names ProcessGroup's single-tensor collectives all_gather_single,
// reduce_scatter_single and all_to_all_single, and keeps the older names
// (_allgather_base, _reduce_scatter_base, alltoall_base) as deprecated
// aliases; older torch has only the older names. These forward to the newer
// name where the torch we build against has it, and to the older one
// otherwise, chosen at compile time (the group is a template parameter so
// that only the branch taken is compiled).

template <typename Group, typename = void>
struct HasSingleNames : std::false_type {};

template <typename Group>
struct HasSingleNames<
    Group,
    std::void_t<decltype(std::declval<Group&>().all_gather_single(
        std::declval<at::Tensor&>(), std::declval<at::Tensor&>(),
        std::declval<const c10d::AllgatherOptions&>()))>> : std::true_type {};

template <typename Group>
c10::intrusive_ptr<c10d::Work> all_gather_single(
    Group& group, at::Tensor& output, at::Tensor& input,
    const c10d::AllgatherOptions& opts) {
  if constexpr (HasSingleNames<Group>::value) {
    return group.all_gather_single(output, input, opts);
  } else {
    return group._allgather_base(output, input, opts);
  }
}

template <typename Group>
c10::intrusive_ptr<c10d::Work> reduce_scatter_single(
    Group& group, at::Tensor& output, at::Tensor& input,
    const c10d::ReduceScatterOptions& opts) {
  if constexpr (HasSingleNames<Group>::value) {
    return group.reduce_scatter_single(output, input, opts);
  } else {
    return group._reduce_scatter_base(output, input, opts);
  }
}

template <typename Group>
c10::intrusive_ptr<c10d::Work> all_to_all_single(
    Group& group, at::Tensor& output, at::Tensor& input,
    std::vector<int64_t>& output_split_sizes,
    std::vector<int64_t>& input_split_sizes,
    const c10d::AllToAllOptions& opts) {
  if constexpr (HasSingleNames<Group>::value) {
    return group.all_to_all_single(
        output, input, output_split_sizes, input_split_sizes, opts);
  } else {
    return group.alltoall_base(
        output, input, output_split_sizes, input_split_sizes, opts);
  }
}

} // namespace ddp_ext::process_groups
