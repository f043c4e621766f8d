// AdamW's step in ONE pass over each float32 parameter, as an XLA FFI handler for ppojax/backends/cpu/adam_in_place.py, which
// builds this file on first use:
//   g++ -O2 -std=c++17 -shared -fPIC -O3 -fno-math-errno -ffp-contract=off -I<jax.ffi.include_dir()>
//       -I<ppojax/ffi> adam_in_place.cc -o ...
// XLA:CPU runs optax's AdamW as three loops per parameter (the first moment, the second moment, the parameter:
// 40 bytes read or written per parameter); this reads p, g, m, v once and writes p, m, v in place (28 bytes).
// The arithmetic is optax's (clip_by_global_norm, scale_by_adam, add_decayed_weights, then p - lr * u), operation
// by operation, each rounded to float32 (-ffp-contract=off: no fused multiply-adds; XLA fuses some, so the two agree
// to a few units in the last place). The scalars that depend on the step (the learning rates, the bias
// corrections, the gradients' global norm) come in computed by optax's own expressions.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

struct Hyper {
  float b1, one_minus_b1, b2, one_minus_b2, eps, weight_decay, max_norm;
};

struct Step {  // this step's scalars (lr: the leaf's own, the policy's or the critic's)
  float lr, bias_correction1, bias_correction2, grad_norm;
  bool clip;
};

struct Leaf {  // p, m and v are read and written in place; four distinct buffers
  float* p;
  const float* g;
  float *m, *v;
  int64_t n;
  float lr;
};

// One stretch of one leaf, with or without clipping and weight decay (a loop each: GCC vectorises neither test
// inside one loop).
template <bool kClip, bool kDecay>
__attribute__((always_inline)) inline void Stretch(float* __restrict p, const float* __restrict g_in,
                                                   float* __restrict m_in, float* __restrict v_in, int64_t n,
                                                   const Hyper h, const Step s) {
  for (int64_t i = 0; i < n; ++i) {
    float g = g_in[i];
    if (kClip) g = (g / s.grad_norm) * h.max_norm;  // optax: select(norm < max_norm, g, (g / norm) * max_norm)
    const float m = h.one_minus_b1 * g + h.b1 * m_in[i];
    const float v = h.one_minus_b2 * (g * g) + h.b2 * v_in[i];
    // optax adds eps_root (0 in AdamW) under the root: v is never -0, so sqrt(v + 0) is sqrt(v)
    float u = (m / s.bias_correction1) / (std::sqrt(v / s.bias_correction2) + h.eps);
    if (kDecay) u = u + h.weight_decay * p[i];
    p[i] = p[i] - s.lr * u;
    m_in[i] = m;
    v_in[i] = v;
  }
}

// Elements [begin, end) of a leaf. Vectorised per instruction set (a clone each, chosen when the library loads);
// PPOJAX_MAX_ISA_AVX2 / PPOJAX_MAX_ISA_BASELINE leave out the clones above a capped probe's instruction sets
// (ppojax/backends/cpu/capabilities.py, `build_defines`).
#if defined(PPOJAX_MAX_ISA_BASELINE)
#define PPOJAX_UPDATE_CLONES "default"
#elif defined(PPOJAX_MAX_ISA_AVX2)
#define PPOJAX_UPDATE_CLONES "avx2", "default"
#else
#define PPOJAX_UPDATE_CLONES "avx512f", "avx2", "default"
#endif
__attribute__((target_clones(PPOJAX_UPDATE_CLONES))) void Update(const Leaf& l, int64_t begin, int64_t end,
                                                                        const Hyper h, const Step s) {
  const bool decay = h.weight_decay != 0.0f;  // optax skips a zero decay: u + 0 * p would turn -0 into +0
  float* p = l.p + begin;
  const float* g = l.g + begin;
  float *m = l.m + begin, *v = l.v + begin;
  const int64_t n = end - begin;
  if (s.clip)
    decay ? Stretch<true, true>(p, g, m, v, n, h, s) : Stretch<true, false>(p, g, m, v, n, h, s);
  else
    decay ? Stretch<false, true>(p, g, m, v, n, h, s) : Stretch<false, false>(p, g, m, v, n, h, s);
}

constexpr int64_t kStretch = 1 << 16;  // elements per unit of work: 256 KiB of each buffer

// args: scalars f32[5] {lr, critic_lr, bias_correction1, bias_correction2, grad_norm}, flags s32[2] {clip,
// frozen}, then p, g, m, v of each leaf; rets: p, m, v of each leaf (aliased to the args). frozen_leaves: 1 for
// each leaf kept as it is while `frozen` (the policy's), else 0. critic_leaves: 1 for each leaf stepped by
// critic_lr (the critic's, when it has a learning rate of its own), else 0 (lr).
ffi::Error AdamImpl(ffi::ThreadPool pool, ffi::RemainingArgs args, ffi::RemainingRets rets, float b1,
                    float one_minus_b1, float b2, float one_minus_b2, float eps, float weight_decay,
                    float max_norm, ffi::Span<const int64_t> frozen_leaves, ffi::Span<const int64_t> critic_leaves) {
  auto scalars = args.get<ffi::Buffer<ffi::F32>>(0);
  auto flags = args.get<ffi::Buffer<ffi::S32>>(1);
  if (scalars.has_error() || flags.has_error() || scalars->element_count() != 5 || flags->element_count() != 2)
    return ffi::Error::InvalidArgument("adam_in_place: the scalars f32[5] and flags s32[2] come first");
  const size_t leaves = (args.size() - 2) / 4;
  if (args.size() != 2 + 4 * leaves || rets.size() != 3 * leaves || frozen_leaves.size() != leaves ||
      critic_leaves.size() != leaves)
    return ffi::Error::InvalidArgument("adam_in_place: p, g, m, v per leaf in, p, m, v per leaf out");
  const float* s = scalars->typed_data();
  const float lr = s[0], critic_lr = s[1];
  const Step step{lr, s[2], s[3], s[4], flags->typed_data()[0] != 0};
  const bool frozen = flags->typed_data()[1] != 0;
  const Hyper hyper{b1, one_minus_b1, b2, one_minus_b2, eps, weight_decay, max_norm};

  std::vector<Leaf> updated;
  std::vector<std::pair<size_t, int64_t>> stretches;  // (leaf, first element)
  for (size_t i = 0; i < leaves; ++i) {
    auto p = args.get<ffi::Buffer<ffi::F32>>(2 + 4 * i), g = args.get<ffi::Buffer<ffi::F32>>(3 + 4 * i);
    auto m = args.get<ffi::Buffer<ffi::F32>>(4 + 4 * i), v = args.get<ffi::Buffer<ffi::F32>>(5 + 4 * i);
    auto p_out = rets.get<ffi::Buffer<ffi::F32>>(3 * i), m_out = rets.get<ffi::Buffer<ffi::F32>>(3 * i + 1);
    auto v_out = rets.get<ffi::Buffer<ffi::F32>>(3 * i + 2);
    if (p.has_error() || g.has_error() || m.has_error() || v.has_error() || p_out.has_error() || m_out.has_error() ||
        v_out.has_error())
      return ffi::Error::InvalidArgument("adam_in_place: every buffer is float32");
    const int64_t n = p->element_count();
    for (int64_t count : {g->element_count(), m->element_count(), v->element_count(), (*p_out)->element_count(),
                          (*m_out)->element_count(), (*v_out)->element_count()})
      if (count != n) return ffi::Error::InvalidArgument("adam_in_place: a leaf's p, g, m, v differ in size");
    // XLA hands the aliased results the arguments' buffers (copying first where it must); were one not, the
    // result starts as a copy of the argument and is updated where it lies
    float *p_at = (*p_out)->typed_data(), *m_at = (*m_out)->typed_data(), *v_at = (*v_out)->typed_data();
    for (auto [from, to] : {std::pair{p->typed_data(), p_at}, std::pair{m->typed_data(), m_at},
                            std::pair{v->typed_data(), v_at}})
      if (from != to) std::copy_n(from, n, to);
    if (frozen && frozen_leaves[i]) continue;  // kept as it is (the policy's, during the critic's warm-up)
    const Leaf leaf{p_at, g->typed_data(), m_at, v_at, n, critic_leaves[i] ? critic_lr : lr};
    for (int64_t first = 0; first < n; first += kStretch) stretches.emplace_back(updated.size(), first);
    updated.push_back(leaf);
  }
  if (stretches.empty()) return ffi::Error::Success();
  // a few shares per thread, each a run of consecutive stretches (leaves differ in size by 10,000x)
  const int64_t threads = std::max<int64_t>(1, pool.num_threads() + 1);
  const int shares = static_cast<int>(std::min<int64_t>(4 * threads, stretches.size()));
  ppojax::Parallel(pool, shares, [&](int share) {
    const size_t first = stretches.size() * share / shares, last = stretches.size() * (share + 1) / shares;
    for (size_t k = first; k < last; ++k) {
      const Leaf& leaf = updated[stretches[k].first];
      const int64_t begin = stretches[k].second;
      Step leaf_step = step;
      leaf_step.lr = leaf.lr;
      Update(leaf, begin, std::min(leaf.n, begin + kStretch), hyper, leaf_step);
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(AdamInPlace, AdamImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<float>("b1")
                                  .Attr<float>("one_minus_b1")
                                  .Attr<float>("b2")
                                  .Attr<float>("one_minus_b2")
                                  .Attr<float>("eps")
                                  .Attr<float>("weight_decay")
                                  .Attr<float>("max_norm")
                                  .Attr<ffi::Span<const int64_t>>("frozen_leaves")
                                  .Attr<ffi::Span<const int64_t>>("critic_leaves"));
