#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <optional>

namespace ddp_ext::reducer {

// Note [CUDA streams]
// ~~~~~~~~~~~~~~~~~~~
// On a GPU every kernel and copy is queued on a stream, and the caching
// allocator reuses a freed block at once for later work on the stream that
// allocated it. The reducer never synchronizes the device; it relies on the
// orderings below, and adds the few the others do not give. Only generic c10
// interfaces are used (VirtualGuardImpl, Event, Stream), so the CPU build
// needs no CUDA headers, and none of this runs for CPU tensors.
//
// 1. Hooks. Autograd runs a parameter's AccumulateGrad, and then our post
//    hook, with the current stream set to the stream of that node, and
//    .grad is complete on it. The copy into the bucket (and the 1/world_size
//    scale) is queued on that stream, the hook's stream.
// 2. Launch. ProcessGroupNCCL makes its own stream wait for the current
//    stream when a collective is issued, and keeps the inputs alive until
//    they are read (recordStream, or a stash under
//    TORCH_NCCL_AVOID_RECORD_STREAMS). ProcessGroupGloo with CUDA tensors
//    does the same with its private streams, which copy to and from pinned
//    host memory. So a bucket is launched from a stream that must be ordered
//    after every copy into it. Usually every hook of a device runs on one
//    stream and that holds trivially; when gradients of one bucket arrive on
//    different streams (accumulators created under different current
//    streams, or a later hook launching earlier buckets), note_fill_stream
//    makes each new stream wait for the previous one with an event, so the
//    launching stream comes after all of them.
// 3. End of backward. The engine runs queued callbacks (finalize_backward,
//    finish_learning_iteration) with the current streams set to the
//    caller's streams around backward(), after making them wait for every
//    leaf (AccumulateGrad) stream. Work::wait() then makes that stream wait
//    for the collective (ProcessGroupNCCL's WorkNCCL::wait, Gloo's
//    synchronize), and a comm hook's future's wait() does the same and
//    records its value on the waiting stream. The write back to .grad is
//    queued there, so the user's next kernels on that stream see it.
// 4. Memory that crosses streams. A gradient stashed for a globally unused
//    parameter (gradient_as_bucket_view) is cloned on a hook's stream and
//    read by the write back on the caller's stream: keep_for_current_stream
//    records it there before the reducer drops it. Tensors handed to a
//    collective are kept by the process group (point 2); bucket buffers and
//    the usage bitmap live as long as the reducer.
// 5. Host to device. The used-parameter bitmap and the step check's slots
//    are written on the host and copied to the device before their
//    allreduce. A blocking copy from ordinary (pageable) memory makes the
//    host wait until the stream has run all work queued before it, in the
//    middle of the backward pass (the step check's copy, at the first
//    gradient); a non-blocking one may too, when the driver stages pageable
//    memory. Both copy a pinned snapshot instead, non-blocking
//    (host_snapshot_for_copy): the host does not wait, and the copy reads
//    the snapshot, not the live tensor the host changes afterwards (the
//    bitmap is zeroed at the end of the iteration, the slots rewritten at
//    the next check). The pinned allocator keeps the snapshot until the
//    copy has run.
// 6. Device to host. The summed bitmap, the step check's slots, Join's count
//    and the broadcast bucket order are read on the host with a blocking
//    .cpu() after their Work::wait(): the host needs the values, and the
//    copy is queued after the wait on the current stream. The step check is
//    read at the end of every backward pass with more than one rank (with a
//    LayerDrop, before the first bucket is sent), the bitmap at the end of
//    backward with find_unused_parameters, Join's count at the first
//    gradient under Join, the order only when buckets are rebuilt. Each such
//    read makes the host wait for the GPU work queued before it; torch's DDP
//    has no such wait per iteration without find_unused_parameters, so the
//    step check's is a cost to measure on a GPU, not a free one.
// 7. Abandoned collectives. A step check dropped without waiting may still
//    be writing its device slots, so the next check gets fresh ones. Bucket
//    allreduces abandoned after a peer's error are not waited for, as in
//    torch's DDP: the process group's state after such an error is not
//    relied upon.
// 8. Inputs. With device_ids, the wrapper (ddp_ext/distributed.py) moves
//    CPU inputs with a non-blocking copy on the current stream, where the
//    forward uses them. From pageable memory the copy has read the host
//    data when it returns; from pinned memory it has not (the pinned
//    allocator keeps the block until it has), so a caller must not
//    overwrite a pinned input in place before the copy runs, as with any
//    non-blocking copy. torch's DDP copies on a side stream instead and
//    makes the current stream wait for it.

// The stream that work for `device` is queued on by this thread now; none
// for the CPU.
inline std::optional<c10::Stream> current_stream_of(c10::Device device) {
  if (device.is_cpu()) {
    return std::nullopt;
  }
  return c10::impl::VirtualGuardImpl(device.type()).getStream(device);
}

// See Note [CUDA streams], point 2: the current stream is about to use a
// bucket that `filled_on` last wrote; order it after that stream's work, and
// remember it as the bucket's last writer.
inline void note_fill_stream(std::optional<c10::Stream>& filled_on, c10::Device device) {
  const std::optional<c10::Stream> now = current_stream_of(device);
  if (!now) {
    return;
  }
  if (filled_on && *filled_on != *now) {
    c10::Event done(filled_on->device_type());
    done.record(*filled_on);
    now->wait(done);
  }
  filled_on = now;
}

// See Note [CUDA streams], point 4.
inline void keep_for_current_stream(const at::Tensor& tensor) {
  if (const auto stream = current_stream_of(tensor.device())) {
    tensor.record_stream(*stream);
  }
}

// See Note [CUDA streams], point 5: what an asynchronous copy of the host
// tensor `values` to `device` should read.
inline at::Tensor host_snapshot_for_copy(const at::Tensor& values, c10::Device device) {
  return device.is_cuda() ? values.pin_memory() : values;
}

} // namespace ddp_ext::reducer
