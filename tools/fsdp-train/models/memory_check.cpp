// memory_check.cpp — the start-up memory check, asked of the planner (memory_check.h).
#include "models/memory_check.h"

#include "models/plan_question.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <functional>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace fsdp {
namespace train {
namespace {

// Sizes up to which the planner's int64 shapes and byte counts cannot overflow; a larger one is
// planned at this value, a lower bound of what it needs (the need grows with every size).
constexpr int64_t kLargestPlannedSize = int64_t{1} << 31;
// Beyond this many bytes per rank (a PiB) the lower bound decides alone: no machine holds it.
const double kLargestPlannedBytes = std::ldexp(1.0, 50);
// Models deeper than this are planned at this depth and at half of it, and the difference
// extrapolated: each layer adds the same.
constexpr int64_t kLayersPlannedWhole = 512;

// What one step needs per rank, and what most of it is.
struct Estimate {
  double bytes = 0;
  double parameters = 0;  // of the whole model
  std::string mostly;     // "activations 1.2 GiB (60%)", for the message
  std::string beyond;     // the key of a size beyond what the planner models, or ""
};

// The lower bound's parts: the model's sharded state (each parameter's value, gradient and AdamW's
// two moments, in fp32), the activations every stage keeps for backward, the step's data.
struct Parts {
  double parameters = 0, model = 0, activations = 0, data = 0;
  Parts operator+(const Parts& o) const {
    return {parameters + o.parameters, model + o.model, activations + o.activations, data + o.data};
  }
  Parts operator*(double k) const { return {parameters * k, model * k, activations * k, data * k}; }
  double total() const { return model + activations + data; }
};

Parts lower_bound_parts(const plan::ModelSpec& m, const PlanQuestion& q, bool frozen_possible) {
  Parts p;
  for (const auto& g : m.groups)
    for (const auto& param : g.params) {
      double n = 1;
      for (int64_t d : param.shape) n *= static_cast<double>(d);
      p.parameters += n;
    }
  const double shard = q.options.no_shard_ ? 1.0 : static_cast<double>(std::max(1, q.mesh.shard));
  // A frozen parameter has no gradient and no optimizer state: only its value is certain.
  p.model = p.parameters * (frozen_possible ? 4.0 : 16.0) / shard;
  for (const auto& s : m.stages) p.activations += s.checkpointed ? s.output_bytes : s.saved_bytes;
  p.data = m.input_bytes + q.resident_data_bytes;
  if (q.sharding.tensor_parallel > 1) p.parameters *= static_cast<double>(q.sharding.tensor_parallel);
  return p;
}

std::string human_bytes(double bytes) {
  static const char* kUnits[] = {"bytes", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  std::ostringstream s;
  size_t u = 0;
  while (bytes >= 1024 && u + 1 < sizeof(kUnits) / sizeof(kUnits[0])) bytes /= 1024, ++u;
  s.precision(bytes < 10 ? 2 : 1);
  s << std::fixed << bytes << " " << kUnits[u];
  return s.str();
}

std::string number(double v) {
  std::ostringstream s;
  if (v < 1e15) s << static_cast<int64_t>(v);
  else s << v;
  return s.str();
}

std::string share(double part, double whole) {
  std::ostringstream s;
  s << " (" << static_cast<int>(std::lround(100.0 * part / whole)) << "%)";
  return s.str();
}

std::string mostly_of(const Parts& p) {
  const double total = p.total();
  if (p.model >= p.activations && p.model >= p.data)
    return "the sharded parameters, gradients and AdamW's two moments " + human_bytes(p.model) + share(p.model, total);
  if (p.activations >= p.data)
    return "the activations kept for backward " + human_bytes(p.activations) + share(p.activations, total);
  return "the step's data " + human_bytes(p.data) + share(p.data, total);
}

// The largest kind of buffer alive at a plan's peak (the kinds `fsdp-train plan` prints).
std::string mostly_of(const std::vector<plan::Buffer>& alive, double peak) {
  std::vector<std::pair<std::string, double>> kinds;
  for (const auto& b : alive) {
    const std::string kind = b.what.substr(0, b.what.find(" ("));
    auto it = std::find_if(kinds.begin(), kinds.end(), [&](const auto& k) { return k.first == kind; });
    if (it == kinds.end()) kinds.push_back({kind, static_cast<double>(b.bytes)});
    else it->second += static_cast<double>(b.bytes);
  }
  if (kinds.empty() || peak <= 0) return "nothing";
  const auto top =
      *std::max_element(kinds.begin(), kinds.end(), [](const auto& x, const auto& y) { return x.second < y.second; });
  return top.first + " " + human_bytes(top.second) + share(top.second, peak);
}

// The question with every size the planner cannot take lowered to the largest it can (a lower
// bound); `beyond` receives the key of the first one lowered.
PlanQuestion within_the_planner(PlanQuestion q, std::string& beyond) {
  int64_t heads = 1;
  for (const PlanSize& s : q.sizes)
    if (s.name == "n_heads") heads = std::max<int64_t>(1, s.value);
  for (PlanSize& s : q.sizes) {
    if (s.value <= kLargestPlannedSize) continue;
    if (beyond.empty()) beyond = s.key;
    s.value = kLargestPlannedSize;
    if (s.name == "dim") s.value -= s.value % heads;  // the heads split the width evenly
  }
  auto lower = [&](int64_t& v, const char* key) {
    if (v <= kLargestPlannedSize) return;
    if (beyond.empty()) beyond = key;
    v = kLargestPlannedSize;
  };
  lower(q.activations.micro_batch, "training.micro_batch_size");
  lower(q.activations.global_rows, "training.micro_batch_size");
  lower(q.activations.seq, "training.seq_len");
  return q;
}

// The plan's peak per rank: the tensors' (on device cuda, the host's), the largest over the ranks.
double planned_peak(const ModelFamily& family, const PlanQuestion& q, std::string* mostly) {
  const plan::Plan p = plan_of(family, q);
  const bool gpu = q.options.device_ == plan::Device::kCuda;
  const plan::RankPlan* worst = &p.ranks.front();
  auto peak = [gpu](const plan::RankPlan& r) {
    return static_cast<double>(gpu ? r.host_peak_tensor_bytes : r.peak_tensor_bytes);
  };
  for (const auto& r : p.ranks)
    if (peak(r) > peak(*worst)) worst = &r;
  if (mostly) *mostly = mostly_of(gpu ? worst->host_at_peak : worst->at_peak, peak(*worst));
  return peak(*worst);
}

Estimate estimate(const ModelFamily& family, const PlanQuestion& question, bool frozen_possible) {
  Estimate e;
  const PlanQuestion q = within_the_planner(question, e.beyond);
  const int64_t layers = size_named(q.sizes, "n_layers");
  auto at_depth = [&](int64_t n) {
    PlanQuestion v = q;
    v.sizes = with_size(v.sizes, "n_layers", n);
    return v;
  };
  const Parts one = lower_bound_parts(model_spec_of(family, at_depth(1)), q, frozen_possible);
  const Parts two = lower_bound_parts(model_spec_of(family, at_depth(2)), q, frozen_possible);
  const Parts bound = one + (two + one * -1.0) * static_cast<double>(layers - 1);
  e.parameters = bound.parameters;
  e.bytes = bound.total();
  e.mostly = mostly_of(bound);
  if (!e.beyond.empty() || frozen_possible || e.bytes > kLargestPlannedBytes) return e;
  try {
    if (layers <= kLayersPlannedWhole) {
      e.bytes = std::max(e.bytes, planned_peak(family, q, &e.mostly));
    } else {
      const double whole = planned_peak(family, at_depth(kLayersPlannedWhole), &e.mostly);
      const double half = planned_peak(family, at_depth(kLayersPlannedWhole / 2), nullptr);
      const double per_layer = (whole - half) / static_cast<double>(kLayersPlannedWhole / 2);
      e.bytes = std::max(e.bytes, whole + per_layer * static_cast<double>(layers - kLayersPlannedWhole));
    }
  } catch (const ConfigError&) {
    // What the planner does not model: the lower bound is the estimate.
  }
  return e;
}

// One key's value halved: the question it makes, or nothing when it cannot be halved.
struct Halving {
  std::string key;
  int64_t value;
  std::function<std::optional<PlanQuestion>(PlanQuestion)> apply;
};

std::vector<Halving> halvings(const TrainConfig& cfg, const PlanQuestion& q) {
  std::vector<Halving> out;
  const bool seq_from_model = cfg.training.seq_len == 0;
  for (const PlanSize& s : q.sizes) {
    out.push_back({s.key, s.value, [name = s.name, seq_from_model](PlanQuestion v) -> std::optional<PlanQuestion> {
                     const int64_t value = size_named(v.sizes, name);
                     if (value < 2) return std::nullopt;
                     v.sizes = with_size(v.sizes, name, value / 2);
                     // The sequence is the model's longest when training.seq_len is unset.
                     if (name == "max_seq_len" && seq_from_model) {
                       v.activations.seq = std::max<int64_t>(1, v.activations.seq / 2);
                       v.activations.loss_chunks = std::min(v.activations.loss_chunks, v.activations.seq);
                     }
                     return v;
                   }});
  }
  out.push_back(
      {"training.micro_batch_size", q.activations.micro_batch, [](PlanQuestion v) -> std::optional<PlanQuestion> {
         if (v.activations.micro_batch < 2) return std::nullopt;
         v.activations.micro_batch /= 2;
         v.activations.global_rows = std::max<int64_t>(1, v.activations.global_rows / 2);
         return v;
       }});
  if (!seq_from_model)
    out.push_back({"training.seq_len", q.activations.seq, [](PlanQuestion v) -> std::optional<PlanQuestion> {
                     if (v.activations.seq < 2) return std::nullopt;
                     v.activations.seq /= 2;
                     v.activations.loss_chunks = std::min(v.activations.loss_chunks, v.activations.seq);
                     return v;
                   }});
  return out;
}

// The key to lower: of those whose halving would lower the estimate by 40 % or more, the one
// with the largest value (the value out of scale: a billion layers of a narrow model, not their
// width); when none would, the one whose halving lowers it most.
std::string key_that_matters(const ModelFamily& family, const TrainConfig& cfg, const PlanQuestion& q,
                             const Estimate& base, bool frozen_possible) {
  std::string most_saving = q.sizes.front().key, largest_value;
  double best_saving = -1;
  int64_t best_value = 0;
  for (const Halving& h : halvings(cfg, q)) {
    const std::optional<PlanQuestion> v = h.apply(q);
    if (!v) continue;
    double saving = 0;
    try {
      saving = base.bytes - estimate(family, *v, frozen_possible).bytes;
    } catch (const std::exception&) {
      continue;  // a size the model refuses once halved (a width the heads no longer divide): no remedy
    }
    if (saving > best_saving) most_saving = h.key, best_saving = saving;
    if (saving >= 0.4 * base.bytes && h.value > best_value) largest_value = h.key, best_value = h.value;
  }
  return largest_value.empty() ? most_saving : largest_value;
}

}  // namespace

void check_fits_in_memory(const TrainConfig& cfg, const ModelFamily& family, int64_t seq, int world, int local_world,
                          double mem_total_bytes) {
  const PlanQuestion q = plan_question(cfg, family, seq, world, local_world, /*strict=*/false);
  const bool frozen_possible = !cfg.model.freeze.empty();
  Estimate e;
  try {
    e = estimate(family, q, frozen_possible);
  } catch (const std::invalid_argument& error) {
    throw ConfigError(error.what());
  }
  const double ranks = static_cast<double>(std::max(1, local_world));
  const double machine = e.bytes * ranks;
  const double limit = mem_total_bytes > 0 ? mem_total_bytes : std::ldexp(1.0, 63);
  if (machine <= limit && e.beyond.empty()) return;
  const std::string key = !e.beyond.empty() ? e.beyond : key_that_matters(family, cfg, q, e, frozen_possible);
  std::ostringstream msg;
  msg << key << ": this run needs at least " << human_bytes(e.bytes) << " per rank, " << local_world
      << " rank(s) on this machine need " << human_bytes(machine);
  if (machine > limit) {
    msg << ", more than its memory ("
        << (mem_total_bytes > 0 ? human_bytes(mem_total_bytes) + ", MemTotal in /proc/meminfo" : "unknown; 2^63 bytes")
        << ")";
  } else {
    msg << ", and its value is beyond what the planner models (" << number(static_cast<double>(kLargestPlannedSize))
        << ")";
  }
  msg << ". Most of it is " << e.mostly << ". The model has " << number(e.parameters)
      << " parameters. The estimate is the peak tensor bytes of one step as `fsdp-train plan` predicts it (16 bytes "
         "per parameter, sharded, at the least). Rule: the estimate per rank times the ranks on this machine "
         "(LOCAL_WORLD_SIZE) must not exceed MemTotal. Lower "
      << key << ".";
  throw ConfigError(msg.str());
}

void check_memory(const TrainConfig& cfg, const ModelFamily& family, int64_t seq, const RendezvousInfo& env) {
  check_fits_in_memory(cfg, family, seq, env.world_size, env.local_world_size, machine_memory_bytes());
}

double machine_memory_bytes() {
  std::ifstream in("/proc/meminfo");
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream fields(line);
    std::string name, unit;
    double value = 0;
    if (fields >> name >> value >> unit && name == "MemTotal:") return unit == "kB" ? value * 1024 : value;
  }
  return 0;
}

}  // namespace train
}  // namespace fsdp
