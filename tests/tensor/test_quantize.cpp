// The quantized collectives' codec (src/tensor/quantize.h), in one process: the CPU loops against
// the ATen form byte for byte, every decoded element within half of its own block's scale (the
// scale recomputed here from the block's values, so a scale taken from the wrong block fails),
// error feedback losing nothing over steps, and the edge cases (partial last block, zeros,
// non-finite values, bf16).
#include "src/tensor/quantize.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

namespace {

using fsdp::QuantizedComm;
using fsdp::QuantizedDtype;
using fsdp::detail::decode;
using fsdp::detail::decode_reference;
using fsdp::detail::encode;
using fsdp::detail::encode_reference;
using fsdp::detail::encoded_bytes;

at::Tensor bytes_for(int64_t n, const QuantizedComm& f) { return at::empty({encoded_bytes(n, f)}, at::kByte); }

// Values whose blocks differ in magnitude, so that one block's scale is wrong for its neighbour.
at::Tensor varied(int64_t n, uint64_t seed) {
  at::manual_seed(seed);
  at::Tensor x = at::randn({n});
  return x * at::linspace(0.01, 3.0, n).pow(2);
}

at::Tensor round_trip(const at::Tensor& x, const QuantizedComm& f) {
  at::Tensor b = bytes_for(x.numel(), f);
  encode(x, b, f);
  at::Tensor y = at::empty({x.numel()});
  decode(b, y, f);
  return y;
}

TEST(Quantize, CpuLoopsMatchTheAtenFormByteForByte) {
  for (QuantizedDtype dtype : {QuantizedDtype::kInt8, QuantizedDtype::kFloat8E4M3}) {
    for (int64_t block : {16, 256}) {
      for (int64_t n : {1, 15, 16, 255, 256, 257, 1000}) {
        for (at::ScalarType src_dtype : {at::kFloat, at::kBFloat16}) {
          for (bool feedback : {false, true}) {
            SCOPED_TRACE(std::string(fsdp::to_string(dtype)) + " block " + std::to_string(block) + " n " +
                         std::to_string(n) + " " + c10::toString(src_dtype) + (feedback ? " with residual" : ""));
            const QuantizedComm f = QuantizedComm().dtype(dtype).block_size(block);
            const at::Tensor x = varied(n, 7 + n).to(src_dtype);
            const at::Tensor r0 = feedback ? at::randn({n}) * 0.01 : at::Tensor();
            at::Tensor r_loop = feedback ? r0.clone() : at::Tensor(), r_ref = feedback ? r0.clone() : at::Tensor();
            at::Tensor b_loop = bytes_for(n, f), b_ref = bytes_for(n, f);
            encode(x, b_loop, f, r_loop);
            encode_reference(x, b_ref, f, r_ref);
            ASSERT_TRUE(at::equal(b_loop, b_ref));
            if (feedback) {
              ASSERT_TRUE(at::equal(r_loop, r_ref));
            }
            at::Tensor y_loop = at::full({n}, 2.0f), y_ref = at::full({n}, 2.0f);
            decode(b_loop, y_loop, f, /*accumulate=*/true);
            decode_reference(b_ref, y_ref, f, /*accumulate=*/true);
            ASSERT_TRUE(at::equal(y_loop, y_ref));
          }
        }
      }
    }
  }
}

// Each element is within half a scale of its value, the scale being its own block's largest
// magnitude / 127, recomputed here. A decoder that read the next block's scale, or an encoder that
// wrote it there, breaks this for the blocks whose magnitudes differ.
TEST(Quantize, Int8ElementsAreWithinHalfTheirOwnBlocksScale) {
  for (int64_t block : {16, 64, 256}) {
    const int64_t n = 20 * block + 5;
    const QuantizedComm f = QuantizedComm().block_size(block);
    const at::Tensor x = varied(n, 11);
    const at::Tensor y = round_trip(x, f);
    for (int64_t start = 0; start < n; start += block) {
      const int64_t len = std::min(block, n - start);
      const at::Tensor xb = x.narrow(0, start, len), yb = y.narrow(0, start, len);
      const float scale = xb.abs().max().item<float>() / 127.0f;
      const float worst = (xb - yb).abs().max().item<float>();
      ASSERT_LE(worst, scale * 0.5f * (1 + 1e-5f) + 1e-30f) << "block at " << start << " of size " << block;
    }
  }
}

TEST(Quantize, Fp8ElementsAreWithinTheirRelativeStep) {
  const QuantizedComm f = QuantizedComm().dtype(QuantizedDtype::kFloat8E4M3).block_size(64);
  const int64_t n = 64 * 10;
  const at::Tensor x = varied(n, 13);
  const at::Tensor y = round_trip(x, f);
  for (int64_t start = 0; start < n; start += 64) {
    const at::Tensor xb = x.narrow(0, start, 64), yb = y.narrow(0, start, 64);
    const float scale = xb.abs().max().item<float>() / 448.0f;
    // e4m3: 3 mantissa bits (relative half-step 2^-4); the smallest normal is 2^-6 (subnormal steps 2^-9).
    const at::Tensor bound = at::maximum(xb.abs() * (1.0f / 16), at::full_like(xb, scale * std::ldexp(1.0f, -10)));
    ASSERT_TRUE((xb - yb).abs().le(bound * (1 + 1e-5f)).all().item<bool>()) << "block at " << start;
  }
}

// With the residual carried over, the sum of K decoded steps is K x minus the last residual, which
// stays within half a scale: nothing is lost over steps, only delayed.
TEST(Quantize, ErrorFeedbackLosesNothingOverSteps) {
  const QuantizedComm f = QuantizedComm().block_size(32);
  const int64_t n = 32 * 8, steps = 50;
  const at::Tensor x = varied(n, 17) * 1e-3;
  at::Tensor residual = at::zeros({n}), sum = at::zeros({n}), b = bytes_for(n, f);
  for (int k = 0; k < steps; ++k) {
    encode(x, b, f, residual);
    decode(b, sum, f, /*accumulate=*/true);
  }
  // Up to the fp32 rounding of the running sum (about steps x |x| x 2^-24 per addition).
  const at::Tensor lost = x * steps - sum;
  const double rounding = steps * steps * x.abs().max().item<double>() * 6e-8;
  EXPECT_LE((lost - residual).abs().max().item<double>(), rounding);
  const float largest_scale = 2 * x.abs().max().item<float>() / 127.0f;
  EXPECT_LE(residual.abs().max().item<float>(), largest_scale);
  // Without it every step loses the same error, which adds up.
  const at::Tensor drift = (x - round_trip(x, f)) * steps;
  EXPECT_GT(drift.abs().max().item<float>(), 5 * residual.abs().max().item<float>());
}

TEST(Quantize, ZerosStayZeroAndNonFiniteBlocksStayVisible) {
  const QuantizedComm f = QuantizedComm().block_size(16);
  at::Tensor x = at::zeros({48});
  x.narrow(0, 16, 16).fill_(1.5f);
  x[40] = std::numeric_limits<float>::infinity();
  const at::Tensor y = round_trip(x, f);
  EXPECT_TRUE(at::equal(y.narrow(0, 0, 16), at::zeros({16})));
  EXPECT_TRUE(at::equal(y.narrow(0, 16, 16), x.narrow(0, 16, 16)));
  EXPECT_TRUE(at::isnan(y.narrow(0, 32, 16)).all().item<bool>());
}

TEST(Quantize, Bf16IsTheRoundToNearestCast) {
  const QuantizedComm f = QuantizedComm().dtype(QuantizedDtype::kBFloat16);
  const at::Tensor x = varied(1001, 19);
  EXPECT_EQ(encoded_bytes(1001, f), 2004);
  EXPECT_TRUE(at::equal(round_trip(x, f), x.to(at::kBFloat16).to(at::kFloat)));
}

TEST(Quantize, SizesAndOptionChecks) {
  EXPECT_EQ(encoded_bytes(256, QuantizedComm()), 4 + 256);
  EXPECT_EQ(encoded_bytes(257, QuantizedComm()), 8 + 260);
  EXPECT_THROW(QuantizedComm().block_size(8).check("test"), c10::Error);
  EXPECT_THROW(QuantizedComm().block_size(8192).check("test"), c10::Error);
  EXPECT_EQ(fsdp::quantized_dtype_from_string("float8_e4m3"), QuantizedDtype::kFloat8E4M3);
  EXPECT_THROW(fsdp::quantized_dtype_from_string("int4"), c10::Error);
}

}  // namespace
