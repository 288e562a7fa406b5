#pragma once

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include "process_groups/mpi/runtime.h"

namespace ddp_ext::process_groups::mpi {

// Note [MPI dtypes]
// ~~~~~~~~~~~~~~~~~
// Each torch dtype travels as the MPI type of the same representation
// (float32 as MPI_FLOAT, int64 as MPI_INT64_T, bool as MPI_C_BOOL, complex64
// as MPI_C_FLOAT_COMPLEX, ...). float16 and bfloat16 have no MPI type: they
// travel as 16-bit words, bit for bit, and are reduced in float32 (each
// rank's values widened exactly, the result rounded once), as one rounding
// of an exact sum is what a reduction of two values in 16 bits gives too.
// Other dtypes (float8, quantized, complex32, ...) are refused by name.
//
// Reductions map to MPI's own operations: SUM, PRODUCT, MIN, MAX, BAND, BOR,
// BXOR. AVG, which MPI lacks, is a SUM divided by the group size afterwards,
// for floating-point and complex dtypes only (as NCCL). MPI defines MIN and
// MAX on neither complex nor bool, nor bitwise operations on floats: those
// combinations are refused before anything is sent. On bool, SUM and MAX are
// a logical or, PRODUCT and MIN a logical and (what they mean for 0 and 1).

// The MPI type `dtype` travels as; throws naming the dtype if there is none.
MPI_Datatype transport_type(at::ScalarType dtype);

// The dtype a reduction over `dtype` is computed in: float32 for float16 and
// bfloat16, `dtype` itself otherwise.
at::ScalarType reduction_dtype(at::ScalarType dtype);

// The MPI operation for `op` on `dtype` (a reduction dtype), and whether the
// result must then be divided by the group size (AVG). Throws, naming both,
// for a combination MPI does not define.
struct Reduction {
  MPI_Op op;
  bool divide_by_size;
};
Reduction reduction(const c10d::ReduceOp& op, at::ScalarType dtype);

} // namespace ddp_ext::process_groups::mpi
