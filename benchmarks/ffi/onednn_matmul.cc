// oneDNN's matmul PRIMITIVE (its brgemm kernels where the CPU has them) in float32 on one layer of a stacked
// operand, as an XLA FFI handler for benchmarks/gemm_shapes.py: the same products as ppojax's `dnnl_sgemm` handlers
// (ppojax/models/stacked_gemm.cc), through oneDNN's other API, to tell whether the API is what a CPU's GEMM rate
// turns on. Built on first use against the `onednn-cpu-gomp` wheel's libdnnl.so.3 (no headers in the wheel: the
// few C declarations used are copied here from oneDNN 3.2's dnnl.h / dnnl_types.h / dnnl_common_types.h).
#include <cstdint>
#include <map>
#include <mutex>
#include <tuple>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

extern "C" {
typedef struct dnnl_engine* dnnl_engine_t;
typedef struct dnnl_stream* dnnl_stream_t;
typedef struct dnnl_memory_desc* dnnl_memory_desc_t;
typedef const struct dnnl_memory_desc* const_dnnl_memory_desc_t;
typedef struct dnnl_primitive_desc* dnnl_primitive_desc_t;
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
int dnnl_matmul_primitive_desc_create(dnnl_primitive_desc_t* pd, dnnl_engine_t engine, const_dnnl_memory_desc_t src,
                                      const_dnnl_memory_desc_t weights, const_dnnl_memory_desc_t bias,
                                      const_dnnl_memory_desc_t dst, const void* attr);
int dnnl_primitive_desc_destroy(dnnl_primitive_desc_t pd);
int dnnl_primitive_create(dnnl_primitive_t* primitive, dnnl_primitive_desc_t pd);
int dnnl_memory_create(dnnl_memory_t* memory, const_dnnl_memory_desc_t md, dnnl_engine_t engine, void* handle);
int dnnl_memory_destroy(dnnl_memory_t memory);
int dnnl_primitive_execute(dnnl_primitive_t primitive, dnnl_stream_t stream, int nargs, const dnnl_exec_arg_t* args);
int dnnl_stream_wait(dnnl_stream_t stream);
}

namespace {
constexpr int kCpu = 1, kF32 = 3, kInOrder = 1, kArgSrc = 1, kArgDst = 17, kArgWeights = 33;

dnnl_engine_t Engine() {
  static dnnl_engine_t engine = [] {
    dnnl_engine_t e = nullptr;
    return dnnl_engine_create(&e, kCpu, 0) == 0 ? e : nullptr;
  }();
  return engine;
}

// [rows, cols] of a row-major buffer read as itself or transposed.
struct Desc {
  dnnl_memory_desc_t md = nullptr;
  Desc(int64_t rows, int64_t cols, bool transposed) {
    dnnl_dims_t dims = {transposed ? cols : rows, transposed ? rows : cols};
    dnnl_dims_t strides = {transposed ? 1 : cols, transposed ? cols : 1};
    dnnl_memory_desc_create_with_strides(&md, 2, dims, kF32, strides);
  }
  ~Desc() { dnnl_memory_desc_destroy(md); }
};

// One primitive per problem (M, N, K and the two transposes), made on first use: its creation (kernel generation)
// is not timed with the products.
struct Problem {
  Desc a, b, c;
  dnnl_primitive_t primitive = nullptr;
  Problem(int64_t a_rows, int64_t a_cols, bool ta, int64_t b_rows, int64_t b_cols, bool tb, int64_t m, int64_t n)
      : a(a_rows, a_cols, ta), b(b_rows, b_cols, tb), c(m, n, false) {
    dnnl_primitive_desc_t pd = nullptr;
    if (dnnl_matmul_primitive_desc_create(&pd, Engine(), a.md, b.md, nullptr, c.md, nullptr) == 0) {
      dnnl_primitive_create(&primitive, pd);
      dnnl_primitive_desc_destroy(pd);
    }
  }
};

std::mutex cache_lock;
std::map<std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t, bool, bool>, Problem*> cache;

Problem* Get(int64_t a_rows, int64_t a_cols, bool ta, int64_t b_rows, int64_t b_cols, bool tb, int64_t m, int64_t n) {
  std::lock_guard<std::mutex> hold(cache_lock);
  auto key = std::make_tuple(a_rows, a_cols, b_rows, b_cols, m, ta, tb);
  auto found = cache.find(key);
  if (found != cache.end()) return found->second;
  return cache[key] = new Problem(a_rows, a_cols, ta, b_rows, b_cols, tb, m, n);  // kept for the process
}
}  // namespace

// a: f32[P, Q]; stack: f32[L, R, C]; index: s32[] -> out: f32[M, N] = op(a) @ op(stack[i]), op the transpose where
// asked (a: M = Q, K = P; stack: K = C, N = R).
static ffi::Error ProductImpl(ffi::Buffer<ffi::F32> a, ffi::Buffer<ffi::F32> stack, ffi::Buffer<ffi::S32> index,
                              ffi::ResultBuffer<ffi::F32> out, int64_t transpose_a, int64_t transpose_b) {
  auto ad = a.dimensions(), sd = stack.dimensions();
  if (ad.size() != 2 || sd.size() != 3) return ffi::Error::InvalidArgument("onednn_matmul: a 2-d, stack 3-d");
  const int64_t i = index.typed_data()[0];
  if (i < 0 || i >= sd[0]) return ffi::Error::InvalidArgument("onednn_matmul: layer index out of range");
  const int64_t m = transpose_a ? ad[1] : ad[0], k = transpose_a ? ad[0] : ad[1];
  const int64_t n = transpose_b ? sd[1] : sd[2];
  if ((transpose_b ? sd[2] : sd[1]) != k) return ffi::Error::InvalidArgument("onednn_matmul: contraction sizes differ");
  Problem* p = Get(ad[0], ad[1], transpose_a, sd[1], sd[2], transpose_b, m, n);
  if (p->primitive == nullptr) return ffi::Error::Internal("onednn_matmul: no matmul primitive for this problem");
  thread_local dnnl_stream_t stream = [] {
    dnnl_stream_t s = nullptr;
    dnnl_stream_create(&s, Engine(), kInOrder);
    return s;
  }();
  dnnl_memory_t mem[3] = {nullptr, nullptr, nullptr};
  dnnl_memory_create(&mem[0], p->a.md, Engine(), const_cast<float*>(a.typed_data()));
  dnnl_memory_create(&mem[1], p->b.md, Engine(), const_cast<float*>(stack.typed_data()) + i * sd[1] * sd[2]);
  dnnl_memory_create(&mem[2], p->c.md, Engine(), out->typed_data());
  const dnnl_exec_arg_t args[3] = {{kArgSrc, mem[0]}, {kArgWeights, mem[1]}, {kArgDst, mem[2]}};
  const int status = dnnl_primitive_execute(p->primitive, stream, 3, args);
  dnnl_stream_wait(stream);
  for (auto* m_ : mem) dnnl_memory_destroy(m_);
  return status == 0 ? ffi::Error::Success() : ffi::Error::Internal("onednn_matmul: execution failed");
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(OnednnMatmul, ProductImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("transpose_a")
                                  .Attr<int64_t>("transpose_b"));
