// A float32 GEMM on ONE layer of a stacked weight [L, R, C], read where it lies, as XLA FFI handlers for
// ppojax/models/stacked_matmul.py, which builds this file on first use, once per GEMM library:
//   g++ -O2 -std=c++17 -shared -fPIC -I<jax.ffi.include_dir()> [-DPPOJAX_FORTRAN_SGEMM] stacked_gemm.cc -o ... LIB
// oneDNN's `dnnl_sgemm` (LIB: the `onednn-cpu-gomp` wheel's libdnnl.so.3: no headers in the wheel, the one function
// used is declared here with the signature of oneDNN's dnnl.h) or, with PPOJAX_FORTRAN_SGEMM, a Fortran BLAS's
// `sgemm_` (LIB: MKL, as torch's x86 wheels link it into libtorch_cpu.so; LP64: 32-bit sizes).
#include <climits>
#include <cstdint>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

// Row-major C[M, N] = op(A) @ op(B) (op: the transpose where ta / tb is 'T'); lda, ldb, ldc: the row-major leading
// dimensions as stored. False when the library fails or a size does not fit it.
#ifdef PPOJAX_FORTRAN_SGEMM
extern "C" void sgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k,
                       const float* alpha, const float* a, const int* lda, const float* b, const int* ldb,
                       const float* beta, float* c, const int* ldc);

static bool Gemm(char ta, char tb, int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B,
                 int64_t ldb, float* C, int64_t ldc) {
  for (int64_t size : {M, N, K, lda, ldb, ldc})
    if (size > INT_MAX) return false;
  const int m = M, n = N, k = K, la = lda, lb = ldb, lc = ldc;
  const float one = 1.0f, zero = 0.0f;
  // column-major, the same memory: C' = op(B)' @ op(A)'
  sgemm_(&tb, &ta, &n, &m, &k, &one, B, &lb, A, &la, &zero, C, &lc);
  return true;
}
#else
extern "C" int dnnl_sgemm(char transa, char transb, int64_t M, int64_t N, int64_t K, float alpha, const float* A,
                          int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc);

static bool Gemm(char ta, char tb, int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B,
                 int64_t ldb, float* C, int64_t ldc) {
  return dnnl_sgemm(ta, tb, M, N, K, 1.0f, A, lda, B, ldb, 0.0f, C, ldc) == 0;
}
#endif

// The layer a scalar index names, or -1 when it lies outside the stack's depth.
static int64_t Layer(ffi::Buffer<ffi::S32> index, int64_t layers) {
  const int64_t i = index.typed_data()[0];
  return (i < 0 || i >= layers) ? -1 : i;
}

// a: f32[M, K]; stack: f32[L, R, C]; index: s32[] -> out: f32[M, N] = a @ stack[i] (R = K, C = N) or, with
// transpose_w, a @ stack[i].T (C = K, R = N). The layer's weights are read where they lie: no copy.
static ffi::Error MatmulImpl(ffi::Buffer<ffi::F32> a, ffi::Buffer<ffi::F32> stack, ffi::Buffer<ffi::S32> index,
                             ffi::ResultBuffer<ffi::F32> out, int64_t transpose_w) {
  auto ad = a.dimensions(), sd = stack.dimensions();
  if (ad.size() != 2 || sd.size() != 3) return ffi::Error::InvalidArgument("stacked_gemm: a 2-d, stack 3-d");
  const int64_t layer = Layer(index, sd[0]);
  if (layer < 0) return ffi::Error::InvalidArgument("stacked_gemm: layer index out of range");
  const int64_t M = ad[0], K = ad[1], R = sd[1], C = sd[2];
  const int64_t N = transpose_w ? R : C;
  if ((transpose_w ? C : R) != K) return ffi::Error::InvalidArgument("stacked_gemm: contraction sizes differ");
  const float* w = stack.typed_data() + layer * R * C;
  if (!Gemm('N', transpose_w ? 'T' : 'N', M, N, K, a.typed_data(), K, w, C, out->typed_data(), N))
    return ffi::Error::Internal("stacked_gemm: the GEMM failed");
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(StackedMatmul, MatmulImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("transpose_w"));

// x: f32[T, K]; g: f32[T, N] -> out: f32[K, N] = x.T @ g (one layer's weight gradient, in a buffer of its own).
static ffi::Error WeightGradOutImpl(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> g,
                                    ffi::ResultBuffer<ffi::F32> out) {
  auto xd = x.dimensions(), gd = g.dimensions();
  if (xd.size() != 2 || gd.size() != 2 || xd[0] != gd[0])
    return ffi::Error::InvalidArgument("stacked_gemm: weight-gradient shapes differ");
  const int64_t T = xd[0], K = xd[1], N = gd[1];
  if (!Gemm('T', 'N', K, N, T, x.typed_data(), K, g.typed_data(), N, out->typed_data(), N))
    return ffi::Error::Internal("stacked_gemm: the GEMM failed");
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(WeightGradOut, WeightGradOutImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
