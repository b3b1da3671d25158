// plan_command.cpp — `fsdp-train plan`: a TrainConfig turned into fsdp::plan's model and
// options, the plan printed per rank (on device cuda the GPU's memory and the host's apart, with
// no step time), and the largest model of the preset's shape that fits.
#include "plan_command.h"

#include "config.h"
#include "errors.h"
#include "model_setup.h"
#include "read_file.h"

#include <fsdp/models/transformer.h>
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
    "                       [--memory-per-rank SIZE] [--constants FILE] [--json]\n"
    "Prints, per rank, what one training step of CONFIG needs: sharded parameters, gradients and\n"
    "optimizer state, the buffers alive at the peak, the activations, the peak tensor bytes and RSS,\n"
    "the collectives, and a predicted step time. Runs nothing. With fsdp_config.device: cuda, the GPU's\n"
    "peak and the host's apart (a model; no step time). --world: the ranks (default: the config's\n"
    "fsdp_config.world_size when set). --memory-per-rank (e.g. 4GiB, 512MiB) also finds the largest\n"
    "n_layers and dim of the model that fit (peak RSS; on cuda the GPU's peak tensors). --local-world:\n"
    "ranks per machine (default: the world).\n";

struct PlanArgs {
  std::string config;
  std::vector<std::string> overrides;
  int world = 0, local_world = 0;
  double memory_per_rank = 0;
  std::string constants;
  bool json = false;
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
    else if (arg == "-h" || arg == "--help") throw std::logic_error("help");
    else if (arg.rfind("--", 0) == 0 && arg.find('.') != std::string::npos) a.overrides.push_back(arg);
    else if (!arg.empty() && arg[0] == '-')
      throw ConfigError("command line: unknown option '" + arg +
                        "' (fsdp-train plan takes --world, --local-world, "
                        "--memory-per-rank, --constants, --json and --section.key=value)");
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

plan::Dtype dtype_of(Dtype d) {
  switch (d) {
    case Dtype::kFloat32: return plan::Dtype::kFloat32;
    case Dtype::kBFloat16: return plan::Dtype::kBFloat16;
    case Dtype::kFloat16: return plan::Dtype::kFloat16;
  }
  return plan::Dtype::kFloat32;
}

plan::LlamaShape llama_shape_of(const models::LlamaArgs& l) {
  plan::LlamaShape s;
  s.n_layers = l.num_hidden_layers;
  s.vocab_size = l.vocab_size;
  s.hidden_size = l.hidden_size;
  s.intermediate_size = l.intermediate_size;
  s.n_heads = l.num_attention_heads;
  s.n_kv_heads = l.num_key_value_heads;
  s.head_dim = l.head_dim;
  s.max_position_embeddings = l.max_position_embeddings;
  s.attention_bias = l.attention_bias;
  s.tie_word_embeddings = l.tie_word_embeddings;
  return s;
}

// What the planner is asked: the trainer's configuration, as the trainer would run it.
struct Question {
  plan::TransformerShape shape;  // architecture llama: its n_layers, vocab, hidden_size and heads
  std::optional<plan::LlamaShape> llama;
  plan::ActivationOptions activations;
  plan::TransformerSharding sharding;
  plan::PlanOptions options;
  std::string strategy;
  DataParallelShape mesh;
  std::string backend;             // and why: "gloo", "mpi (FSDP_BACKEND)", ...
  std::string threads;             // how the ranks' threads are set, for the step time
  double resident_data_bytes = 0;  // a token file, held whole by every rank for the whole run
};

// data.source: tokens: the trainer reads the token file whole into an int64 tensor on every rank
// (data.cpp); its header (tools/fsdp-train/data.h) says how many tokens.
double token_file_tensor_bytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  unsigned char header[32] = {};
  if (!f || !f.read(reinterpret_cast<char*>(header), sizeof header) || std::memcmp(header, "FSDPTOK", 8) != 0)
    throw ConfigError("data.path: " + path +
                      " is not a readable token file (the plan counts its tokens, which "
                      "every rank keeps in memory); make one with `fsdp-train tokenize`");
  uint64_t tokens = 0;
  for (int i = 0; i < 8; ++i) tokens |= static_cast<uint64_t>(header[24 + i]) << (8 * i);
  return 8.0 * static_cast<double>(tokens);
}

bool variable_is(const char* name, const std::string& value) {
  const char* v = std::getenv(name);
  return v && value == v;
}

// The ranks' threads, as the launcher and this environment set them: fsdprun gives each of
// several workers OMP_NUM_THREADS=1 (and OPENBLAS_NUM_THREADS as OMP's) unless they are set; a
// rank alone keeps the libraries' defaults unless both variables say 1.
plan::Threads threads_of(int local_world, std::string& described) {
  const char* omp = std::getenv("OMP_NUM_THREADS");
  const bool blas_one = !std::getenv("OPENBLAS_NUM_THREADS") || variable_is("OPENBLAS_NUM_THREADS", "1");
  if (local_world > 1 ? (!omp || variable_is("OMP_NUM_THREADS", "1")) && blas_one
                      : variable_is("OMP_NUM_THREADS", "1") && variable_is("OPENBLAS_NUM_THREADS", "1")) {
    described = "one thread per rank";
    return plan::Threads::kOnePerRank;
  }
  described = "the libraries' own threads (no OMP_NUM_THREADS=1, OPENBLAS_NUM_THREADS=1)";
  return plan::Threads::kLibraryDefaults;
}

// The backend the trainer's collectives would run on. auto is mpi only when mpirun or srun starts
// the job, which a plan cannot know: it plans fsdprun's gloo. FSDP_BACKEND wins, as in the trainer.
plan::Backend backend_of(const FsdpConfig& f, std::string& described) {
  const char* env = std::getenv("FSDP_BACKEND");
  std::string name = f.backend;
  described = f.backend == "auto" ? "gloo (backend: auto under fsdprun; plan mpirun's with "
                                    "--fsdp_config.backend=mpi)"
                                  : f.backend;
  if (env && *env) {
    name = env;
    if (name != "gloo" && name != "mpi")
      throw ConfigError("FSDP_BACKEND=" + name + " in the environment: expected gloo or mpi");
    described = name + " (FSDP_BACKEND in the environment)";
  }
  return name == "mpi" ? plan::Backend::kMpi : plan::Backend::kGloo;
}

// The optimizer the trainer builds (trainer.cpp's optimizer_of).
plan::Optimizer optimizer_of(const TrainConfig& cfg) {
  if (steps_with_device_state_adamw(cfg)) return plan::Optimizer::kDeviceStateAdamW;
  return cfg.optimizer.fused ? plan::Optimizer::kFusedAdamW : plan::Optimizer::kAdamW;
}

Question question_of(const TrainConfig& cfg, const PlanArgs& a) {
  const auto& f = cfg.fsdp_config;
  // What the trainer refuses (fp16 on cpu, the optimizer state offloaded alone on cuda, ...),
  // named. A plan for a GPU needs none here: it is checked as if this machine had one.
  DeviceSupport planned = device_support_for(cfg);
  if (f.device == "cuda") planned.cuda = true;
  check_supported(cfg, planned);
  Question q;
  const auto& t = cfg.training;
  if (is_llama(cfg.model)) {
    check_llama_supported(cfg);
    if (cfg.fsdp_config.output_head_group)
      throw ConfigError(
          "fsdp_config.output_head_group: true with model.architecture llama: fsdp-train plan does not model the "
          "Llama's head group yet; plan it with output_head_group: false or measure a few steps");
    if (cfg.fsdp_config.model_parallel_size > 1)
      throw ConfigError("fsdp_config.model_parallel_size: " + std::to_string(cfg.fsdp_config.model_parallel_size) +
                        " with model.architecture llama: fsdp-train plan does not model the Llama family's tensor "
                        "parallelism yet; plan it with model_parallel_size 1 (FSDP alone) or measure a few steps");
    q.llama = llama_shape_of(llama_args_of(cfg.model, t.seq_len));
    q.shape = {q.llama->n_layers, q.llama->vocab_size, q.llama->max_position_embeddings, q.llama->hidden_size,
               q.llama->n_heads};
  } else {
    const models::ModelArgs preset = models::ModelArgs::preset(cfg.model.preset);
    const auto& m = cfg.model;
    q.shape = {m.n_layers.value_or(preset.n_layers),       m.vocab_size.value_or(preset.vocab_size),
               m.max_seq_len.value_or(preset.max_seq_len), m.dim.value_or(preset.dim),
               m.n_heads.value_or(preset.n_heads),         m.dropout_p.value_or(preset.dropout_p)};
    check_model_parallel(cfg, a.world, q.shape.n_heads, q.shape.dim, q.shape.vocab_size);
  }
  const int local = a.local_world > 0 ? a.local_world : a.world;
  q.sharding.tensor_parallel = f.model_parallel_size;
  q.sharding.vocab_parallel = f.vocab_parallel;
  q.sharding.output_head_group = f.output_head_group;
  q.mesh = data_parallel_shape(cfg, a.world, local);
  q.strategy = to_string(f.sharding_strategy);
  // The planner counts every parameter as trained and every block as resharding fully.
  if (f.prefetch_depth > 1)
    throw ConfigError("fsdp-train plan does not model fsdp_config.prefetch_depth: " + std::to_string(f.prefetch_depth) +
                      " (more groups gathered ahead) yet; plan with prefetch_depth: 1, FSDP2's implicit prefetch");
  if (f.reshard_after_forward)
    throw ConfigError(
        "fsdp-train plan does not model fsdp_config.reshard_after_forward (a group size) yet; unset "
        "it to plan the strategy's full resharding");
  if (!cfg.model.freeze.empty())
    throw ConfigError(
        "fsdp-train plan does not model model.freeze yet (frozen parameters have no gradient or "
        "optimizer state); leave it out to plan with every parameter trained, an upper bound");
  const Precision precision = precision_of(f);
  q.activations.micro_batch = t.micro_batch_size;
  q.activations.seq = t.seq_len > 0 ? t.seq_len : q.shape.max_seq_len;
  q.activations.compute = dtype_of(precision.param);
  q.activations.checkpoint_every = f.activation_checkpointing ? f.activation_checkpointing_every : 0;
  q.activations.loss_chunks = t.loss_chunks;
  if (cfg.data.source == "tokens") q.resident_data_bytes = token_file_tensor_bytes(cfg.data.path);
  // The tp ranks of one dp rank train on the same rows.
  q.activations.global_rows =
      static_cast<int64_t>(a.world / f.model_parallel_size) * t.gradient_accumulation_steps * t.micro_batch_size;
  const bool no_shard = f.sharding_strategy == ShardingStrategy::NO_SHARD;
  q.options.world(a.world)
      .local_world(local)
      .replicate(no_shard ? 1 : q.mesh.replicate)
      .no_shard(no_shard)
      .reshard_after_forward(no_shard || reshard_after_forward(cfg))
      .param_dtype(dtype_of(precision.param))
      .reduce_dtype(dtype_of(precision.reduce))
      .device(f.device == "cuda" ? plan::Device::kCuda : plan::Device::kCpu)
      .offload(f.offload_params)
      .optimizer(optimizer_of(cfg))
      .micro_batches(t.gradient_accumulation_steps)
      .backend(backend_of(f, q.backend))
      .threads(threads_of(local, q.threads))
      // train() saves in the background every checkpoint_interval steps before the last.
      .background_checkpoints(f.checkpoint_interval > 0 && f.checkpoint_interval < t.steps);
  // A cuda mesh's groups run on NCCL (src/tensor/device_mesh.cpp), whatever fsdp_config.backend says.
  if (f.device == "cuda")
    q.backend = "nccl (a cuda mesh's groups; FSDP_CUDA_BACKEND=gloo would stage them through host memory, not planned)";
  if (!a.constants.empty()) {
    const std::string text = read_file(a.constants, {a.constants + " is a directory", "cannot open " + a.constants,
                                                     "reading " + a.constants + " failed"});
    try {
      q.options.constants(plan::constants_from_json(text));
    } catch (const std::invalid_argument& e) {
      throw ConfigError("--constants " + a.constants + ": " + e.what());
    }
  }
  return q;
}

// The model as the planner sees it; for the Llama family, n_layers and dim (hidden_size) come from
// q.shape, which largest_fitting varies.
plan::ModelSpec model_spec_of(const Question& q, const plan::ActivationOptions& activations) {
  if (!q.llama) return plan::transformer_spec(q.shape, activations, q.sharding);
  plan::LlamaShape l = *q.llama;
  l.n_layers = q.shape.n_layers;
  l.hidden_size = q.shape.dim;
  return plan::llama_spec(l, activations, q.sharding);
}

plan::Plan plan_of(const Question& q) {
  try {
    plan::ModelSpec model = model_spec_of(q, q.activations);
    model.input_bytes += q.resident_data_bytes;
    return plan::plan(model, q.options);
  } catch (const std::invalid_argument& e) {
    throw ConfigError(e.what());
  }
}

int64_t parameter_count(const Question& q) {
  const plan::ModelSpec m = model_spec_of(q, plan::ActivationOptions{1, 1});
  int64_t n = 0;
  for (const auto& g : m.groups)
    for (const auto& p : g.params) n += p.numel();
  return n;
}

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
  const int64_t step = layers ? 1 : q.shape.n_heads;
  auto fits = [&](int64_t k) {
    if (layers) q.shape.n_layers = k;
    else q.shape.dim = k * step;
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
    << parameter_count(q) << " parameters (" << q.shape.n_layers << " layers, dim " << q.shape.dim << ", "
    << q.shape.n_heads << " heads, vocab " << q.shape.vocab_size << "), " << q.strategy << " (" << q.mesh.replicate
    << " x " << q.mesh.shard << ")"
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
  if (coll.empty()) {
    s << "collectives per step: none (nothing to gather or reduce at this world size)\n";
  } else {
    s << "collectives per step (bytes: the whole gathered / reduced buffers):\n";
    for (const auto& c : coll)
      s << "  " << c.group << ": " << c.kind << " on the " << c.mesh << " mesh x" << c.count << ", "
        << (gpu ? kib_or_mib(c.bytes) : mib(c.bytes)) << "\n";
  }
  if (!p.step_time_modeled) {
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
      << "): up to n_layers " << layers << " at dim " << q.shape.dim << ", or up to dim " << dim << " at n_layers "
      << q.shape.n_layers << (layers == 0 ? " (not even 1 layer fits)" : "") << "\n";
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
  const Question q = question_of(cfg, a);
  const plan::Plan p = plan_of(q);
  if (a.json) print_json(p, q, cfg, a);
  else print_text(p, q, cfg, a);
  return kExitOk;
}

}  // namespace train
}  // namespace fsdp
