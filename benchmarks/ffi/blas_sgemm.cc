// A Fortran BLAS's float32 GEMM (`sgemm_`) on one layer of a stacked operand, as an XLA FFI handler for
// benchmarks/gemm_shapes.py's `mkl` column: the products of ppojax's in-place handlers (ppojax/models/stacked_gemm.cc)
// through the library TRL's step runs them with, MKL, as torch's x86 wheels carry it (libtorch_cpu.so exports MKL's
// `sgemm_`; LP64: 32-bit sizes). Built on first use, linked against that library; same interface as
// onednn_matmul.cc's handler.
#include <cstdint>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

extern "C" void sgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k,
                       const float* alpha, const float* a, const int* lda, const float* b, const int* ldb,
                       const float* beta, float* c, const int* ldc);

// a: f32[P, Q]; stack: f32[L, R, C]; index: s32[] -> out: f32[M, N] = op(a) @ op(stack[i]), op the transpose where
// asked (a: M = Q, K = P; stack: K = C, N = R). Row-major C = op(A) op(B) is column-major C' = op(B)' op(A)'.
static ffi::Error ProductImpl(ffi::Buffer<ffi::F32> a, ffi::Buffer<ffi::F32> stack, ffi::Buffer<ffi::S32> index,
                              ffi::ResultBuffer<ffi::F32> out, int64_t transpose_a, int64_t transpose_b) {
  auto ad = a.dimensions(), sd = stack.dimensions();
  if (ad.size() != 2 || sd.size() != 3) return ffi::Error::InvalidArgument("blas_sgemm: a 2-d, stack 3-d");
  const int64_t i = index.typed_data()[0];
  if (i < 0 || i >= sd[0]) return ffi::Error::InvalidArgument("blas_sgemm: layer index out of range");
  const int m = transpose_a ? ad[1] : ad[0], k = transpose_a ? ad[0] : ad[1];
  const int n = transpose_b ? sd[1] : sd[2];
  if ((transpose_b ? sd[2] : sd[1]) != k) return ffi::Error::InvalidArgument("blas_sgemm: contraction sizes differ");
  const int lda = ad[1], ldb = sd[2], ldc = n;  // the row-major leading dimensions as stored
  const char ta = transpose_a ? 'T' : 'N', tb = transpose_b ? 'T' : 'N';
  const float one = 1.0f, zero = 0.0f;
  const float* b = stack.typed_data() + i * sd[1] * sd[2];
  sgemm_(&tb, &ta, &n, &m, &k, &one, b, &ldb, a.typed_data(), &lda, &zero, out->typed_data(), &ldc);
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(BlasSgemm, ProductImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("transpose_a")
                                  .Attr<int64_t>("transpose_b"));
