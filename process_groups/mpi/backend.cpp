#include "process_groups/mpi/backend.h"

#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <climits>
#include <numeric>
#include <utility>

#include "process_groups/mpi/datatype.h"

namespace ddp_ext::process_groups::mpi {

namespace {

using WorkPtr = c10::intrusive_ptr<c10d::Work>;

// See Note [MPI process group] step 3.
void check_tensor(const at::Tensor& t, const char* op) {
  TORCH_CHECK(t.defined(), "ddp_ext_mpi: ", op, " got an undefined tensor.");
  TORCH_CHECK(t.device().is_cpu(), "ddp_ext_mpi: ", op,
              " needs CPU tensors, got one on ", t.device(),
              ". Use a CPU tensor, or a backend for that device.");
  TORCH_CHECK(t.layout() == at::kStrided && t.is_contiguous(), "ddp_ext_mpi: ",
              op, " needs dense contiguous tensors; call .contiguous() first.");
  transport_type(t.scalar_type());
}

const at::Tensor& single(const std::vector<at::Tensor>& tensors, const char* op) {
  TORCH_CHECK(tensors.size() == 1, "ddp_ext_mpi: ", op,
              " takes exactly one tensor per process, got ", tensors.size(), ".");
  check_tensor(tensors[0], op);
  return tensors[0];
}

// MPI counts are ints.
int count(int64_t n, const char* op) {
  TORCH_CHECK(n <= INT_MAX, "ddp_ext_mpi: ", op, " of ", n,
              " elements is more than MPI's counts can hold (", INT_MAX,
              "); split it into smaller calls.");
  return static_cast<int>(n);
}

void check_same(const at::Tensor& t, const at::Tensor& like, const char* op,
                const char* what) {
  check_tensor(t, op);
  TORCH_CHECK(t.scalar_type() == like.scalar_type() && t.numel() == like.numel(),
              "ddp_ext_mpi: ", op, ": every ", what, " must have the input's "
              "dtype and number of elements (", like.scalar_type(), ", ",
              like.numel(), "), got ", t.scalar_type(), ", ", t.numel(), ".");
}

// `tensors` must be one list of `size` tensors each like `like`; returns it.
const std::vector<at::Tensor>& one_list(
    const std::vector<std::vector<at::Tensor>>& lists, int size,
    const at::Tensor& like, const char* op, const char* what) {
  TORCH_CHECK(lists.size() == 1 && lists[0].size() == static_cast<size_t>(size),
              "ddp_ext_mpi: ", op, " takes one list of ", size, " ", what,
              "s (one per rank) per process.");
  for (const auto& t : lists[0]) {
    check_same(t, like, op, what);
  }
  return lists[0];
}

// The tensors laid end to end, in one new buffer.
at::Tensor flat(const std::vector<at::Tensor>& tensors) {
  std::vector<at::Tensor> views;
  views.reserve(tensors.size());
  for (const auto& t : tensors) {
    views.push_back(t.reshape({-1}));
  }
  return at::cat(views);
}

// Copies consecutive pieces of `buffer` into `tensors`.
void unflat(const at::Tensor& buffer, const std::vector<at::Tensor>& tensors) {
  int64_t offset = 0;
  for (const auto& t : tensors) {
    t.copy_(buffer.narrow(0, offset, t.numel()).view_as(t));
    offset += t.numel();
  }
}

void check_root(int64_t root, int size, const char* op) {
  TORCH_CHECK(root >= 0 && root < size, "ddp_ext_mpi: ", op, " root rank ",
              root, " is not a rank of this group of ", size, ".");
}

void check_peer(int peer, int size, const char* op) {
  TORCH_CHECK(peer >= 0 && peer < size, "ddp_ext_mpi: ", op, " peer rank ",
              peer, " is not a rank of this group of ", size, ".");
}

// Counts and displacements of MPI_Ialltoallv, in elements. MPI reads them
// until the call completes, so the op keeps them alive.
struct Splits {
  std::vector<int> counts;
  std::vector<int> displacements;
};

Splits splits_of(const std::vector<int64_t>& rows, int64_t row_numel,
                 const char* op) {
  Splits s;
  int64_t offset = 0;
  for (const auto r : rows) {
    TORCH_CHECK(r >= 0, "ddp_ext_mpi: ", op, " got a negative split size.");
    s.counts.push_back(count(r * row_numel, op));
    s.displacements.push_back(count(offset, op));
    offset += r * row_numel;
  }
  return s;
}

// Rows of dim 0 per rank: `given`, or the tensor split equally.
std::vector<int64_t> rows_per_rank(const std::vector<int64_t>& given,
                                   const at::Tensor& t, int size,
                                   const char* op, const char* which) {
  const int64_t rows = t.dim() == 0 ? 1 : t.size(0);
  if (given.empty()) {
    TORCH_CHECK(rows % size == 0, "ddp_ext_mpi: ", op, ": the ", which,
                " has ", rows, " rows, which do not split equally over ",
                size, " ranks; pass split sizes.");
    return std::vector<int64_t>(size, rows / size);
  }
  TORCH_CHECK(given.size() == static_cast<size_t>(size), "ddp_ext_mpi: ", op,
              ": ", given.size(), " ", which, " split sizes for ", size,
              " ranks.");
  TORCH_CHECK(std::accumulate(given.begin(), given.end(), int64_t{0}) == rows,
              "ddp_ext_mpi: ", op, ": the ", which, " split sizes do not add "
              "up to its ", rows, " rows.");
  return given;
}

} // namespace

MpiBackend::MpiBackend(std::unique_ptr<Communicator> communicator,
                       MpiBackendOptions options)
    : c10d::Backend(communicator->rank(), communicator->size()),
      communicator_(std::move(communicator)),
      options_(std::move(options)),
      progress_(std::make_unique<MpiProgress>(
          "rank " + std::to_string(rank_) + " of " + std::to_string(size_) +
          " in group '" + options_.group_name + "'")) {
  init();
}

MpiBackend::~MpiBackend() {
  shutdown();
}

const std::string MpiBackend::getBackendName() const {
  return kName;
}

c10::intrusive_ptr<c10d::Backend::Options> MpiBackend::getBackendOptions() {
  std::lock_guard<std::mutex> guard(mutex_);
  return c10::make_intrusive<c10d::Backend::Options>(kName, options_.timeout);
}

void MpiBackend::setTimeout(std::chrono::milliseconds timeout) {
  std::lock_guard<std::mutex> guard(mutex_);
  options_.timeout = timeout;
}

void MpiBackend::shutdown() {
  std::unique_ptr<MpiProgress> progress;
  {
    std::lock_guard<std::mutex> guard(mutex_);
    progress.swap(progress_);
  }
  if (!progress) {
    return;
  }
  const bool was_broken = progress->broken();
  progress.reset(); // waits for the collectives in flight
  std::unique_ptr<Communicator> communicator;
  {
    std::lock_guard<std::mutex> guard(mutex_);
    communicator.swap(communicator_);
  }
  if (was_broken) {
    communicator->leak();
  }
}

bool MpiBackend::broken() const {
  std::lock_guard<std::mutex> guard(mutex_);
  return progress_ && progress_->broken();
}

MpiProgress& MpiBackend::progress() {
  std::lock_guard<std::mutex> guard(mutex_);
  TORCH_CHECK(progress_, "ddp_ext_mpi: this process group was shut down; "
              "create a new one.");
  return *progress_;
}

MPI_Comm MpiBackend::comm() const {
  std::lock_guard<std::mutex> guard(mutex_);
  TORCH_CHECK(communicator_, "ddp_ext_mpi: this process group was shut "
              "down; create a new one.");
  return communicator_->get();
}

std::chrono::milliseconds MpiBackend::timeout_or_default(
    std::chrono::milliseconds timeout) const {
  std::lock_guard<std::mutex> guard(mutex_);
  return timeout == c10d::kUnsetTimeout ? options_.timeout : timeout;
}

WorkPtr MpiBackend::launch(c10d::OpType type, const char* name,
                           std::chrono::milliseconds timeout,
                           std::vector<at::Tensor> outputs,
                           std::function<std::vector<MPI_Request>()> start,
                           std::function<void()> finish) {
  MpiOp op;
  op.work = c10::make_intrusive<MpiWork>(rank_, type, std::move(outputs));
  op.name = name;
  op.timeout = timeout_or_default(timeout);
  op.start = std::move(start);
  op.finish = std::move(finish);
  auto work = op.work;
  progress().enqueue(std::move(op));
  return work;
}

WorkPtr MpiBackend::launch_reduction(Reduction call) {
  struct Buffers {
    at::Tensor send;
    at::Tensor recv;
  };
  const auto dtype = reduction_dtype(call.dtype);
  const auto how = mpi::reduction(call.op, dtype);
  const int size = size_;
  auto buffers = std::make_shared<Buffers>();
  auto start = [=]() {
    buffers->send = call.input().to(dtype);
    if (call.in_place) {
      buffers->recv = buffers->send;
    } else if (call.output.defined()) {
      buffers->recv = call.output.scalar_type() == dtype
          ? call.output
          : at::empty(call.output.sizes(), call.output.options().dtype(dtype));
    }
    MPI_Request request = MPI_REQUEST_NULL;
    check(call.start(
              call.in_place ? MPI_IN_PLACE : buffers->send.data_ptr(),
              buffers->recv.defined() ? buffers->recv.data_ptr() : nullptr,
              transport_type(dtype), how.op, &request),
          call.name);
    return std::vector<MPI_Request>{request};
  };
  auto finish = [=]() {
    if (call.output.defined()) {
      if (how.divide_by_size) {
        buffers->recv.div_(size);
      }
      if (!buffers->recv.is_same(call.output)) {
        call.output.copy_(buffers->recv);
      }
    }
    buffers->send = buffers->recv = at::Tensor();
    if (call.after) {
      call.after();
    }
  };
  std::vector<at::Tensor> outputs;
  if (call.output.defined()) {
    outputs.push_back(call.output);
  }
  return launch(call.type, call.name, call.timeout, std::move(outputs),
                std::move(start), std::move(finish));
}

WorkPtr MpiBackend::broadcast(std::vector<at::Tensor>& tensors,
                              const c10d::BroadcastOptions& opts) {
  const auto& t = single(tensors, "broadcast");
  check_root(opts.rootRank, size_, "broadcast");
  const int n = count(t.numel(), "broadcast");
  const int root = static_cast<int>(opts.rootRank);
  MPI_Comm comm = this->comm();
  return launch(c10d::OpType::BROADCAST, "broadcast", opts.timeout, {t}, [=]() {
    MPI_Request r = MPI_REQUEST_NULL;
    check(MPI_Ibcast(t.data_ptr(), n, transport_type(t.scalar_type()), root,
                     comm, &r),
          "MPI_Ibcast");
    return std::vector<MPI_Request>{r};
  });
}

WorkPtr MpiBackend::allreduce(std::vector<at::Tensor>& tensors,
                              const c10d::AllreduceOptions& opts) {
  const auto& t = single(tensors, "allreduce");
  const int n = count(t.numel(), "allreduce");
  MPI_Comm comm = this->comm();
  return launch_reduction(Reduction{
      c10d::OpType::ALLREDUCE, "allreduce", opts.timeout, opts.reduceOp,
      t.scalar_type(), [t] { return t; }, t, /*in_place=*/true,
      [=](const void* s, void* r, MPI_Datatype d, MPI_Op o, MPI_Request* q) {
        return MPI_Iallreduce(s, r, n, d, o, comm, q);
      }});
}

WorkPtr MpiBackend::allreduce_coalesced(
    std::vector<at::Tensor>& tensors,
    const c10d::AllreduceCoalescedOptions& opts) {
  TORCH_CHECK(!tensors.empty(), "ddp_ext_mpi: allreduce_coalesced got no tensors.");
  int64_t total = 0;
  for (const auto& t : tensors) {
    check_tensor(t, "allreduce_coalesced");
    TORCH_CHECK(t.scalar_type() == tensors[0].scalar_type(),
                "ddp_ext_mpi: allreduce_coalesced needs tensors of one dtype, "
                "got ", tensors[0].scalar_type(), " and ", t.scalar_type(), ".");
    total += t.numel();
  }
  const int n = count(total, "allreduce_coalesced");
  MPI_Comm comm = this->comm();
  // One allreduce of the tensors laid end to end, then spread back out.
  const auto result = at::empty({total}, tensors[0].options());
  auto work = launch_reduction(Reduction{
      c10d::OpType::ALLREDUCE_COALESCED, "allreduce_coalesced", opts.timeout,
      opts.reduceOp, tensors[0].scalar_type(), [tensors] { return flat(tensors); },
      result, /*in_place=*/false,
      [=](const void* s, void* r, MPI_Datatype d, MPI_Op o, MPI_Request* q) {
        return MPI_Iallreduce(s, r, n, d, o, comm, q);
      },
      [tensors, result] { unflat(result, tensors); }});
  return work;
}

WorkPtr MpiBackend::reduce(std::vector<at::Tensor>& tensors,
                           const c10d::ReduceOptions& opts) {
  const auto& t = single(tensors, "reduce");
  check_root(opts.rootRank, size_, "reduce");
  const int n = count(t.numel(), "reduce");
  const int root = static_cast<int>(opts.rootRank);
  const bool is_root = rank_ == root;
  MPI_Comm comm = this->comm();
  // Only the root receives; MPI_IN_PLACE is for the root only.
  return launch_reduction(Reduction{
      c10d::OpType::REDUCE, "reduce", opts.timeout, opts.reduceOp,
      t.scalar_type(), [t] { return t; }, is_root ? t : at::Tensor(),
      /*in_place=*/is_root,
      [=](const void* s, void* r, MPI_Datatype d, MPI_Op o, MPI_Request* q) {
        return MPI_Ireduce(s, r, n, d, o, root, comm, q);
      }});
}

WorkPtr MpiBackend::allgather(std::vector<std::vector<at::Tensor>>& outputs,
                              std::vector<at::Tensor>& inputs,
                              const c10d::AllgatherOptions& opts) {
  const auto& in = single(inputs, "allgather");
  const auto outs = one_list(outputs, size_, in, "allgather", "output");
  const int n = count(in.numel() * size_, "allgather") / size_;
  MPI_Comm comm = this->comm();
  auto gathered = std::make_shared<at::Tensor>();
  const int size = size_;
  return launch(
      c10d::OpType::ALLGATHER, "allgather", opts.timeout, outs,
      [=]() {
        *gathered = at::empty({int64_t{n} * size}, in.options());
        const auto type = transport_type(in.scalar_type());
        MPI_Request r = MPI_REQUEST_NULL;
        check(MPI_Iallgather(in.data_ptr(), n, type, gathered->data_ptr(), n,
                             type, comm, &r),
              "MPI_Iallgather");
        return std::vector<MPI_Request>{r};
      },
      [=]() { unflat(*gathered, outs); });
}

WorkPtr MpiBackend::_allgather_base(at::Tensor& output, at::Tensor& input,
                                    const c10d::AllgatherOptions& opts) {
  check_tensor(input, "all_gather_into_tensor");
  check_tensor(output, "all_gather_into_tensor");
  TORCH_CHECK(output.scalar_type() == input.scalar_type() &&
                  output.numel() == input.numel() * size_,
              "ddp_ext_mpi: all_gather_into_tensor needs an output of the "
              "input's dtype with ", size_, " times its elements.");
  const int n = count(output.numel(), "all_gather_into_tensor") / size_;
  MPI_Comm comm = this->comm();
  return launch(c10d::OpType::_ALLGATHER_BASE, "all_gather_into_tensor",
                opts.timeout, {output}, [=]() {
                  const auto type = transport_type(input.scalar_type());
                  MPI_Request r = MPI_REQUEST_NULL;
                  check(MPI_Iallgather(input.data_ptr(), n, type,
                                       output.data_ptr(), n, type, comm, &r),
                        "MPI_Iallgather");
                  return std::vector<MPI_Request>{r};
                });
}

WorkPtr MpiBackend::gather(std::vector<std::vector<at::Tensor>>& outputs,
                           std::vector<at::Tensor>& inputs,
                           const c10d::GatherOptions& opts) {
  const auto& in = single(inputs, "gather");
  check_root(opts.rootRank, size_, "gather");
  const int root = static_cast<int>(opts.rootRank);
  const bool is_root = rank_ == root;
  std::vector<at::Tensor> outs;
  if (is_root) {
    outs = one_list(outputs, size_, in, "gather", "output");
  } else {
    TORCH_CHECK(outputs.empty() || (outputs.size() == 1 && outputs[0].empty()),
                "ddp_ext_mpi: gather takes outputs on the root rank only.");
  }
  const int n = count(in.numel() * size_, "gather") / size_;
  MPI_Comm comm = this->comm();
  auto gathered = std::make_shared<at::Tensor>();
  const int size = size_;
  return launch(
      c10d::OpType::GATHER, "gather", opts.timeout, outs,
      [=]() {
        if (is_root) {
          *gathered = at::empty({int64_t{n} * size}, in.options());
        }
        const auto type = transport_type(in.scalar_type());
        MPI_Request r = MPI_REQUEST_NULL;
        check(MPI_Igather(in.data_ptr(), n, type,
                          is_root ? gathered->data_ptr() : nullptr, n, type,
                          root, comm, &r),
              "MPI_Igather");
        return std::vector<MPI_Request>{r};
      },
      [=]() {
        if (is_root) {
          unflat(*gathered, outs);
        }
      });
}

WorkPtr MpiBackend::scatter(std::vector<at::Tensor>& outputs,
                            std::vector<std::vector<at::Tensor>>& inputs,
                            const c10d::ScatterOptions& opts) {
  const auto& out = single(outputs, "scatter");
  check_root(opts.rootRank, size_, "scatter");
  const int root = static_cast<int>(opts.rootRank);
  const bool is_root = rank_ == root;
  std::vector<at::Tensor> ins;
  if (is_root) {
    ins = one_list(inputs, size_, out, "scatter", "input");
  } else {
    TORCH_CHECK(inputs.empty() || (inputs.size() == 1 && inputs[0].empty()),
                "ddp_ext_mpi: scatter takes inputs on the root rank only.");
  }
  const int n = count(out.numel() * size_, "scatter") / size_;
  MPI_Comm comm = this->comm();
  auto laid_out = std::make_shared<at::Tensor>();
  return launch(
      c10d::OpType::SCATTER, "scatter", opts.timeout, {out},
      [=]() {
        if (is_root) {
          *laid_out = flat(ins);
        }
        const auto type = transport_type(out.scalar_type());
        MPI_Request r = MPI_REQUEST_NULL;
        check(MPI_Iscatter(is_root ? laid_out->data_ptr() : nullptr, n, type,
                           out.data_ptr(), n, type, root, comm, &r),
              "MPI_Iscatter");
        return std::vector<MPI_Request>{r};
      },
      [=]() { *laid_out = at::Tensor(); });
}

WorkPtr MpiBackend::reduce_scatter(std::vector<at::Tensor>& outputs,
                                   std::vector<std::vector<at::Tensor>>& inputs,
                                   const c10d::ReduceScatterOptions& opts) {
  const auto& out = single(outputs, "reduce_scatter");
  const auto ins = one_list(inputs, size_, out, "reduce_scatter", "input");
  const int n = count(out.numel() * size_, "reduce_scatter") / size_;
  MPI_Comm comm = this->comm();
  return launch_reduction(Reduction{
      c10d::OpType::REDUCE_SCATTER, "reduce_scatter", opts.timeout,
      opts.reduceOp, out.scalar_type(), [ins] { return flat(ins); }, out,
      /*in_place=*/false,
      [=](const void* s, void* r, MPI_Datatype d, MPI_Op o, MPI_Request* q) {
        return MPI_Ireduce_scatter_block(s, r, n, d, o, comm, q);
      }});
}

WorkPtr MpiBackend::_reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                         const c10d::ReduceScatterOptions& opts) {
  check_tensor(input, "reduce_scatter_tensor");
  check_tensor(output, "reduce_scatter_tensor");
  TORCH_CHECK(output.scalar_type() == input.scalar_type() &&
                  input.numel() == output.numel() * size_,
              "ddp_ext_mpi: reduce_scatter_tensor needs an input of the "
              "output's dtype with ", size_, " times its elements.");
  const int n = count(input.numel(), "reduce_scatter_tensor") / size_;
  MPI_Comm comm = this->comm();
  return launch_reduction(Reduction{
      c10d::OpType::_REDUCE_SCATTER_BASE, "reduce_scatter_tensor",
      opts.timeout, opts.reduceOp, output.scalar_type(),
      [input] { return input; }, output, /*in_place=*/false,
      [=](const void* s, void* r, MPI_Datatype d, MPI_Op o, MPI_Request* q) {
        return MPI_Ireduce_scatter_block(s, r, n, d, o, comm, q);
      }});
}

WorkPtr MpiBackend::alltoall_base(at::Tensor& output, at::Tensor& input,
                                  std::vector<int64_t>& output_split_sizes,
                                  std::vector<int64_t>& input_split_sizes,
                                  const c10d::AllToAllOptions& opts) {
  const char* name = "all_to_all_single";
  check_tensor(input, name);
  check_tensor(output, name);
  TORCH_CHECK(output.scalar_type() == input.scalar_type(), "ddp_ext_mpi: ",
              name, " needs input and output of one dtype.");
  const auto row = [](const at::Tensor& t) {
    return t.dim() == 0 ? int64_t{1} : t.numel() / std::max<int64_t>(t.size(0), 1);
  };
  auto send = std::make_shared<Splits>(splits_of(
      rows_per_rank(input_split_sizes, input, size_, name, "input"),
      row(input), name));
  auto recv = std::make_shared<Splits>(splits_of(
      rows_per_rank(output_split_sizes, output, size_, name, "output"),
      row(output), name));
  MPI_Comm comm = this->comm();
  return launch(
      c10d::OpType::ALLTOALL_BASE, name, opts.timeout, {output},
      [=]() {
        const auto type = transport_type(input.scalar_type());
        MPI_Request r = MPI_REQUEST_NULL;
        check(MPI_Ialltoallv(input.data_ptr(), send->counts.data(),
                             send->displacements.data(), type,
                             output.data_ptr(), recv->counts.data(),
                             recv->displacements.data(), type, comm, &r),
              "MPI_Ialltoallv");
        return std::vector<MPI_Request>{r};
      },
      [send, recv]() {}); // keeps the counts alive until completion
}

WorkPtr MpiBackend::alltoall(std::vector<at::Tensor>& outputs,
                             std::vector<at::Tensor>& inputs,
                             const c10d::AllToAllOptions& opts) {
  TORCH_CHECK(inputs.size() == static_cast<size_t>(size_) &&
                  outputs.size() == static_cast<size_t>(size_),
              "ddp_ext_mpi: all_to_all takes ", size_, " inputs and ", size_,
              " outputs (one per rank), got ", inputs.size(), " and ",
              outputs.size(), ".");
  std::vector<int64_t> send_numel;
  std::vector<int64_t> recv_numel;
  for (int i = 0; i < size_; ++i) {
    check_tensor(inputs[i], "all_to_all");
    check_tensor(outputs[i], "all_to_all");
    TORCH_CHECK(inputs[i].scalar_type() == inputs[0].scalar_type() &&
                    outputs[i].scalar_type() == inputs[0].scalar_type(),
                "ddp_ext_mpi: all_to_all needs tensors of one dtype.");
    send_numel.push_back(inputs[i].numel());
    recv_numel.push_back(outputs[i].numel());
  }
  auto send = std::make_shared<Splits>(splits_of(send_numel, 1, "all_to_all"));
  auto recv = std::make_shared<Splits>(splits_of(recv_numel, 1, "all_to_all"));
  const int64_t recv_total =
      std::accumulate(recv_numel.begin(), recv_numel.end(), int64_t{0});
  MPI_Comm comm = this->comm();
  auto laid_out = std::make_shared<at::Tensor>();
  auto received = std::make_shared<at::Tensor>();
  return launch(
      c10d::OpType::ALLTOALL, "all_to_all", opts.timeout, outputs,
      [=]() {
        *laid_out = flat(inputs);
        *received = at::empty({recv_total}, outputs[0].options());
        const auto type = transport_type(inputs[0].scalar_type());
        MPI_Request r = MPI_REQUEST_NULL;
        check(MPI_Ialltoallv(laid_out->data_ptr(), send->counts.data(),
                             send->displacements.data(), type,
                             received->data_ptr(), recv->counts.data(),
                             recv->displacements.data(), type, comm, &r),
              "MPI_Ialltoallv");
        return std::vector<MPI_Request>{r};
      },
      [=]() {
        unflat(*received, outputs);
        *laid_out = *received = at::Tensor();
      });
}

WorkPtr MpiBackend::barrier(const c10d::BarrierOptions& opts) {
  MPI_Comm comm = this->comm();
  return launch(c10d::OpType::BARRIER, "barrier", opts.timeout, {}, [=]() {
    MPI_Request r = MPI_REQUEST_NULL;
    check(MPI_Ibarrier(comm, &r), "MPI_Ibarrier");
    return std::vector<MPI_Request>{r};
  });
}

WorkPtr MpiBackend::send(std::vector<at::Tensor>& tensors, int dst_rank,
                         int tag) {
  const auto& t = single(tensors, "send");
  check_peer(dst_rank, size_, "send");
  const int n = count(t.numel(), "send");
  MPI_Comm comm = this->comm();
  return launch(c10d::OpType::SEND, "send", c10d::kUnsetTimeout, {t}, [=]() {
    MPI_Request r = MPI_REQUEST_NULL;
    check(MPI_Isend(t.data_ptr(), n, transport_type(t.scalar_type()), dst_rank,
                    tag, comm, &r),
          "MPI_Isend");
    return std::vector<MPI_Request>{r};
  });
}

WorkPtr MpiBackend::recv(std::vector<at::Tensor>& tensors, int src_rank,
                         int tag) {
  check_peer(src_rank, size_, "recv");
  const auto& t = single(tensors, "recv");
  const int n = count(t.numel(), "recv");
  MPI_Comm comm = this->comm();
  return launch(c10d::OpType::RECV, "recv", c10d::kUnsetTimeout, {t}, [=]() {
    MPI_Request r = MPI_REQUEST_NULL;
    check(MPI_Irecv(t.data_ptr(), n, transport_type(t.scalar_type()), src_rank,
                    tag, comm, &r),
          "MPI_Irecv");
    return std::vector<MPI_Request>{r};
  });
}

WorkPtr MpiBackend::recvAnysource(std::vector<at::Tensor>& tensors, int tag) {
  const auto& t = single(tensors, "recv");
  const int n = count(t.numel(), "recv");
  MPI_Comm comm = this->comm();
  return launch(c10d::OpType::RECVANYSOURCE, "recv", c10d::kUnsetTimeout, {t},
                [=]() {
                  MPI_Request r = MPI_REQUEST_NULL;
                  check(MPI_Irecv(t.data_ptr(), n,
                                  transport_type(t.scalar_type()),
                                  MPI_ANY_SOURCE, tag, comm, &r),
                        "MPI_Irecv");
                  return std::vector<MPI_Request>{r};
                });
}

} // namespace ddp_ext::process_groups::mpi
