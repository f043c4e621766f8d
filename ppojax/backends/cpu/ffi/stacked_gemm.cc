// A float32 GEMM on ONE layer of a stacked weight [L, R, C], read where it lies, as XLA FFI handlers for
// ppojax/backends/cpu/stacked_matmul.py, which builds this file on first use, once per GEMM library:
//   g++ -O2 -std=c++17 -shared -fPIC -I<jax.ffi.include_dir()> -I<ppojax/ffi> [-D...] stacked_gemm.cc -o ... LIB
// - by default oneDNN's `dnnl_sgemm` (LIB: the `onednn-cpu-gomp` wheel's libdnnl.so.3);
// - with PPOJAX_ONEDNN_PRIMITIVE, oneDNN's matmul primitive (its brgemm kernels where the CPU has them; one primitive
//   per problem, made on its first call and kept, each call on a scratchpad of its thread's own), same LIB;
// - with PPOJAX_FORTRAN_SGEMM, a Fortran BLAS's `sgemm_` (LIB: MKL, as torch's x86 wheels link it into
//   libtorch_cpu.so; LP64: 32-bit sizes).
// At a decode step's few token rows (at most kFewRows) the products skip the library: `FewRows` below.
// oneDNN's wheel has no headers: the few C declarations used are copied from oneDNN 3.2's dnnl.h / dnnl_types.h.
#include <immintrin.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <tuple>
#include <vector>

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

// Row-major C[M, N] = op(A) @ op(B) (op: the transpose where ta / tb is 'T'); lda, ldb, ldc: the row-major leading
// dimensions as stored (op(A) stored [M, K] or, transposed, [K, M]; likewise B). False when the library fails or a
// size does not fit it.
#if defined(PPOJAX_FORTRAN_SGEMM)
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
#elif defined(PPOJAX_ONEDNN_PRIMITIVE)
extern "C" {
typedef struct dnnl_engine* dnnl_engine_t;
typedef struct dnnl_stream* dnnl_stream_t;
typedef struct dnnl_memory_desc* dnnl_memory_desc_t;
typedef const struct dnnl_memory_desc* const_dnnl_memory_desc_t;
typedef struct dnnl_primitive_desc* dnnl_primitive_desc_t;
typedef const struct dnnl_primitive_desc* const_dnnl_primitive_desc_t;
typedef struct dnnl_primitive_attr* dnnl_primitive_attr_t;
typedef struct dnnl_primitive* dnnl_primitive_t;
typedef struct dnnl_memory* dnnl_memory_t;
typedef int64_t dnnl_dims_t[12];  // DNNL_MAX_NDIMS
typedef struct {
  int arg;
  dnnl_memory_t memory;
} dnnl_exec_arg_t;
int dnnl_engine_create(dnnl_engine_t* engine, int kind, size_t index);
int dnnl_stream_create(dnnl_stream_t* stream, dnnl_engine_t engine, unsigned flags);
int dnnl_memory_desc_create_with_strides(dnnl_memory_desc_t* md, int ndims, const dnnl_dims_t dims, int data_type,
                                         const dnnl_dims_t strides);
int dnnl_memory_desc_destroy(dnnl_memory_desc_t md);
int dnnl_primitive_attr_create(dnnl_primitive_attr_t* attr);
int dnnl_primitive_attr_set_scratchpad_mode(dnnl_primitive_attr_t attr, int mode);
int dnnl_primitive_attr_destroy(dnnl_primitive_attr_t attr);
int dnnl_matmul_primitive_desc_create(dnnl_primitive_desc_t* pd, dnnl_engine_t engine, const_dnnl_memory_desc_t src,
                                      const_dnnl_memory_desc_t weights, const_dnnl_memory_desc_t bias,
                                      const_dnnl_memory_desc_t dst, dnnl_primitive_attr_t attr);
const_dnnl_memory_desc_t dnnl_primitive_desc_query_md(const_dnnl_primitive_desc_t pd, int what, int index);
size_t dnnl_memory_desc_get_size(const_dnnl_memory_desc_t md);
int dnnl_primitive_desc_destroy(dnnl_primitive_desc_t pd);
int dnnl_primitive_create(dnnl_primitive_t* primitive, dnnl_primitive_desc_t pd);
int dnnl_memory_create(dnnl_memory_t* memory, const_dnnl_memory_desc_t md, dnnl_engine_t engine, void* handle);
int dnnl_memory_destroy(dnnl_memory_t memory);
int dnnl_primitive_execute(dnnl_primitive_t primitive, dnnl_stream_t stream, int nargs, const dnnl_exec_arg_t* args);
int dnnl_stream_wait(dnnl_stream_t stream);
}

namespace {
constexpr int kCpu = 1, kF32 = 3, kInOrder = 1, kArgSrc = 1, kArgDst = 17, kArgWeights = 33, kArgScratchpad = 80;
constexpr int kScratchpadUser = 1, kQueryScratchpadMd = 136;

dnnl_engine_t Engine() {
  static dnnl_engine_t engine = [] {
    dnnl_engine_t e = nullptr;
    return dnnl_engine_create(&e, kCpu, 0) == 0 ? e : nullptr;
  }();
  return engine;
}

// op(X) [rows, cols] of a row-major buffer stored as itself or, transposed, as [cols, rows].
struct Desc {
  dnnl_memory_desc_t md = nullptr;
  Desc(int64_t rows, int64_t cols, bool transposed) {
    dnnl_dims_t dims = {rows, cols};
    dnnl_dims_t strides = {transposed ? 1 : cols, transposed ? rows : 1};
    dnnl_memory_desc_create_with_strides(&md, 2, dims, kF32, strides);
  }
  ~Desc() { dnnl_memory_desc_destroy(md); }
};

// One primitive per problem, made on its first call and kept for the process (its description too: it holds the
// scratchpad's). XLA runs the handlers on several threads at once, and oneDNN's own scratchpad ("library" mode,
// shared by the primitives a thread made) is not safe for that: a primitive run on another thread than the one that
// made it, while that one runs too, writes over the other's partial results. So the scratchpad is the caller's
// ("user" mode): each thread passes its own (`Scratchpad`).
struct Problem {
  Desc a, b, c;
  dnnl_primitive_desc_t pd = nullptr;
  dnnl_primitive_t primitive = nullptr;
  const_dnnl_memory_desc_t scratchpad = nullptr;
  size_t scratchpad_bytes = 0;
  Problem(int64_t M, int64_t N, int64_t K, bool ta, bool tb) : a(M, K, ta), b(K, N, tb), c(M, N, false) {
    dnnl_primitive_attr_t attr = nullptr;
    if (Engine() == nullptr || dnnl_primitive_attr_create(&attr) != 0) return;
    if (dnnl_primitive_attr_set_scratchpad_mode(attr, kScratchpadUser) == 0 &&
        dnnl_matmul_primitive_desc_create(&pd, Engine(), a.md, b.md, nullptr, c.md, attr) == 0) {
      scratchpad = dnnl_primitive_desc_query_md(pd, kQueryScratchpadMd, 0);
      scratchpad_bytes = scratchpad == nullptr ? 0 : dnnl_memory_desc_get_size(scratchpad);
      if (dnnl_primitive_create(&primitive, pd) != 0) primitive = nullptr;
    }
    dnnl_primitive_attr_destroy(attr);
  }
};

// A thread's scratchpad for the primitives it runs, grown to the largest asked for and kept.
class Scratchpad {
 public:
  ~Scratchpad() { std::free(data_); }
  void* Get(size_t bytes) {
    if (bytes > size_) {
      std::free(data_);
      size_ = (bytes + kPage - 1) / kPage * kPage;
      data_ = std::aligned_alloc(kPage, size_);
      if (data_ == nullptr) size_ = 0;
    }
    return data_;
  }

 private:
  static constexpr size_t kPage = 4096;
  void* data_ = nullptr;
  size_t size_ = 0;
};

Problem* Get(int64_t M, int64_t N, int64_t K, bool ta, bool tb) {
  static std::mutex lock;
  static std::map<std::tuple<int64_t, int64_t, int64_t, bool, bool>, Problem*> cache;
  std::lock_guard<std::mutex> hold(lock);
  Problem*& p = cache[std::make_tuple(M, N, K, ta, tb)];
  if (p == nullptr) p = new Problem(M, N, K, ta, tb);
  return p;
}
}  // namespace

static bool Gemm(char ta, char tb, int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B,
                 int64_t ldb, float* C, int64_t ldc) {
  // the calls below pass packed operands: the leading dimensions follow from M, N, K
  if (lda != (ta == 'T' ? M : K) || ldb != (tb == 'T' ? K : N) || ldc != N) return false;
  Problem* p = Get(M, N, K, ta == 'T', tb == 'T');
  if (p->primitive == nullptr) return false;
  thread_local dnnl_stream_t stream = [] {
    dnnl_stream_t s = nullptr;
    dnnl_stream_create(&s, Engine(), kInOrder);
    return s;
  }();
  thread_local Scratchpad scratchpad;
  void* scratch = p->scratchpad_bytes > 0 ? scratchpad.Get(p->scratchpad_bytes) : nullptr;
  if (p->scratchpad_bytes > 0 && scratch == nullptr) return false;
  dnnl_memory_t mem[4] = {nullptr, nullptr, nullptr, nullptr};
  dnnl_memory_create(&mem[0], p->a.md, Engine(), const_cast<float*>(A));
  dnnl_memory_create(&mem[1], p->b.md, Engine(), const_cast<float*>(B));
  dnnl_memory_create(&mem[2], p->c.md, Engine(), C);
  const int nargs = scratch != nullptr ? 4 : 3;
  if (scratch != nullptr) dnnl_memory_create(&mem[3], p->scratchpad, Engine(), scratch);
  const dnnl_exec_arg_t args[4] = {{kArgSrc, mem[0]}, {kArgWeights, mem[1]}, {kArgDst, mem[2]},
                                   {kArgScratchpad, mem[3]}};
  const int status = dnnl_primitive_execute(p->primitive, stream, nargs, args);
  dnnl_stream_wait(stream);
  for (auto* m : mem)
    if (m != nullptr) dnnl_memory_destroy(m);
  return status == 0;
}
#else
extern "C" int dnnl_sgemm(char transa, char transb, int64_t M, int64_t N, int64_t K, float alpha, const float* A,
                          int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc);

static bool Gemm(char ta, char tb, int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B,
                 int64_t ldb, float* C, int64_t ldc) {
  return dnnl_sgemm(ta, tb, M, N, K, 1.0f, A, lda, B, ldb, 0.0f, C, ldc) == 0;
}
#endif

// ---- a decode step's products: few rows, bound by reading the weights ----
// At a few token rows a product does a few FMAs per weight it reads, so its time is the time to read the weights.
// A GEMM library packs them first and XLA copies the layer out of the stack, then reads the copy (both measured
// slower than these kernels there). These read each weight once,
// where it lies: the threads split the contraction into contiguous shares of w's rows, every accumulator stays in a
// register. AVX-512 or AVX2 (elsewhere `FewRowsKernels` says 0 and "auto" keeps XLA's dots at these rows).
namespace few_rows {
constexpr int kFewRows = 8;  // rows of x at most: one accumulator register each, plus the weights' vector
constexpr int kDepth = 16;   // rows of w per pass over the accumulators
// threads per product at most: the caller adds the others' partial sums alone, (shares - 1) * M * N additions that
// would outweigh the reading they share out on a many-core CPU
constexpr int kMaxShares = 4;

// y[R, N] = x[R, K] @ w[K, N] (x's leading dimension ldx; w and y packed row-major).
template <int R>
__attribute__((target("avx512f"))) void Rows(const float* __restrict x, int64_t ldx, const float* __restrict w,
                                             float* __restrict y, int64_t K, int64_t N) {
  for (int64_t kc = 0; kc < K; kc += kDepth) {
    const int64_t depth = std::min<int64_t>(kDepth, K - kc);
    for (int64_t j = 0; j < N; j += 16) {
      const __mmask16 mask = N - j >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (N - j)) - 1);
      __m512 acc[R];
      for (int m = 0; m < R; ++m) acc[m] = kc == 0 ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(mask, y + m * N + j);
      if (depth == kDepth) {  // unrolled
#pragma GCC unroll 16
        for (int kk = 0; kk < kDepth; ++kk) {
          const __m512 b = _mm512_maskz_loadu_ps(mask, w + (kc + kk) * N + j);
#pragma GCC unroll 8
          for (int m = 0; m < R; ++m) acc[m] = _mm512_fmadd_ps(_mm512_set1_ps(x[m * ldx + kc + kk]), b, acc[m]);
        }
      } else {
        for (int64_t kk = 0; kk < depth; ++kk) {
          const __m512 b = _mm512_maskz_loadu_ps(mask, w + (kc + kk) * N + j);
          for (int m = 0; m < R; ++m) acc[m] = _mm512_fmadd_ps(_mm512_set1_ps(x[m * ldx + kc + kk]), b, acc[m]);
        }
      }
      for (int m = 0; m < R; ++m) _mm512_mask_storeu_ps(y + m * N + j, mask, acc[m]);
    }
  }
}

// The same on AVX2 (8 floats a vector; the columns no vector fills, one at a time).
template <int R>
__attribute__((target("avx2,fma"))) void RowsAvx2(const float* __restrict x, int64_t ldx, const float* __restrict w,
                                                  float* __restrict y, int64_t K, int64_t N) {
  const int64_t full = N / 8 * 8;
  for (int64_t kc = 0; kc < K; kc += kDepth) {
    const int64_t depth = std::min<int64_t>(kDepth, K - kc);
    for (int64_t j = 0; j < full; j += 8) {
      __m256 acc[R];
      for (int m = 0; m < R; ++m) acc[m] = kc == 0 ? _mm256_setzero_ps() : _mm256_loadu_ps(y + m * N + j);
      if (depth == kDepth) {  // unrolled
#pragma GCC unroll 16
        for (int kk = 0; kk < kDepth; ++kk) {
          const __m256 b = _mm256_loadu_ps(w + (kc + kk) * N + j);
#pragma GCC unroll 8
          for (int m = 0; m < R; ++m) acc[m] = _mm256_fmadd_ps(_mm256_broadcast_ss(x + m * ldx + kc + kk), b, acc[m]);
        }
      } else {
        for (int64_t kk = 0; kk < depth; ++kk) {
          const __m256 b = _mm256_loadu_ps(w + (kc + kk) * N + j);
          for (int m = 0; m < R; ++m) acc[m] = _mm256_fmadd_ps(_mm256_broadcast_ss(x + m * ldx + kc + kk), b, acc[m]);
        }
      }
      for (int m = 0; m < R; ++m) _mm256_storeu_ps(y + m * N + j, acc[m]);
    }
    for (int64_t j = full; j < N; ++j)
      for (int m = 0; m < R; ++m) {
        float sum = kc == 0 ? 0.0f : y[m * N + j];
        for (int64_t kk = 0; kk < depth; ++kk) sum += x[m * ldx + kc + kk] * w[(kc + kk) * N + j];
        y[m * N + j] = sum;
      }
  }
}

// Rows<R> for a run-time R in [1, kFewRows].
template <int R, typename F>
void WithRows(int rows, F&& f) {
  if (rows == R) return f(std::integral_constant<int, R>());
  if constexpr (R > 1) WithRows<R - 1>(rows, f);
}

// The widest vectors this CPU has for the kernels: 16 floats (AVX-512), 8 (AVX2 with FMA) or 0 (none: the library's
// GEMM serves). PPOJAX_MAX_ISA_AVX2 / PPOJAX_MAX_ISA_BASELINE cap it below what the CPU has: builds for a CPU whose
// instruction sets ppojax's probe reports capped (ppojax/backends/cpu/capabilities.py, `build_defines`).
int Width() {
#if defined(PPOJAX_MAX_ISA_BASELINE)
  return 0;
#else
#if !defined(PPOJAX_MAX_ISA_AVX2)
  if (__builtin_cpu_supports("avx512f")) return 16;
#endif
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") ? 8 : 0;
#endif
}

bool Available() {
  static const bool available = Width() > 0;
  return available;
}

// y[R, N] = x[R, K] @ w[K, N] with this CPU's widest kernel (Available() first).
template <int R>
void RowsOnThisCpu(const float* x, int64_t ldx, const float* w, float* y, int64_t K, int64_t N) {
  static const bool avx512 = Width() == 16;
  avx512 ? Rows<R>(x, ldx, w, y, K, N) : RowsAvx2<R>(x, ldx, w, y, K, N);
}

using ppojax::Parallel;

// y[M, N] = x[M, K] @ w[K, N], M <= kFewRows, both packed row-major.
void Product(ffi::ThreadPool& pool, const float* x, const float* w, float* y, int64_t M, int64_t N, int64_t K) {
  if (K == 0) return std::fill(y, y + M * N, 0.0f);
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  // a share of the contraction each (rows of w, contiguous), its partial sums added at the end
  const int64_t depths = (K + kDepth - 1) / kDepth;
  const int shares = static_cast<int>(std::clamp<int64_t>(depths, 1, std::min<int64_t>(threads, kMaxShares)));
  std::vector<float> partial(static_cast<size_t>(shares - 1) * M * N);
  Parallel(pool, shares, [&](int i) {
    const int64_t k0 = depths * i / shares * kDepth, k1 = std::min<int64_t>(K, depths * (i + 1) / shares * kDepth);
    float* out = i == 0 ? y : partial.data() + static_cast<size_t>(i - 1) * M * N;
    WithRows<kFewRows>(M, [&](auto r) { RowsOnThisCpu<decltype(r)::value>(x + k0, K, w + k0 * N, out, k1 - k0, N); });
  });
  for (int i = 1; i < shares; ++i) {
    const float* p = partial.data() + static_cast<size_t>(i - 1) * M * N;
    for (int64_t j = 0; j < M * N; ++j) y[j] += p[j];
  }
}
}  // namespace few_rows

// The most token rows the few-rows kernels take on this CPU (0: none; the products then go to the library).
extern "C" int FewRowsKernels() { return few_rows::Available() ? few_rows::kFewRows : 0; }

// The layer a scalar index names, or -1 when it lies outside the stack's depth.
static int64_t Layer(ffi::Buffer<ffi::S32> index, int64_t layers) {
  const int64_t i = index.typed_data()[0];
  return (i < 0 || i >= layers) ? -1 : i;
}

// a: f32[M, K]; stack: f32[L, R, C]; index: s32[] -> out: f32[M, N] = a @ stack[i] (R = K, C = N) or, with
// transpose_w, a @ stack[i].T (C = K, R = N). The layer's weights are read where they lie: no copy.
static ffi::Error MatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> a, ffi::Buffer<ffi::F32> stack,
                             ffi::Buffer<ffi::S32> index, ffi::ResultBuffer<ffi::F32> out, int64_t transpose_w) {
  auto ad = a.dimensions(), sd = stack.dimensions();
  if (ad.size() != 2 || sd.size() != 3) return ffi::Error::InvalidArgument("stacked_gemm: a 2-d, stack 3-d");
  const int64_t layer = Layer(index, sd[0]);
  if (layer < 0) return ffi::Error::InvalidArgument("stacked_gemm: layer index out of range");
  const int64_t M = ad[0], K = ad[1], R = sd[1], C = sd[2];
  const int64_t N = transpose_w ? R : C;
  if ((transpose_w ? C : R) != K) return ffi::Error::InvalidArgument("stacked_gemm: contraction sizes differ");
  const float* w = stack.typed_data() + layer * R * C;
  if (M <= few_rows::kFewRows && !transpose_w && few_rows::Available()) {
    few_rows::Product(pool, a.typed_data(), w, out->typed_data(), M, N, K);
    return ffi::Error::Success();
  }
  if (!Gemm('N', transpose_w ? 'T' : 'N', M, N, K, a.typed_data(), K, w, C, out->typed_data(), N))
    return ffi::Error::Internal("stacked_gemm: the GEMM failed");
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(StackedMatmul, MatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
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
