// quantize.h — the codec behind fsdp/quantized_comm.h: one row of elements to the bytes that
// cross the link, and back. Not collective, never communicates: the callers (fsdp's collectives,
// the DiLoCo outer step) lay rows end to end in the buffers they all-gather or all-reduce.
//
// An encoded row of n elements, block size B, b = ceil(n / B) blocks:
//   int8, fp8   [ scale of block 0 .. block b-1: fp32 ] [ n one-byte codes ] [ zero padding ]
//   bf16        [ n bf16 values ] [ zero padding ]
// padded to a multiple of 4 bytes, so that rows laid end to end keep every row's scales aligned.
// Element i of block k decodes to code_i * scale_k (int8), fp8(code_i) * scale_k (fp8), or
// float(bf16) (bf16).
//
// The CPU path runs hand-written loops over blocks (at::parallel_for); other devices run the
// same arithmetic as ATen ops (encode_reference / decode_reference), which the tests also hold
// the loops to, byte for byte.
#pragma once

#include <fsdp/quantized_comm.h>

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace fsdp {
namespace detail {

// Bytes of one encoded row of `numel` elements: a multiple of 4.
int64_t encoded_bytes(int64_t numel, const QuantizedComm& format);

// Encodes `src` (1-D, contiguous, floating) into `dst` (1-D contiguous uint8 of
// encoded_bytes(src.numel()) bytes, same device). With `residual` (fp32, src.numel(), same
// device; error feedback): encodes src + residual and leaves in `residual` what decoding loses,
// (src + residual) - decode(dst).
void encode(const at::Tensor& src, const at::Tensor& dst, const QuantizedComm& format,
            const at::Tensor& residual = at::Tensor());

// Decodes `src` (encoded_bytes(dst.numel()) bytes) into `dst` (1-D contiguous floating). With
// `accumulate`, adds the decoded values to `dst` instead (an fp32 sum of several rows).
void decode(const at::Tensor& src, const at::Tensor& dst, const QuantizedComm& format, bool accumulate = false);

// The same arithmetic as ATen ops, on any device: what encode/decode run off the CPU, and what
// the tests compare the CPU loops with.
void encode_reference(const at::Tensor& src, const at::Tensor& dst, const QuantizedComm& format,
                      const at::Tensor& residual = at::Tensor());
void decode_reference(const at::Tensor& src, const at::Tensor& dst, const QuantizedComm& format,
                      bool accumulate = false);

}  // namespace detail
}  // namespace fsdp
