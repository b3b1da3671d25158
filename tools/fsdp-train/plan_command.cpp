// plan_command.cpp — `fsdp-train plan`: a TrainConfig turned into fsdp::plan's model and
// options, the plan printed per rank (on device cuda the GPU's memory and the host's apart, with
// no step time), and the largest model of the preset's shape that fits.
#include "plan_command.h"

#include "common/errors.h"
#include "config/config.h"
#include "config/read_file.h"
#include "models/model_setup.h"
#include "models/plan_question.h"
#include "models/registry.h"

#include <fsdp/memory.h>
#include <fsdp/plan.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace fsdp {
namespace train {
namespace {

const char* kPlanUsage =
    "usage: fsdp-train plan CONFIG.yaml [--section.key=value ...] [--world N] [--local-world N]\n"
    "                       [--memory-per-rank SIZE] [--constants FILE] [--eval] [--json]\n"
    "Prints, per rank, what one training step of CONFIG needs: sharded parameters, gradients and\n"
    "optimizer state, the buffers alive at the peak, the activations, the peak tensor bytes and RSS,\n"
    "the collectives, and a predicted step time. Runs nothing. With fsdp_config.device: cuda, the GPU's\n"
    "peak and the host's apart (a model; no step time). --world: the ranks (default: the config's\n"
    "fsdp_config.world_size when set). --memory-per-rank (e.g. 4GiB, 512MiB) also finds the largest\n"
    "n_layers and dim of the model that fit (peak RSS; on cuda the GPU's peak tensors). --local-world:\n"
    "ranks per machine (default: the world). --eval: what `fsdp-train eval` of CONFIG needs instead (forward\n"
    "passes without grad over eval.path's windows; no gradients, optimizer state or step time).\n";

struct PlanArgs {
  std::string config;
  std::vector<std::string> overrides;
  int world = 0, local_world = 0;
  double memory_per_rank = 0;
  std::string constants;
  bool json = false;
  bool eval = false;  // `fsdp-train eval` rather than a training step
};

double parse_size(const std::string& s) {
  size_t used = 0;
  double v = 0;
  try {
    v = std::stod(s, &used);
  } catch (const std::exception&) {
    throw ConfigError("command line: --memory-per-rank: expected a size such as 4GiB, 512MiB or 1e9, got '" + s + "'");
  }
  const std::string unit = s.substr(used);
  const std::vector<std::pair<std::string, double>> units = {
      {"", 1},     {"B", 1},    {"KiB", 1024.0}, {"MiB", 1048576.0}, {"GiB", 1073741824.0}, {"TiB", 1099511627776.0},
      {"KB", 1e3}, {"MB", 1e6}, {"GB", 1e9},     {"TB", 1e12}};
  for (const auto& [name, factor] : units)
    if (unit == name && v > 0) return v * factor;
  throw ConfigError("command line: --memory-per-rank: expected a positive size such as 4GiB, 512MiB or 1e9, got '" + s +
                    "'");
}

int positive_int(const std::string& flag, const std::string& v) {
  try {
    size_t used = 0;
    const int n = std::stoi(v, &used);
    if (used == v.size() && n >= 1) return n;
  } catch (const std::exception&) {
  }
  throw ConfigError("command line: " + flag + ": expected an integer >= 1, got '" + v + "'");
}

PlanArgs parse(int argc, char** argv) {
  PlanArgs a;
  for (int i = 2; i < argc; ++i) {
    const std::string arg = argv[i];
    auto value = [&](const std::string& flag) -> std::string {
      const std::string prefix = flag + "=";
      if (arg.rfind(prefix, 0) == 0) return arg.substr(prefix.size());
      if (i + 1 >= argc) throw ConfigError("command line: " + flag + " needs a value");
      return argv[++i];
    };
    auto is = [&](const std::string& flag) { return arg == flag || arg.rfind(flag + "=", 0) == 0; };
    if (is("--world")) a.world = positive_int("--world", value("--world"));
    else if (is("--local-world")) a.local_world = positive_int("--local-world", value("--local-world"));
    else if (is("--memory-per-rank")) a.memory_per_rank = parse_size(value("--memory-per-rank"));
    else if (is("--constants")) a.constants = value("--constants");
    else if (arg == "--json") a.json = true;
    else if (arg == "--eval") a.eval = true;
    else if (arg == "-h" || arg == "--help") throw std::logic_error("help");
    else if (arg.rfind("--", 0) == 0 && arg.find('.') != std::string::npos) a.overrides.push_back(arg);
    else if (!arg.empty() && arg[0] == '-')
      throw ConfigError("command line: unknown option '" + arg +
                        "' (fsdp-train plan takes --world, --local-world, "
                        "--memory-per-rank, --constants, --eval, --json and --section.key=value)");
    else if (a.config.empty()) a.config = arg;
    else throw ConfigError("command line: a second config file '" + arg + "' (only one is read)");
  }
  return a;
}

// --world, or the config's fsdp_config.world_size when it names one (the launcher must match it).
int world_of(const PlanArgs& a, const TrainConfig& cfg) {
  const int configured = cfg.fsdp_config.world_size;
  if (a.world == 0 && configured > 0) return configured;
  if (a.world == 0)
    throw ConfigError(
        "command line: --world N is required (the number of ranks to plan for), unless the config sets "
        "fsdp_config.world_size");
  if (configured > 0 && configured != a.world)
    throw ConfigError("fsdp_config.world_size is " + std::to_string(configured) + " but --world is " +
                      std::to_string(a.world));
  return a.world;
}

// The trainer's question, and the family that answers for the model.
struct Question : PlanQuestion {
  const ModelFamily* family = nullptr;
};

int64_t size(const Question& q, const char* name) { return size_named(q.sizes, name); }
plan::Plan plan_of(const Question& q) { return plan_of(*q.family, q); }
int64_t parameter_count(const Question& q) { return parameter_count(*q.family, q); }

bool on_gpu(const Question& q) { return q.options.device_ == plan::Device::kCuda; }

// What must fit a rank's memory: its peak RSS, or on a GPU the GPU's peak tensors (the step after
// a background save included).
double peak_memory(const plan::Plan& p, bool gpu) {
  int64_t most = 0;
  for (const auto& r : p.ranks) most = std::max(most, gpu ? r.peak_tensor_bytes_after_save : r.peak_rss_bytes);
  return static_cast<double>(most);
}

// The largest value of one size (n_layers, or dim in steps of n_heads) whose plan's peak memory
// fits `memory`; 0 when even the smallest does not. Peak memory grows with both.
int64_t largest_fitting(Question q, bool layers, double memory) {
  const int64_t step = layers ? 1 : size(q, "n_heads");
  auto fits = [&](int64_t k) {
    q.sizes = with_size(q.sizes, layers ? "n_layers" : "dim", layers ? k : k * step);
    return peak_memory(plan_of(q), on_gpu(q)) <= memory;
  };
  if (!fits(1)) return 0;
  int64_t lo = 1, hi = 2;
  const int64_t cap = layers ? 1 << 20 : (1 << 20) / step;
  while (hi <= cap && fits(hi)) lo = hi, hi *= 2;
  if (hi > cap) return lo * step;  // beyond any size worth planning
  while (hi - lo > 1) {
    const int64_t mid = lo + (hi - lo) / 2;
    (fits(mid) ? lo : hi) = mid;
  }
  return lo * step;
}

std::string mib(double bytes) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.2f MiB", bytes / 1048576.0);
  return buf;
}

std::string dtype_bytes(const std::vector<plan::DtypeBytes>& v, std::string (*format)(double) = mib) {
  std::string s;
  for (const auto& d : v) s += (s.empty() ? "" : ", ") + std::string(plan::name_of(d.dtype)) + " " + format(d.bytes);
  return s;
}

bool same_numbers(const plan::RankPlan& a, const plan::RankPlan& b) {
  return a.peak_tensor_bytes == b.peak_tensor_bytes && a.host_peak_tensor_bytes == b.host_peak_tensor_bytes &&
         a.optimizer_state[0].bytes == b.optimizer_state[0].bytes && a.grads[0].bytes == b.grads[0].bytes;
}

const char* memory_name(plan::Memory m) { return m == plan::Memory::kHost ? "host" : "GPU"; }

// The largest kind of buffer alive at a peak, summed over the modules ("activations" taking in
// "activations (checkpoint output)", ...), with its share of the peak.
std::string dominated_by(const std::vector<plan::Buffer>& alive, int64_t peak, std::string (*format)(double) = mib) {
  std::vector<std::pair<std::string, int64_t>> kinds;
  for (const auto& b : alive) {
    const std::string kind = b.what.substr(0, b.what.find(" ("));
    auto it = std::find_if(kinds.begin(), kinds.end(), [&](const auto& k) { return k.first == kind; });
    if (it == kinds.end()) kinds.push_back({kind, b.bytes});
    else it->second += b.bytes;
  }
  if (kinds.empty() || peak <= 0) return "nothing";
  const auto top =
      *std::max_element(kinds.begin(), kinds.end(), [](const auto& x, const auto& y) { return x.second < y.second; });
  char share[32];
  std::snprintf(share, sizeof share, " (%.0f%%)", 100.0 * static_cast<double>(top.second) / static_cast<double>(peak));
  return top.first + " " + format(static_cast<double>(top.second)) + share;
}

void print_alive(std::ostringstream& s, const std::vector<plan::Buffer>& alive, std::string (*format)(double) = mib) {
  for (const auto& b : alive)
    s << "    " << (b.module.empty() ? "(root)" : b.module) << ": " << b.what << " " << format(b.bytes) << "\n";
}

// MiB, or KiB below one MiB (the GPU plans of small presets stay readable).
std::string kib_or_mib(double bytes) {
  if (bytes >= 1048576.0) return mib(bytes);
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.2f KiB", bytes / 1024.0);
  return buf;
}

const char* optimizer_name(plan::Optimizer o) {
  switch (o) {
    case plan::Optimizer::kAdamW: return "AdamW";
    case plan::Optimizer::kFusedAdamW: return "FusedAdamW";
    case plan::Optimizer::kDeviceStateAdamW: return "DeviceStateAdamW";
  }
  return "?";
}

std::string offload_described(const Question& q) {
  if (!q.options.offload_) return "";
  if (!on_gpu(q)) return ", offload (identity copies on cpu)";
  return q.options.optimizer_ == plan::Optimizer::kDeviceStateAdamW
             ? ", parameters offloaded (shards and gradients in pinned host memory, AdamW's state and step on "
               "the GPU)"
             : ", parameters and optimizer state offloaded (CPUOffloadPolicy: shards, gradients and AdamW's "
               "state in host memory, AdamW steps there)";
}

std::string describe(const Question& q, const TrainConfig& cfg, const PlanArgs& a) {
  std::ostringstream s;
  const auto& act = q.activations;
  s << "fsdp-train plan: " << (a.config.empty() ? "defaults" : a.config) << " at W=" << a.world << ": "
    << parameter_count(q) << " parameters (" << size(q, "n_layers") << " layers, dim " << size(q, "dim") << ", "
    << size(q, "n_heads") << " heads, vocab " << size(q, "vocab_size") << "), " << q.strategy << " ("
    << q.mesh.replicate << " x " << q.mesh.shard << ")"
    << (q.sharding.tensor_parallel > 1
            ? " x tensor-parallel " + std::to_string(q.sharding.tensor_parallel) +
                  (q.sharding.vocab_parallel ? " (vocabulary split too)" : " (embedding and head whole)")
            : "")
    << ", " << precision_of(cfg.fsdp_config).describe() << ", micro-batch " << act.micro_batch << " x " << act.seq
    << ", " << q.options.micro_batches_ << " micro-batch(es) per step, checkpointing "
    << (act.checkpoint_every == 0   ? std::string("none")
        : act.checkpoint_every == 1 ? std::string("every block")
                                    : "every " + std::to_string(act.checkpoint_every) + "th block")
    << ", loss in " << act.loss_chunks << " piece(s)"
    << ", " << optimizer_name(q.options.optimizer_) << (on_gpu(q) ? ", device cuda" : "") << offload_described(q)
    << (q.sharding.output_head_group ? ", output head group" : "") << ", collectives on " << q.backend;
  if (q.options.evaluation_) s << "; the evaluation (fsdp-train eval), not a training step";
  return s.str();
}

// Per rank on a GPU: where the sharded state lives, then the GPU's peak and the host's apart.
void print_gpu_rank(std::ostringstream& s, const plan::RankPlan& r, const Question& q) {
  // The offloaded shards are pinned (CPUOffloadPolicy's pin_memory), and so are the gradients the
  // reduce-scatter's output is copied into; AdamW's state on the host is not.
  auto in = [](plan::Memory m, bool pinned) {
    return m == plan::Memory::kHost && pinned ? "pinned host" : memory_name(m);
  };
  s << "  sharded parameters " << dtype_bytes(r.params, kib_or_mib) << " (" << in(r.params_in, true) << "); gradients "
    << dtype_bytes(r.grads, kib_or_mib) << " (" << in(r.grads_in, true) << "); optimizer state "
    << dtype_bytes(r.optimizer_state, kib_or_mib) << " (" << in(r.optimizer_state_in, false) << ")\n";
  s << "  activations kept at the end of forward: " << kib_or_mib(r.activation_bytes) << " (GPU)\n";
  s << "  GPU peak tensors " << kib_or_mib(r.peak_tensor_bytes) << ", at " << r.peak_at << "; mostly "
    << dominated_by(r.at_peak, r.peak_tensor_bytes, kib_or_mib) << "; alive then:\n";
  print_alive(s, r.at_peak, kib_or_mib);
  if (r.host_at_peak.empty()) {
    s << "  host peak tensors 0.00 MiB (none of the step's tensors live there)\n";
  } else {
    s << "  host peak tensors " << kib_or_mib(r.host_peak_tensor_bytes) << ", at " << r.host_peak_at << "; mostly "
      << dominated_by(r.host_at_peak, r.host_peak_tensor_bytes, kib_or_mib) << "; alive then:\n";
    print_alive(s, r.host_at_peak, kib_or_mib);
  }
  if (q.options.background_checkpoints_)
    s << "  the step after a background checkpoint save: GPU peak tensors "
      << kib_or_mib(r.peak_tensor_bytes_after_save) << ", host " << kib_or_mib(r.host_peak_tensor_bytes_after_save)
      << " (the save's staged copy of the parameters and "
      << "optimizer state, " << kib_or_mib(r.checkpoint_staging_bytes)
      << ", staged in pinned host memory, is alive through it)\n";
  s << "  host RSS: not planned on a GPU (the CUDA context's and NCCL's host memory are not measured here); the "
       "host tensors above come on top of them\n";
}

void print_cpu_rank(std::ostringstream& s, const plan::RankPlan& r, const Question& q) {
  s << "  sharded parameters " << dtype_bytes(r.params) << "; gradients " << dtype_bytes(r.grads)
    << "; optimizer state " << dtype_bytes(r.optimizer_state) << "\n";
  s << "  activations kept at the end of forward: " << mib(r.activation_bytes) << "\n";
  s << "  peak tensors " << mib(r.peak_tensor_bytes) << ", at " << r.peak_at << "; alive then:\n";
  print_alive(s, r.at_peak);
  if (q.options.background_checkpoints_)
    s << "  the step after a background checkpoint save: peak tensors " << mib(r.peak_tensor_bytes_after_save)
      << " (the save's staged copy of the parameters and optimizer state, " << mib(r.checkpoint_staging_bytes)
      << ", is alive through it)\n";
  s << "  peak RSS " << mib(r.peak_rss_bytes) << " (runtime and block cache included)\n";
  if (fsdp::memory::cache_release() == fsdp::memory::CacheRelease::kAtLimit)
    s << "  FSDP_CPU_CACHE_RELEASE=at_limit: the run keeps freed blocks beside the live ones, which the peak RSS "
         "above does not count (it plans on_miss; include/fsdp/memory.h gives a measured example)\n";
}

const char* kGpuCaveat =
    "device cuda: GPU and host memory are a model of the runtime's allocations (src/fsdp, "
    "src/optim/device_state_adamw.cpp), not yet checked against a run on a GPU: the cpu figures are "
    "measured against the trainer, these are not. Not counted: the CUDA context, cuBLAS's workspace and "
    "NCCL's buffers, and the caching allocator's rounding and fragmentation (what nvidia-smi shows above "
    "the peak).";

void print_text(const plan::Plan& p, const Question& q, const TrainConfig& cfg, const PlanArgs& a) {
  std::ostringstream s;
  const bool gpu = on_gpu(q);
  s << describe(q, cfg, a) << "\n";
  if (gpu) s << kGpuCaveat << "\n";
  else s << "constants: " << p.constants_source << "\n";
  for (size_t i = 0; i < p.ranks.size();) {
    size_t j = i + 1;
    while (j < p.ranks.size() && same_numbers(p.ranks[i], p.ranks[j])) ++j;
    s << (j - i == 1 ? "rank " + std::to_string(i) : "ranks " + std::to_string(i) + "-" + std::to_string(j - 1))
      << ":\n";
    if (gpu) print_gpu_rank(s, p.ranks[i], q);
    else print_cpu_rank(s, p.ranks[i], q);
    i = j;
  }
  const auto& coll = p.ranks.front().collectives;
  if (q.options.evaluation_) {
    s << "evaluation: each batch all-gathers every group once; no step time is modelled\n";
  } else if (coll.empty()) {
    s << "collectives per step: none (nothing to gather or reduce at this world size)\n";
  } else {
    s << "collectives per step (bytes: the whole gathered / reduced buffers):\n";
    for (const auto& c : coll)
      s << "  " << c.group << ": " << c.kind << " on the " << c.mesh << " mesh x" << c.count << ", "
        << (gpu ? kib_or_mib(c.bytes) : mib(c.bytes)) << "\n";
  }
  if (q.options.evaluation_) {
    // said with the collectives above
  } else if (!p.step_time_modeled) {
    s << "step time: not modelled for GPUs (the planner's rates are CPU and Gloo measurements); measure it with "
         "fsdp-train on the GPU\n";
  } else {
    char t[512];
    std::snprintf(t, sizeof t,
                  "predicted step time %.4f s (compute %.4f, communication %.4f, optimizer %.4f, overhead %.4f; %s)\n",
                  p.step_time_s, p.compute_s, p.communication_s, p.optimizer_s, p.overhead_s, q.threads.c_str());
    s << t;
  }
  if (a.memory_per_rank > 0) {
    const int64_t layers = largest_fitting(q, true, a.memory_per_rank);
    const int64_t dim = largest_fitting(q, false, a.memory_per_rank);
    s << "fits " << mib(a.memory_per_rank) << " per rank (" << (gpu ? "GPU peak tensors" : "peak RSS")
      << "): up to n_layers " << layers << " at dim " << size(q, "dim") << ", or up to dim " << dim << " at n_layers "
      << size(q, "n_layers") << (layers == 0 ? " (not even 1 layer fits)" : "") << "\n";
  }
  std::cout << s.str();
}

nlohmann::json dtype_json(const std::vector<plan::DtypeBytes>& v) {
  nlohmann::json j = nlohmann::json::array();
  for (const auto& d : v) j.push_back({{"dtype", plan::name_of(d.dtype)}, {"bytes", d.bytes}});
  return j;
}

void print_json(const plan::Plan& p, const Question& q, const TrainConfig& cfg, const PlanArgs& a) {
  nlohmann::json j;
  j["description"] = describe(q, cfg, a);
  j["world"] = a.world;
  j["parameters"] = parameter_count(q);
  j["device"] = plan::name_of(q.options.device_);
  j["constants_source"] = p.constants_source;
  j["step_time_modeled"] = p.step_time_modeled;
  if (p.step_time_modeled) {
    j["step_time_s"] = p.step_time_s;
    j["compute_s"] = p.compute_s;
    j["communication_s"] = p.communication_s;
    j["optimizer_s"] = p.optimizer_s;
    j["overhead_s"] = p.overhead_s;
  }
  if (on_gpu(q)) j["note"] = kGpuCaveat;
  j["threads"] = q.threads;
  j["backend"] = q.backend;
  for (const auto& r : p.ranks) {
    nlohmann::json rj = {{"rank", r.rank},
                         {"params", dtype_json(r.params)},
                         {"grads", dtype_json(r.grads)},
                         {"optimizer_state", dtype_json(r.optimizer_state)},
                         {"activation_bytes", r.activation_bytes},
                         {"peak_tensor_bytes", r.peak_tensor_bytes},
                         {"peak_at", r.peak_at},
                         {"checkpoint_staging_bytes", r.checkpoint_staging_bytes},
                         {"peak_tensor_bytes_after_save", r.peak_tensor_bytes_after_save},
                         {"peak_rss_bytes", r.peak_rss_bytes}};
    rj["at_peak"] = nlohmann::json::array();
    for (const auto& b : r.at_peak)
      rj["at_peak"].push_back({{"module", b.module}, {"what", b.what}, {"bytes", b.bytes}});
    if (on_gpu(q)) {  // peak_tensor_bytes and at_peak are the GPU's; the host's apart
      rj["params_in"] = memory_name(r.params_in);
      rj["grads_in"] = memory_name(r.grads_in);
      rj["optimizer_state_in"] = memory_name(r.optimizer_state_in);
      rj["host_peak_tensor_bytes"] = r.host_peak_tensor_bytes;
      rj["host_peak_at"] = r.host_peak_at;
      rj["host_peak_tensor_bytes_after_save"] = r.host_peak_tensor_bytes_after_save;
      rj["host_at_peak"] = nlohmann::json::array();
      for (const auto& b : r.host_at_peak)
        rj["host_at_peak"].push_back({{"module", b.module}, {"what", b.what}, {"bytes", b.bytes}});
    }
    rj["collectives"] = nlohmann::json::array();
    for (const auto& c : r.collectives)
      rj["collectives"].push_back(
          {{"group", c.group}, {"kind", c.kind}, {"mesh", c.mesh}, {"count", c.count}, {"bytes", c.bytes}});
    j["ranks"].push_back(rj);
  }
  if (a.memory_per_rank > 0) {
    j["memory_per_rank"] = a.memory_per_rank;
    j["largest_n_layers"] = largest_fitting(q, true, a.memory_per_rank);
    j["largest_dim"] = largest_fitting(q, false, a.memory_per_rank);
  }
  std::cout << j.dump() << "\n";
}

}  // namespace

int plan_command(int argc, char** argv) {
  PlanArgs a;
  try {
    a = parse(argc, argv);
  } catch (const std::logic_error&) {
    std::cout << kPlanUsage;
    return kExitOk;
  }
  const TrainConfig cfg = load_config(a.config, a.overrides);
  a.world = world_of(a, cfg);
  const std::unique_ptr<const ModelFamily> family = choose_family(cfg);
  Question q;
  static_cast<PlanQuestion&>(q) = plan_question(cfg, *family, seq_len_of(cfg, *family), a.world, a.local_world,
                                                /*strict=*/true, a.constants, a.eval);
  q.family = family.get();
  const plan::Plan p = plan_of(q);
  if (a.json) print_json(p, q, cfg, a);
  else print_text(p, q, cfg, a);
  return kExitOk;
}

}  // namespace train
}  // namespace fsdp
