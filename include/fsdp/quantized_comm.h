// layer: tensor (what may include what: docs/architecture.md)
/// \file
/// fsdp/quantized_comm.h — fewer bytes on a slow link: what crosses it in place of fp32.
///
/// Three options use these settings, each off by default and named after what ZeRO++ calls the
/// same thing:
///  - FullyShardOptions::quantized_weights (ZeRO++'s qwZ, `zero_quantized_weights`): the
///    all-gather of the parameters carries blockwise int8 (or fp8, or bf16); the shards stay in
///    their own dtype (fp32 master weights), and every rank dequantizes the same bytes, its own
///    row included, into the unsharded parameters, so all ranks compute with identical weights.
///  - FullyShardOptions::quantized_gradients (ZeRO++'s qgZ, `zero_quantized_gradients`): HSDP's
///    all-reduce over the replicate group (the traffic between hosts when the shards are within
///    a host) carries int8 or bf16, with error feedback.
///  - DiLoCoOptions::quantized (fsdp/diloco.h): the outer step's pseudo-gradient.
///
/// \code{.cpp}
///   auto opts = fsdp::FullyShardOptions().mesh(mesh)
///       .quantized_weights(fsdp::QuantizedComm())                                     // int8, blocks of 256
///       .quantized_gradients(fsdp::QuantizedComm().dtype(fsdp::QuantizedDtype::kBFloat16));
/// \endcode
///
/// The formats. A block is `block_size` consecutive elements of one rank's row; its scale is its
/// largest magnitude divided by the format's largest value, kept as one fp32 beside the block:
///  - kInt8: round(x / scale) in [-127, 127]; 1 + 4 / block_size bytes per element (3.94x fewer
///    than fp32 at the default 256). The absolute error of an element is at most scale / 2.
///  - kFloat8E4M3: x / scale as fp8 e4m3 (largest value 448); the same bytes as int8, a relative
///    error up to 2^-4 per element instead of int8's absolute one; slower to encode on a CPU.
///  - kBFloat16: x rounded to bf16 (round to nearest even); 2 bytes, no scales.
/// A block of zeros has scale 0 and decodes to zeros; a non-finite element makes its whole block
/// non-finite, so that an overflow stays visible as it would in fp32.
///
/// How a reduction stays a reduction. c10d and fsdp::ProcessGroup have no int8 sum that cannot
/// overflow, so an int8 or fp8 replicate reduction all-gathers every replica's quantized row and
/// each rank decodes and sums them in fp32, in replica order: every rank gets bitwise the same
/// result. Each rank sends (R - 1) x N x (1 + 4 / block_size) bytes for R replicas of N
/// elements, against the ring all-reduce's 2 x (R - 1) / R x 4 N in fp32: fewer for R < 8. bf16
/// runs as an all-reduce in bf16 (2x fewer bytes at any R).
///
/// Error feedback (QuantizedComm::error_feedback, gradients only): what quantization lost on this
/// rank in one step (its input minus what the others decode) is added to its next step's input,
/// so over steps nothing is lost, only delayed (1-bit Adam, ZeRO++'s qgZ and EF21 rely on the
/// same). It costs one fp32 copy of this rank's reduced shard per group.
///
/// Zero blocks (QuantizedComm::skip_zero_blocks, gradients only, int8 and fp8): an embedding's
/// gradient is zero in every row that no token of the batch names, and on a slow link its
/// all-reduce is what the end of backward waits for. With this option each rank sends only the
/// blocks where its gradient is not all zeros, as (block index, scale, codes); a block it skips
/// contributes zeros, and its error-feedback residual waits for a step that sends the block. The
/// sizes differ by rank, so such a reduction first all-gathers every rank's block count, and the
/// host waits for that (behind the group's collectives queued before it). Whether a reduction
/// goes sparse is decided from the counts of the same group's last one (at most half the blocks
/// on every rank), so a dense gradient only pays a 4-byte count and a scan for zeros.
#pragma once

#include <torch/arg.h>

#include <cstdint>
#include <string>

namespace fsdp {

/// What a quantized collective puts on the link (see the file comment).
enum class QuantizedDtype { kInt8, kFloat8E4M3, kBFloat16 };
/// "int8", "float8_e4m3" or "bfloat16".
const char* to_string(QuantizedDtype dtype);
/// The inverse of to_string; throws c10::Error naming `name` and the accepted names.
QuantizedDtype quantized_dtype_from_string(const std::string& name);

/// How one collective is quantized. The default is blockwise int8, blocks of 256, with error
/// feedback where it applies.
struct QuantizedComm {
  /// The format on the link.
  TORCH_ARG(QuantizedDtype, dtype) = QuantizedDtype::kInt8;
  /// Elements per scale (int8, fp8): 16 to 4096. Smaller blocks follow outliers closer and send
  /// more scales (4 / block_size bytes per element).
  TORCH_ARG(int64_t, block_size) = 256;
  /// Gradients only: carry each step's quantization error into the next step's input.
  TORCH_ARG(bool, error_feedback) = true;
  /// Gradients only, int8 and fp8: a rank sends only the blocks where its gradient is not all
  /// zeros (see "Zero blocks" above); off by default.
  TORCH_ARG(bool, skip_zero_blocks) = false;

 public:
  /// "QuantizedComm(dtype=int8, block_size=256, error_feedback=true, skip_zero_blocks=false)", for
  /// logs and errors.
  std::string str() const;
  /// Throws c10::Error naming `what` when block_size is out of range, or when skip_zero_blocks is
  /// set for bf16 (which has no blocks).
  void check(const char* what) const;
};

}  // namespace fsdp
