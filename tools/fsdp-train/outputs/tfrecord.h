// tfrecord.h — the record framing of TensorBoard's event files (TFRecord): each record is its
// length as 8 little-endian bytes, the masked CRC-32C of those 8 bytes, the payload, and the
// masked CRC-32C of the payload. The CRC is CRC-32C (Castagnoli, reflected polynomial
// 0x82F63B78), computed from a table here because Debian 12 packages no C++ library for it.
// Bytes in, bytes out: no protobuf and no torch here.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace fsdp {
namespace train {

// CRC-32C of `data`, continuing from `crc` (0 to start): crc32c(b, crc32c(a)) == crc32c(a + b).
uint32_t crc32c(std::string_view data, uint32_t crc = 0);

// The CRC as TFRecord stores it: rotated right by 15 bits plus 0xA282EAD8, so that a CRC of
// data that itself holds CRCs does not degenerate.
uint32_t masked_crc32c(std::string_view data);

// `payload` framed as one TFRecord: 8 + 4 + payload.size() + 4 bytes.
std::string tfrecord_frame(std::string_view payload);

}  // namespace train
}  // namespace fsdp
