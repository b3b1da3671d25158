// The element loop of FusedAdamW and its split over threads (see adamw_kernel.h).
//
// The loop is plain C++ that the compiler vectorizes: this file is compiled with
// -fno-math-errno (src/optim/CMakeLists.txt), without which a sqrt may set errno and the loop
// stays scalar, and without fused multiply-adds, to round like ATen. On x86-64 it is compiled
// twice, for the baseline (SSE2, 4 floats at a time) and for AVX2 (8), and the second is used
// when the CPU has it, as LibTorch's own kernels do. The choice is made here by testing the
// CPU's features, not with target_clones("arch=haswell"), whose dispatcher picks that copy on
// Haswell CPUs only.
#include "src/optim/adamw_kernel.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define FSDP_ADAMW_X86_DISPATCH 1
#define FSDP_ADAMW_TARGET_AVX2 __attribute__((target("avx2")))
#else
#define FSDP_ADAMW_X86_DISPATCH 0
#endif

#if defined(__GNUC__) || defined(__clang__)
#define FSDP_ADAMW_ALWAYS_INLINE inline __attribute__((always_inline))
#define FSDP_ADAMW_RESTRICT __restrict__
#else
#define FSDP_ADAMW_ALWAYS_INLINE inline
#define FSDP_ADAMW_RESTRICT
#endif

namespace fsdp {
namespace optim {
namespace detail {
namespace {

// Elements per task of at::parallel_for: below this a run is updated on the calling thread,
// where waking other threads would cost more than it saves.
constexpr int64_t kGrainSize = 32768;

// The compiler's own sqrt: it becomes one instruction in either copy of the loop, whatever the
// standard library's std::sqrt is declared with.
FSDP_ADAMW_ALWAYS_INLINE float square_root(float x) { return __builtin_sqrtf(x); }
FSDP_ADAMW_ALWAYS_INLINE double square_root(double x) { return __builtin_sqrt(x); }

// restrict: the buffers of a span never overlap (adamw_kernel.h), which lets the compiler
// vectorize without checking that at run time.
template <typename T, bool kAmsgrad>
FSDP_ADAMW_ALWAYS_INLINE void update_elements(T* FSDP_ADAMW_RESTRICT param, const T* FSDP_ADAMW_RESTRICT grad,
                                              T* FSDP_ADAMW_RESTRICT exp_avg, T* FSDP_ADAMW_RESTRICT exp_avg_sq,
                                              T* FSDP_ADAMW_RESTRICT max_exp_avg_sq, int64_t n,
                                              const AdamWCoefficients& c) {
  // Rounded to T once, into locals: like ATen's scalar operands, and so that the compiler sees
  // they cannot change while the loop stores through the pointers.
  const T decay = static_cast<T>(c.weight_decay_factor);
  const T beta1 = static_cast<T>(c.beta1);
  const T one_minus_beta1 = static_cast<T>(1 - c.beta1);
  const T beta2 = static_cast<T>(c.beta2);
  const T one_minus_beta2 = static_cast<T>(1 - c.beta2);
  // A multiplication where AdamW divides by sqrt(bias_correction2): one division fewer per
  // element (the loop is bound by its divisions and square roots when the data is in cache),
  // at the price of at most an ulp in the denominator.
  const T inverse_sqrt_bias_correction2 = static_cast<T>(1 / c.sqrt_bias_correction2);
  const T eps = static_cast<T>(c.eps);
  const T negative_step_size = static_cast<T>(c.negative_step_size);
  for (int64_t i = 0; i < n; ++i) {
    const T g = grad[i];
    const T decayed = param[i] * decay;
    const T m = exp_avg[i] * beta1 + one_minus_beta1 * g;
    const T v = exp_avg_sq[i] * beta2 + one_minus_beta2 * g * g;
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
    T second_moment = v;
    if (kAmsgrad) {
      // torch::max_out's NaN rule: a NaN on either side wins.
      const T previous = max_exp_avg_sq[i];
      second_moment = (v > previous || v != v) ? v : previous;
      max_exp_avg_sq[i] = second_moment;
    }
    const T denom = square_root(second_moment) * inverse_sqrt_bias_correction2 + eps;
    param[i] = decayed + negative_step_size * m / denom;
  }
}

template <typename T>
FSDP_ADAMW_ALWAYS_INLINE void update_span_range(const AdamWSpan& span, int64_t begin, int64_t n) {
  T* param = static_cast<T*>(span.param) + begin;
  const T* grad = static_cast<const T*>(span.grad) + begin;
  T* exp_avg = static_cast<T*>(span.exp_avg) + begin;
  T* exp_avg_sq = static_cast<T*>(span.exp_avg_sq) + begin;
  if (span.max_exp_avg_sq != nullptr) {
    T* max_exp_avg_sq = static_cast<T*>(span.max_exp_avg_sq) + begin;
    update_elements<T, true>(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, n, span.coefficients);
  } else {
    update_elements<T, false>(param, grad, exp_avg, exp_avg_sq, nullptr, n, span.coefficients);
  }
}

using RangeUpdate = void (*)(const AdamWSpan& span, int64_t begin, int64_t n);

template <typename T>
void update_range_baseline(const AdamWSpan& span, int64_t begin, int64_t n) {
  update_span_range<T>(span, begin, n);
}

#if FSDP_ADAMW_X86_DISPATCH
template <typename T>
FSDP_ADAMW_TARGET_AVX2 void update_range_avx2(const AdamWSpan& span, int64_t begin, int64_t n) {
  update_span_range<T>(span, begin, n);
}

bool cpu_has_avx2() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2");
}
#endif

// The copy of the loop for `T` that this CPU runs best, chosen once.
template <typename T>
RangeUpdate range_update_for_this_cpu() {
#if FSDP_ADAMW_X86_DISPATCH
  static const bool avx2 = cpu_has_avx2();
  if (avx2) return &update_range_avx2<T>;
#endif
  return &update_range_baseline<T>;
}

}  // namespace

void adamw_update(c10::ScalarType dtype, const std::vector<AdamWSpan>& spans) {
  TORCH_CHECK(dtype == c10::kFloat || dtype == c10::kDouble, "adamw_update: float or double only, got ", dtype);
  // Span i covers elements [first[i], first[i + 1]) of the run's common index space.
  std::vector<int64_t> first(spans.size() + 1, 0);
  for (size_t i = 0; i < spans.size(); ++i) first[i + 1] = first[i] + spans[i].numel;
  const RangeUpdate update_range =
      dtype == c10::kFloat ? range_update_for_this_cpu<float>() : range_update_for_this_cpu<double>();
  at::parallel_for(0, first.back(), kGrainSize, [&](int64_t begin, int64_t end) {
    size_t i = static_cast<size_t>(std::upper_bound(first.begin(), first.end(), begin) - first.begin()) - 1;
    for (; begin < end; ++i) {
      const int64_t stop = std::min(end, first[i + 1]);
      if (stop > begin) update_range(spans[i], begin - first[i], stop - begin);
      begin = stop;
    }
  });
}

}  // namespace detail
}  // namespace optim
}  // namespace fsdp
