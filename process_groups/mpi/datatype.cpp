#include "process_groups/mpi/datatype.h"

#include <c10/util/Exception.h>

namespace ddp_ext::process_groups::mpi {

MPI_Datatype transport_type(at::ScalarType dtype) {
  switch (dtype) {
    case at::kByte:
      return MPI_UINT8_T;
    case at::kChar:
      return MPI_INT8_T;
    case at::kShort:
      return MPI_INT16_T;
    case at::kInt:
      return MPI_INT32_T;
    case at::kLong:
      return MPI_INT64_T;
    case at::kUInt16:
      return MPI_UINT16_T;
    case at::kUInt32:
      return MPI_UINT32_T;
    case at::kUInt64:
      return MPI_UINT64_T;
    case at::kFloat:
      return MPI_FLOAT;
    case at::kDouble:
      return MPI_DOUBLE;
    case at::kBool:
      return MPI_C_BOOL;
    case at::kComplexFloat:
      return MPI_C_FLOAT_COMPLEX;
    case at::kComplexDouble:
      return MPI_C_DOUBLE_COMPLEX;
    case at::kHalf:
    case at::kBFloat16:
      return MPI_UINT16_T; // See Note [MPI dtypes].
    default:
      TORCH_CHECK(
          false, "ddp_ext_mpi: MPI cannot carry tensors of dtype ", dtype,
          ". Supported: uint8, int8, int16, int32, int64, uint16, uint32, "
          "uint64, float16, bfloat16, float32, float64, complex64, "
          "complex128, bool. Convert the tensor to one of them first.");
  }
}

at::ScalarType reduction_dtype(at::ScalarType dtype) {
  return dtype == at::kHalf || dtype == at::kBFloat16 ? at::kFloat : dtype;
}

namespace {

[[noreturn]] void refuse(const char* op_name, at::ScalarType dtype,
                         const char* why) {
  TORCH_CHECK(false, "ddp_ext_mpi: cannot reduce tensors of dtype ", dtype,
              " with ReduceOp.", op_name, ": ", why);
}

} // namespace

Reduction reduction(const c10d::ReduceOp& op, at::ScalarType dtype) {
  transport_type(dtype); // refuses dtypes MPI cannot carry at all
  const bool is_bool = dtype == at::kBool;
  const bool is_complex = at::isComplexType(dtype);
  const bool is_floating = at::isFloatingType(dtype);
  switch (op.op_) {
    case c10d::ReduceOp::SUM:
      return {is_bool ? MPI_LOR : MPI_SUM, false};
    case c10d::ReduceOp::PRODUCT:
      return {is_bool ? MPI_LAND : MPI_PROD, false};
    case c10d::ReduceOp::MIN:
    case c10d::ReduceOp::MAX: {
      const bool is_min = op.op_ == c10d::ReduceOp::MIN;
      if (is_complex) {
        refuse(is_min ? "MIN" : "MAX", dtype,
               "complex numbers have no order (MPI defines MIN and MAX on "
               "real types only).");
      }
      if (is_bool) {
        return {is_min ? MPI_LAND : MPI_LOR, false};
      }
      return {is_min ? MPI_MIN : MPI_MAX, false};
    }
    case c10d::ReduceOp::AVG:
      if (!is_floating && !is_complex) {
        refuse("AVG", dtype,
               "an average needs a floating-point or complex dtype; use SUM "
               "and divide yourself.");
      }
      return {MPI_SUM, true};
    case c10d::ReduceOp::BAND:
    case c10d::ReduceOp::BOR:
    case c10d::ReduceOp::BXOR: {
      const char* name = op.op_ == c10d::ReduceOp::BAND ? "BAND"
          : op.op_ == c10d::ReduceOp::BOR             ? "BOR"
                                                      : "BXOR";
      if (is_floating || is_complex) {
        refuse(name, dtype, "bitwise operations need an integer or bool dtype.");
      }
      if (is_bool) {
        return {op.op_ == c10d::ReduceOp::BAND ? MPI_LAND
                    : op.op_ == c10d::ReduceOp::BOR ? MPI_LOR
                                                    : MPI_LXOR,
                false};
      }
      return {op.op_ == c10d::ReduceOp::BAND ? MPI_BAND
                  : op.op_ == c10d::ReduceOp::BOR ? MPI_BOR
                                                  : MPI_BXOR,
              false};
    }
    default:
      TORCH_CHECK(false, "ddp_ext_mpi: ReduceOp ", static_cast<int>(op.op_),
                  " (PREMUL_SUM or unknown) is not supported; use SUM, "
                  "PRODUCT, MIN, MAX, AVG, BAND, BOR or BXOR.");
  }
}

} // namespace ddp_ext::process_groups::mpi
