// quantize.cpp — the codec's two paths: hand-written loops over blocks for CPU tensors (one pass
// to find a block's largest magnitude, one to write its codes, both vectorizable), and ATen ops
// for any device. Both do the same float operations in the same order, so they agree byte for
// byte; this file is compiled with -ffp-contract=off so that no fused multiply-add changes one
// rounding.
#include "src/tensor/quantize.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Float8_e4m3fn.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <limits>
#include <sstream>

namespace fsdp {

const char* to_string(QuantizedDtype dtype) {
  switch (dtype) {
    case QuantizedDtype::kInt8: return "int8";
    case QuantizedDtype::kFloat8E4M3: return "float8_e4m3";
    case QuantizedDtype::kBFloat16: return "bfloat16";
  }
  return "?";
}

QuantizedDtype quantized_dtype_from_string(const std::string& name) {
  for (QuantizedDtype d : {QuantizedDtype::kInt8, QuantizedDtype::kFloat8E4M3, QuantizedDtype::kBFloat16}) {
    if (name == to_string(d)) return d;
  }
  TORCH_CHECK(false, "unknown quantized dtype '", name, "'; use int8, float8_e4m3 or bfloat16");
}

std::string QuantizedComm::str() const {
  std::ostringstream s;
  s << "QuantizedComm(dtype=" << to_string(dtype()) << ", block_size=" << block_size()
    << ", error_feedback=" << (error_feedback() ? "true" : "false")
    << ", skip_zero_blocks=" << (skip_zero_blocks() ? "true" : "false") << ")";
  return s.str();
}

void QuantizedComm::check(const char* what) const {
  TORCH_CHECK(block_size() >= 16 && block_size() <= 4096, what, ": QuantizedComm::block_size must be 16 to 4096, got ",
              block_size(), "; the default is 256");
  TORCH_CHECK(!skip_zero_blocks() || dtype() != QuantizedDtype::kBFloat16, what,
              ": QuantizedComm::skip_zero_blocks needs blocks with scales (int8 or float8_e4m3), but the dtype is "
              "bfloat16; use int8, or turn skip_zero_blocks off");
}

namespace detail {
namespace {

constexpr int64_t kMaxBlock = 4096;
// Adding and subtracting 1.5 x 2^23 rounds a float of magnitude below 2^22 to an integer, half to
// even (as at::round), in two additions a compiler vectorizes; without -ffast-math it may not
// fold them away.
constexpr float kRoundMagic = 12582912.0f;

bool has_scales(QuantizedDtype d) { return d != QuantizedDtype::kBFloat16; }
int64_t blocks_of(int64_t n, int64_t block) { return (n + block - 1) / block; }
int64_t round_up_4(int64_t n) { return (n + 3) / 4 * 4; }
// The format's largest magnitude, which a block's largest element maps to.
float format_max(QuantizedDtype d) { return d == QuantizedDtype::kInt8 ? 127.0f : 448.0f; }

inline float round_half_even(float r) { return (r + kRoundMagic) - kRoundMagic; }

void check_row(const at::Tensor& values, const at::Tensor& bytes, const QuantizedComm& format, const char* what) {
  format.check(what);
  TORCH_CHECK(values.dim() == 1 && values.is_contiguous() && at::isFloatingType(values.scalar_type()),
              "internal: ", what, " of a ", values.scalar_type(), " tensor of shape ", values.sizes(),
              "; needs a contiguous 1-D floating tensor");
  TORCH_CHECK(bytes.dim() == 1 && bytes.is_contiguous() && bytes.scalar_type() == at::kByte &&
                  bytes.numel() == encoded_bytes(values.numel(), format) && bytes.device() == values.device(),
              "internal: ", what, " of ", values.numel(), " elements as ", format.str(), " needs ",
              encoded_bytes(values.numel(), format), " contiguous bytes on ", values.device(), ", got ", bytes.numel(),
              " of ", bytes.scalar_type(), " on ", bytes.device());
}

void check_residual(const at::Tensor& residual, const at::Tensor& src) {
  TORCH_CHECK(!residual.defined() || (residual.scalar_type() == at::kFloat && residual.is_contiguous() &&
                                      residual.numel() == src.numel() && residual.device() == src.device()),
              "internal: an error-feedback residual must be a contiguous fp32 tensor of ", src.numel(), " elements on ",
              src.device());
}

// The fp8 e4m3 code -> value table (256 entries), built once.
const std::array<float, 256>& fp8_values() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int c = 0; c < 256; ++c)
      t[c] = static_cast<float>(c10::Float8_e4m3fn(static_cast<uint8_t>(c), c10::Float8_e4m3fn::from_bits()));
    return t;
  }();
  return table;
}

// One block: its scale and 1 / scale from its largest magnitude. A block holding a non-finite
// element gets scale NaN and codes 0 (it decodes to NaN); a block of zeros scale 0.
struct BlockScale {
  float scale;
  float inverse;
  bool finite;
};
BlockScale block_scale(float amax, bool finite, float fmax) {
  if (!finite) return {std::numeric_limits<float>::quiet_NaN(), 0.0f, false};
  if (amax == 0.0f) return {0.0f, 0.0f, true};
  return {amax / fmax, fmax / amax, true};
}

template <class T>
void encode_blocks_cpu(const T* x, float* residual, int64_t n, const QuantizedComm& format, float* scales,
                       uint8_t* codes) {
  const int64_t block = format.block_size();
  const bool int8 = format.dtype() == QuantizedDtype::kInt8;
  const float fmax = format_max(format.dtype());
  at::parallel_for(0, blocks_of(n, block), std::max<int64_t>(1, 16384 / block), [&](int64_t b0, int64_t b1) {
    std::array<float, kMaxBlock> v;
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t start = b * block, len = std::min(block, n - start);
      // The largest magnitude as the largest bit pattern with the sign cleared: an integer max,
      // which vectorizes where a float max reduction may not; NaN and infinity are the patterns
      // from the infinity's up.
      uint32_t largest = 0;
      for (int64_t i = 0; i < len; ++i) {
        const float vi = static_cast<float>(x[start + i]) + (residual ? residual[start + i] : 0.0f);
        v[i] = vi;
        largest = std::max(largest, std::bit_cast<uint32_t>(vi) & 0x7fffffffu);
      }
      const BlockScale s = block_scale(std::bit_cast<float>(largest), largest < 0x7f800000u, fmax);
      scales[b] = s.scale;
      uint8_t* c = codes + start;
      if (!s.finite) {
        std::fill(c, c + len, uint8_t{0});
      } else if (int8) {
        for (int64_t i = 0; i < len; ++i) {
          c[i] = static_cast<uint8_t>(static_cast<int8_t>(static_cast<int32_t>(round_half_even(v[i] * s.inverse))));
        }
      } else {
        for (int64_t i = 0; i < len; ++i) c[i] = c10::Float8_e4m3fn(v[i] * s.inverse).x;
      }
      if (!residual) continue;
      float* r = residual + start;
      if (int8) {
        for (int64_t i = 0; i < len; ++i) r[i] = v[i] - static_cast<float>(static_cast<int8_t>(c[i])) * s.scale;
      } else {
        const std::array<float, 256>& table = fp8_values();
        for (int64_t i = 0; i < len; ++i) r[i] = v[i] - table[c[i]] * s.scale;
      }
    }
  });
}

void decode_blocks_cpu(const float* scales, const uint8_t* codes, int64_t n, const QuantizedComm& format, float* out,
                       bool accumulate) {
  const int64_t block = format.block_size();
  const bool int8 = format.dtype() == QuantizedDtype::kInt8;
  at::parallel_for(0, blocks_of(n, block), std::max<int64_t>(1, 16384 / block), [&](int64_t b0, int64_t b1) {
    const std::array<float, 256>& table = fp8_values();
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t start = b * block, len = std::min(block, n - start);
      const float s = scales[b];
      const uint8_t* c = codes + start;
      float* o = out + start;
      if (int8 && accumulate) {
        for (int64_t i = 0; i < len; ++i) o[i] += static_cast<float>(static_cast<int8_t>(c[i])) * s;
      } else if (int8) {
        for (int64_t i = 0; i < len; ++i) o[i] = static_cast<float>(static_cast<int8_t>(c[i])) * s;
      } else if (accumulate) {
        for (int64_t i = 0; i < len; ++i) o[i] += table[c[i]] * s;
      } else {
        for (int64_t i = 0; i < len; ++i) o[i] = table[c[i]] * s;
      }
    }
  });
}

// bf16 has no scales: ATen's vectorized round-to-nearest-even cast is both paths.
void encode_bf16(const at::Tensor& src, const at::Tensor& dst, const at::Tensor& residual) {
  const int64_t n = src.numel();
  at::Tensor values = dst.narrow(0, 0, 2 * n).view(at::kBFloat16);
  if (residual.defined()) {
    residual.add_(src);  // src + residual, in fp32
    values.copy_(residual);
    residual.sub_(values.to(at::kFloat));
  } else {
    values.copy_(src);
  }
  dst.narrow(0, 2 * n, dst.numel() - 2 * n).zero_();
}

void decode_bf16(const at::Tensor& src, const at::Tensor& dst, bool accumulate) {
  const at::Tensor values = src.narrow(0, 0, 2 * dst.numel()).view(at::kBFloat16);
  if (accumulate) {
    dst.add_(values.to(at::kFloat));
  } else {
    dst.copy_(values);
  }
}

at::Tensor scales_of(const at::Tensor& bytes, int64_t blocks) {
  return bytes.narrow(0, 0, 4 * blocks).view(at::kFloat);
}

}  // namespace

int64_t encoded_bytes(int64_t numel, const QuantizedComm& format) {
  if (!has_scales(format.dtype())) return round_up_4(2 * numel);
  return 4 * blocks_of(numel, format.block_size()) + round_up_4(numel);
}

void encode(const at::Tensor& src, const at::Tensor& dst, const QuantizedComm& format, const at::Tensor& residual) {
  check_row(src, dst, format, "encode");
  check_residual(residual, src);
  if (!src.device().is_cpu() || !has_scales(format.dtype()) ||
      (src.scalar_type() != at::kFloat && src.scalar_type() != at::kBFloat16)) {
    encode_reference(src, dst, format, residual);
    return;
  }
  const int64_t n = src.numel(), blocks = blocks_of(n, format.block_size());
  float* scales = scales_of(dst, blocks).data_ptr<float>();
  uint8_t* codes = dst.data_ptr<uint8_t>() + 4 * blocks;
  float* r = residual.defined() ? residual.data_ptr<float>() : nullptr;
  if (src.scalar_type() == at::kFloat) {
    encode_blocks_cpu(src.data_ptr<float>(), r, n, format, scales, codes);
  } else {
    encode_blocks_cpu(src.data_ptr<at::BFloat16>(), r, n, format, scales, codes);
  }
  std::fill(codes + n, dst.data_ptr<uint8_t>() + dst.numel(), uint8_t{0});
}

void decode(const at::Tensor& src, const at::Tensor& dst, const QuantizedComm& format, bool accumulate) {
  check_row(dst, src, format, "decode");
  TORCH_CHECK(!accumulate || dst.scalar_type() == at::kFloat, "internal: decoded rows are summed in fp32, not ",
              dst.scalar_type());
  if (!dst.device().is_cpu() || !has_scales(format.dtype())) {
    decode_reference(src, dst, format, accumulate);
    return;
  }
  const int64_t n = dst.numel(), blocks = blocks_of(n, format.block_size());
  const float* scales = scales_of(src, blocks).data_ptr<float>();
  const uint8_t* codes = src.data_ptr<uint8_t>() + 4 * blocks;
  if (dst.scalar_type() == at::kFloat) {
    decode_blocks_cpu(scales, codes, n, format, dst.data_ptr<float>(), accumulate);
    return;
  }
  at::Tensor decoded = at::empty({n}, dst.options().dtype(at::kFloat));
  decode_blocks_cpu(scales, codes, n, format, decoded.data_ptr<float>(), false);
  dst.copy_(decoded);
}

void encode_reference(const at::Tensor& src, const at::Tensor& dst, const QuantizedComm& format,
                      const at::Tensor& residual) {
  check_row(src, dst, format, "encode");
  check_residual(residual, src);
  if (!has_scales(format.dtype())) {
    encode_bf16(src, dst, residual);
    return;
  }
  const int64_t n = src.numel(), block = format.block_size(), blocks = blocks_of(n, block);
  const auto fp32 = src.options().dtype(at::kFloat);
  at::Tensor padded = at::zeros({blocks * block}, fp32);
  at::Tensor v = padded.narrow(0, 0, n);
  v.copy_(src);
  if (residual.defined()) v.add_(residual);
  const at::Tensor rows = padded.view({blocks, block});
  const at::Tensor amax = rows.abs().amax(1);
  const at::Tensor finite = at::isfinite(rows).all(1);
  const float fmax = format_max(format.dtype());
  const at::Tensor usable = finite.logical_and(amax > 0);
  const at::Tensor inverse = at::where(usable, at::full_like(amax, fmax).div_(amax), at::zeros_like(amax));
  const at::Tensor scale = at::where(finite, amax / fmax, at::full_like(amax, std::numeric_limits<float>::quiet_NaN()));
  const at::Tensor scaled = at::where(finite.unsqueeze(1), rows * inverse.unsqueeze(1), at::zeros_like(rows));
  const at::Tensor codes = format.dtype() == QuantizedDtype::kInt8 ? at::round(scaled).to(at::kChar).view(at::kByte)
                                                                   : scaled.to(at::kFloat8_e4m3fn).view(at::kByte);
  scales_of(dst, blocks).copy_(scale);
  dst.narrow(0, 4 * blocks, n).copy_(codes.view({-1}).narrow(0, 0, n));
  dst.narrow(0, 4 * blocks + n, dst.numel() - 4 * blocks - n).zero_();
  if (!residual.defined()) return;
  at::Tensor decoded = at::empty({n}, fp32);
  decode_reference(dst, decoded, format);
  residual.copy_(v - decoded);
}

void decode_reference(const at::Tensor& src, const at::Tensor& dst, const QuantizedComm& format, bool accumulate) {
  check_row(dst, src, format, "decode");
  if (!has_scales(format.dtype())) {
    decode_bf16(src, dst, accumulate);
    return;
  }
  const int64_t n = dst.numel(), block = format.block_size(), blocks = blocks_of(n, block);
  const at::Tensor codes = src.narrow(0, 4 * blocks, n);
  const at::Tensor values = format.dtype() == QuantizedDtype::kInt8 ? codes.view(at::kChar).to(at::kFloat)
                                                                    : codes.view(at::kFloat8_e4m3fn).to(at::kFloat);
  at::Tensor padded = at::zeros({blocks * block}, dst.options().dtype(at::kFloat));
  padded.narrow(0, 0, n).copy_(values);
  const at::Tensor decoded =
      (padded.view({blocks, block}) * scales_of(src, blocks).unsqueeze(1)).view({-1}).narrow(0, 0, n);
  if (accumulate) {
    dst.add_(decoded);
  } else {
    dst.copy_(decoded);
  }
}

}  // namespace detail
}  // namespace fsdp
