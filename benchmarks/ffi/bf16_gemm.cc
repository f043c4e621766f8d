// oneDNN's bfloat16 GEMM (float32 accumulation and output) as an XLA FFI handler, for benchmarks.bf16_dots.
// Built on demand by that module: g++ -O2 -std=c++17 -shared -fPIC -I<jax.ffi.include_dir()> ... -ldnnl
// oneDNN comes from the `onednn-cpu-gomp` wheel (libdnnl.so only, no headers: the one C function used is
// declared here with the signature of oneDNN's dnnl.h).
#include <cstdint>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

extern "C" int dnnl_gemm_bf16bf16f32(char transa, char transb, int64_t M, int64_t N, int64_t K, float alpha,
                                     const void* A, int64_t lda, const void* B, int64_t ldb, float beta,
                                     float* C, int64_t ldc);

// a: bf16[M, K] ([K, M] when transpose_a), b: bf16[K, N] ([N, K] when transpose_b) -> c: f32[M, N], row-major.
static ffi::Error Bf16GemmImpl(ffi::Buffer<ffi::BF16> a, ffi::Buffer<ffi::BF16> b,
                               ffi::ResultBuffer<ffi::F32> c, int64_t transpose_a, int64_t transpose_b) {
  auto ad = a.dimensions(), bd = b.dimensions();
  if (ad.size() != 2 || bd.size() != 2) return ffi::Error::InvalidArgument("bf16_gemm: 2-d operands only");
  const int64_t M = transpose_a ? ad[1] : ad[0], K = transpose_a ? ad[0] : ad[1];
  const int64_t N = transpose_b ? bd[0] : bd[1];
  if ((transpose_b ? bd[1] : bd[0]) != K) return ffi::Error::InvalidArgument("bf16_gemm: contraction sizes differ");
  const int status = dnnl_gemm_bf16bf16f32(transpose_a ? 'T' : 'N', transpose_b ? 'T' : 'N', M, N, K, 1.0f,
                                           a.untyped_data(), ad[1], b.untyped_data(), bd[1], 0.0f,
                                           c->typed_data(), N);
  if (status != 0) return ffi::Error::Internal("dnnl_gemm_bf16bf16f32 failed");
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(Bf16Gemm, Bf16GemmImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("transpose_a")
                                  .Attr<int64_t>("transpose_b"));
