// agreement.cpp — the gathers of agreement.h, over the world group.
#include "common/agreement.h"

#include <fsdp/distributed.h>

#include <ATen/Functions.h>

#include <cstdint>
#include <cstring>
#include <numeric>
#include <stdexcept>

namespace fsdp {
namespace train {

std::vector<double> all_gather_numbers(const std::vector<double>& mine) {
  at::Tensor all = at::empty({static_cast<int64_t>(get_world_size() * mine.size())}, at::kDouble);
  world()->all_gather_into(all, at::tensor(mine, at::kDouble))->wait();
  const double* p = all.data_ptr<double>();
  return std::vector<double>(p, p + all.numel());
}

// Lengths first, then each rank's bytes, exactly as many as it has.
std::vector<std::string> all_gather_strings(const std::string& mine) {
  const std::vector<double> lengths = all_gather_numbers({static_cast<double>(mine.size())});
  std::vector<int64_t> counts;
  for (double n : lengths) counts.push_back(static_cast<int64_t>(n));
  at::Tensor in = at::empty({static_cast<int64_t>(mine.size())}, at::kByte);
  if (!mine.empty()) std::memcpy(in.data_ptr<uint8_t>(), mine.data(), mine.size());
  at::Tensor all = at::empty({std::accumulate(counts.begin(), counts.end(), int64_t{0})}, at::kByte);
  world()->all_gather_v(all, in, counts)->wait();
  std::vector<std::string> out;
  const auto* p = reinterpret_cast<const char*>(all.data_ptr<uint8_t>());  // null when every string is empty
  int64_t offset = 0;
  for (int64_t n : counts) {
    out.push_back(n > 0 ? std::string(p + offset, static_cast<size_t>(n)) : std::string());
    offset += n;
  }
  return out;
}

// The length first, so that every rank can make room for the bytes.
std::string from_rank0(const std::string& text) {
  at::Tensor length = at::full({1}, static_cast<int64_t>(text.size()), at::kLong);
  world()->broadcast(length, 0)->wait();
  const int64_t n = length.item<int64_t>();
  if (n == 0) return "";  // every rank knows n, so every rank skips the second broadcast
  at::Tensor bytes = at::empty({n}, at::kByte);
  if (get_rank() == 0) std::memcpy(bytes.data_ptr<uint8_t>(), text.data(), static_cast<size_t>(n));
  world()->broadcast(bytes, 0)->wait();
  return std::string(reinterpret_cast<const char*>(bytes.data_ptr<uint8_t>()), static_cast<size_t>(n));
}

void throw_unless_every_rank_ok(const std::string& problem, const std::string& what) {
  const std::vector<std::string> all = all_gather_strings(problem);
  std::string msg;
  for (size_t q = 0; q < all.size(); ++q)
    if (!all[q].empty()) msg += (msg.empty() ? "" : "; ") + std::string("rank ") + std::to_string(q) + ": " + all[q];
  if (!msg.empty()) throw std::runtime_error(what + ": " + msg);
}

}  // namespace train
}  // namespace fsdp
