// tfrecord.cpp — CRC-32C from a 256-entry table built at compile time, and TFRecord framing.
#include "outputs/tfrecord.h"

#include <array>

namespace fsdp {
namespace train {
namespace {

constexpr uint32_t kCastagnoliReflected = 0x82F63B78u;
constexpr uint32_t kMaskDelta = 0xA282EAD8u;

constexpr std::array<uint32_t, 256> crc32c_table() {
  std::array<uint32_t, 256> table{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int bit = 0; bit < 8; ++bit) c = (c & 1u) ? (c >> 1) ^ kCastagnoliReflected : c >> 1;
    table[i] = c;
  }
  return table;
}

constexpr std::array<uint32_t, 256> kTable = crc32c_table();

void append_le(std::string& out, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xFFu));
}

}  // namespace

uint32_t crc32c(std::string_view data, uint32_t crc) {
  crc = ~crc;
  for (const char ch : data) crc = kTable[(crc ^ static_cast<uint8_t>(ch)) & 0xFFu] ^ (crc >> 8);
  return ~crc;
}

uint32_t masked_crc32c(std::string_view data) {
  const uint32_t crc = crc32c(data);
  return ((crc >> 15) | (crc << 17)) + kMaskDelta;
}

std::string tfrecord_frame(std::string_view payload) {
  std::string header;
  append_le(header, payload.size(), 8);
  std::string record = header;
  record.reserve(8 + 4 + payload.size() + 4);
  append_le(record, masked_crc32c(header), 4);
  record.append(payload);
  append_le(record, masked_crc32c(payload), 4);
  return record;
}

}  // namespace train
}  // namespace fsdp
