// agreement.cpp — the gathers of agreement.h, over the world group.
#include "agreement.h"

#include <fsdp/distributed.h>

#include <ATen/Functions.h>

#include <algorithm>
#include <cstring>
#include <stdexcept>

namespace fsdp {
namespace train {

std::vector<double> all_gather_numbers(const std::vector<double>& mine) {
  at::Tensor all = at::empty({static_cast<int64_t>(get_world_size() * mine.size())}, at::kDouble);
  world()->all_gather_into(all, at::tensor(mine, at::kDouble))->wait();
  const double* p = all.data_ptr<double>();
  return std::vector<double>(p, p + all.numel());
}

// Lengths first, then every string padded to the longest (the transport moves equal pieces).
std::vector<std::string> all_gather_strings(const std::string& mine) {
  const std::vector<double> lengths = all_gather_numbers({static_cast<double>(mine.size())});
  const auto longest = static_cast<int64_t>(std::max(1.0, *std::max_element(lengths.begin(), lengths.end())));
  at::Tensor in = at::zeros({longest}, at::kByte);
  std::memcpy(in.data_ptr<uint8_t>(), mine.data(), mine.size());
  at::Tensor all = at::empty({longest * static_cast<int64_t>(lengths.size())}, at::kByte);
  world()->all_gather_into(all, in)->wait();
  std::vector<std::string> out;
  const auto* p = reinterpret_cast<const char*>(all.data_ptr<uint8_t>());
  for (size_t q = 0; q < lengths.size(); ++q) out.emplace_back(p + q * longest, static_cast<size_t>(lengths[q]));
  return out;
}

std::string from_rank0(const std::string& text) { return all_gather_strings(text).at(0); }

void throw_unless_every_rank_ok(const std::string& problem, const std::string& what) {
  const std::vector<std::string> all = all_gather_strings(problem);
  std::string msg;
  for (size_t q = 0; q < all.size(); ++q)
    if (!all[q].empty()) msg += (msg.empty() ? "" : "; ") + std::string("rank ") + std::to_string(q) + ": " + all[q];
  if (!msg.empty()) throw std::runtime_error(what + ": " + msg);
}

}  // namespace train
}  // namespace fsdp
