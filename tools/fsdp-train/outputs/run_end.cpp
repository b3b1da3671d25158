// run_end.cpp — the end of a run and its counters (run_end.h).
#include "outputs/run_end.h"

#include "common/agreement.h"
#include "models/hf_checkpoint.h"
#include "outputs/sample.h"

#include <fsdp/memory.h>
#include <fsdp/safetensors.h>
#include <fsdp/state_dict.h>
#include <fsdp/trace.h>

#include <ATen/Parallel.h>

#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>

namespace fsdp {
namespace train {
namespace {

constexpr double kMiB = 1024.0 * 1024.0;

static_assert(kNumCollectiveKinds == kCollectiveKinds, "report.h names every kind of collective");

// One mesh dim's collectives between two snapshots of its group's counters, per kind.
MeshDimTotals dim_totals(const CollectiveStats& before, const CollectiveStats& after) {
  MeshDimTotals t;
  for (int k = 0; k < kNumCollectiveKinds; ++k) {
    const CollectiveCounters &b = before.by_kind[k], &a = after.by_kind[k];
    t.by_kind[k] = KindTotals{static_cast<double>(a.calls - b.calls), static_cast<double>(a.bytes_sent - b.bytes_sent),
                              1e-9 * static_cast<double>(a.busy_ns - b.busy_ns),
                              1e-9 * static_cast<double>(a.blocked_ns - b.blocked_ns)};
  }
  return t;
}

// The names the summary gives the mesh's dims: the mesh's own, or "dp" for the trainer's
// unnamed 1-D data-parallel mesh.
std::vector<std::string> dim_labels(const DeviceMesh& mesh) {
  if (!mesh.dim_names().empty()) return mesh.dim_names();
  std::vector<std::string> labels;
  for (int64_t d = 0; d < mesh.ndim(); ++d) labels.push_back(mesh.ndim() == 1 ? "dp" : "dim" + std::to_string(d));
  return labels;
}

// training.export hf (to <checkpoint_dir>/hf) or hf:<dir>.
bool is_hf_export(const TrainConfig& cfg) {
  const std::string& e = cfg.training.export_path;
  return e == "hf" || e.rfind("hf:", 0) == 0;
}

at::ScalarType hf_export_dtype(const TrainConfig& cfg) {
  const std::string& d = cfg.training.export_dtype;
  return d == "bfloat16" ? at::kBFloat16 : d == "float16" ? at::kHalf : at::kFloat;
}

std::string resolved_export_path(const TrainConfig& cfg) {
  const std::string& e = cfg.training.export_path;
  if (e == "none") return "";
  if (e == "auto") return cfg.fsdp_config.checkpoint_dir + "/model.pt";
  if (e == "hf") return cfg.fsdp_config.checkpoint_dir + "/hf";
  if (e.rfind("hf:", 0) == 0) return e.substr(3);
  return e;
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

RankTotals my_totals(const ParallelModel& pm, const RunRecord& record, size_t warmup) {
  RankTotals mine;
  mine.median_step_s = median_after(record.step_times, warmup);
  mine.peak_rss_mib = memory::peak_rss_bytes() / kMiB;
  mine.peak_tensor_mib = tensor_memory(pm.mesh).peak_mib;
  mine.build_peak_tensor_mib = static_cast<double>(pm.build_peak_tensor_bytes) / kMiB;
  const CommSeconds comm(record.comm_before, mesh_stats(pm.mesh));
  mine.ag_s = comm.all_gather, mine.ag_wait_s = comm.all_gather_wait;
  mine.rs_s = comm.reduce_scatter, mine.rs_wait_s = comm.reduce_scatter_wait;
  mine.ar_s = comm.all_reduce, mine.ar_wait_s = comm.all_reduce_wait;
  mine.ag_bytes = comm.all_gather_bytes, mine.rs_bytes = comm.reduce_scatter_bytes;
  mine.ar_bytes = comm.all_reduce_bytes;
  const std::vector<CollectiveStats> now = mesh_dim_stats(pm.mesh);
  for (size_t d = 0; d < now.size(); ++d)
    mine.by_mesh_dim.push_back(dim_totals(record.comm_before_by_dim.at(d), now[d]));
  return mine;
}

RunShape run_shape(const TrainConfig& cfg, const ModelShape& args, const ParallelModel& pm, const Precision& precision,
                   int64_t seq) {
  RunShape s;
  s.world = get_world_size();
  s.preset = cfg.model.preset;
  s.params = pm.parameter_count;
  s.batch = cfg.training.micro_batch_size;
  s.gradient_accumulation_steps = cfg.training.gradient_accumulation_steps;
  s.seq = seq;
  s.torch_threads = at::get_num_threads();
  s.param_dtype = to_string(precision.param), s.reduce_dtype = to_string(precision.reduce);
  s.n_layers = args.n_layers, s.vocab_size = args.vocab_size, s.max_seq_len = args.max_seq_len;
  s.dim = args.dim, s.n_heads = args.n_heads, s.dropout_p = args.dropout_p;
  s.model_parallel_size = pm.tp;
  s.vocab_parallel = pm.tp > 1 && cfg.fsdp_config.vocab_parallel;
  s.mesh_dim_names = dim_labels(pm.mesh);
  s.mesh_shape = pm.mesh.shape();
  return s;
}

// Whether `path`, a folder (is_dir) or a file, can be written by this process, without creating
// or changing it: it is a folder or a file as expected, and the folder that will hold it (itself
// or the nearest existing folder above it, where the run would create the rest) takes a probe
// file, written and removed. "" when it can; otherwise why not.
std::string unwritable(const std::string& path, bool is_dir, int rank) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::path p(path);
  if (fs::exists(p, ec)) {
    if (is_dir && !fs::is_directory(p, ec)) return path + " exists and is not a folder";
    if (!is_dir && fs::is_directory(p, ec)) return path + " is a folder, not a file";
  }
  fs::path folder = is_dir ? p : p.parent_path();
  if (folder.empty()) folder = ".";
  while (!fs::exists(folder, ec) && folder.has_parent_path() && folder.parent_path() != folder)
    folder = folder.parent_path();
  if (!fs::is_directory(folder, ec)) return path + " cannot be created: " + folder.string() + " is not a folder";
  const fs::path probe = folder / (".fsdp-train-probe-" + std::to_string(::getpid()) + "-" + std::to_string(rank));
  bool written = false;
  {
    std::ofstream f(probe);
    written = static_cast<bool>(f << "probe\n" << std::flush);
  }
  const int err = errno;
  fs::remove(probe, ec);
  if (!written)
    return path + " cannot be written: writing in " + folder.string() + " fails (" + std::strerror(err) + ")";
  if (!is_dir && fs::exists(p, ec) && ::access(path.c_str(), W_OK) != 0)
    return path + " cannot be written (" + std::strerror(errno) + ")";
  return "";
}

}  // namespace

bool writes_export(const TrainConfig& cfg) { return !resolved_export_path(cfg).empty(); }

std::string export_destination(const TrainConfig& cfg) { return resolved_export_path(cfg); }

void check_output_destinations(const TrainConfig& cfg) {
  const int rank = get_rank();
  // key, path, folder (or file), and whether this rank writes it.
  struct Destination {
    std::string key, path;
    bool is_dir, mine;
  };
  std::vector<Destination> all;
  const std::string e = resolved_export_path(cfg);
  if (!e.empty()) {
    // safetensors and Hugging Face exports: a folder every rank writes its file into.
    const bool folder = is_hf_export(cfg) || ends_with(e, ".safetensors");
    all.push_back({"training.export", e, folder, folder || rank == 0});
  }
  const std::string jsonl = jsonl_path_for_rank(cfg.logging.jsonl, rank);
  if (!jsonl.empty()) all.push_back({"logging.jsonl", jsonl, false, true});
  if (!cfg.logging.tensorboard_dir.empty())
    all.push_back({"logging.tensorboard_dir", cfg.logging.tensorboard_dir, true, rank == 0});
  if (!cfg.logging.summary_json.empty())
    all.push_back({"logging.summary_json", cfg.logging.summary_json, false, rank == 0});
  if (cfg.logging.trace) all.push_back({"logging.trace_dir", cfg.logging.trace_dir, true, true});
  std::string problem;
  for (const Destination& d : all) {
    if (!d.mine) continue;
    const std::string why = unwritable(d.path, d.is_dir, rank);
    if (!why.empty()) problem += (problem.empty() ? "" : "; ") + d.key + ": " + why;
  }
  try {
    throw_unless_every_rank_ok(problem, "an output of the run cannot be written, found before the first step");
  } catch (const std::runtime_error& error) {
    throw ConfigError(error.what());
  }
}

std::vector<CollectiveStats> mesh_dim_stats(const DeviceMesh& mesh) {
  std::vector<CollectiveStats> by_dim;
  for (int64_t d = 0; d < mesh.ndim(); ++d) by_dim.push_back(mesh.get_group(d)->stats());
  return by_dim;
}

CollectiveStats mesh_stats(const DeviceMesh& mesh) {
  CollectiveStats sum;
  for (const CollectiveStats& s : mesh_dim_stats(mesh)) {
    for (int k = 0; k < kNumCollectiveKinds; ++k) {
      CollectiveCounters& to = sum.by_kind[k];
      const CollectiveCounters& from = s.by_kind[k];
      to.calls += from.calls, to.bytes_sent += from.bytes_sent, to.bytes_received += from.bytes_received;
      to.busy_ns += from.busy_ns, to.blocked_ns += from.blocked_ns;
    }
  }
  return sum;
}

CommSeconds::CommSeconds(const CollectiveStats& before, const CollectiveStats& after) {
  auto secs = [&](CollectiveKind k, int64_t CollectiveCounters::*ns) {
    return 1e-9 * static_cast<double>(after[k].*ns - before[k].*ns);
  };
  auto sent = [&](CollectiveKind k) { return static_cast<double>(after[k].bytes_sent - before[k].bytes_sent); };
  all_gather = secs(CollectiveKind::kAllGather, &CollectiveCounters::busy_ns);
  all_gather_wait = secs(CollectiveKind::kAllGather, &CollectiveCounters::blocked_ns);
  reduce_scatter = secs(CollectiveKind::kReduceScatter, &CollectiveCounters::busy_ns);
  reduce_scatter_wait = secs(CollectiveKind::kReduceScatter, &CollectiveCounters::blocked_ns);
  all_reduce = secs(CollectiveKind::kAllReduce, &CollectiveCounters::busy_ns);
  all_reduce_wait = secs(CollectiveKind::kAllReduce, &CollectiveCounters::blocked_ns);
  all_gather_bytes = sent(CollectiveKind::kAllGather);
  reduce_scatter_bytes = sent(CollectiveKind::kReduceScatter);
  all_reduce_bytes = sent(CollectiveKind::kAllReduce);
}

void write_summary(const TrainConfig& cfg, const ModelShape& args, const ParallelModel& pm, const Precision& precision,
                   const RunRecord& record, Console* console) {
  RunSummary s;
  s.steps_run = record.steps_run;
  s.precision = precision.describe();
  s.warmup = summary_warmup_steps(cfg.logging.summary_warmup, record.step_times.size());
  const RankTotals mine = my_totals(pm, record, s.warmup);
  const std::vector<double> all = all_gather_numbers(mine.to_vector());
  if (get_rank() != 0) return;
  const size_t dims = mine.by_mesh_dim.size(), fields = RankTotals::field_count(dims);
  for (int q = 0; q < get_world_size(); ++q) s.ranks.push_back(RankTotals::from(all.data() + q * fields, dims));
  s.median_step_s = mine.median_step_s;
  s.tokens_per_s = static_cast<double>(record.tokens_per_step) / mine.median_step_s;
  s.losses = record.losses;
  s.step_s = record.step_times;
  if (console) console->finish();
  std::cout << format_summary(s) << std::flush;
  if (!cfg.logging.summary_json.empty())
    write_summary_json(cfg.logging.summary_json, run_shape(cfg, args, pm, precision, record.seq), s);
}

std::string write_trace(const TrainConfig& cfg, int rank) {
  if (!cfg.logging.trace) return "";
  trace::stop();
  std::filesystem::create_directories(cfg.logging.trace_dir);
  const std::string path = cfg.logging.trace_dir + "/trace_rank" + std::to_string(rank) + ".json";
  const int64_t n = trace::write_chrome_trace(path, rank);
  return "trace: " + path + " (" + std::to_string(n) + " spans; one file per rank, open in ui.perfetto.dev)";
}

void export_and_sample(const TrainConfig& cfg, const ModelFamily& family, ParallelModel& pm, const Tokenizer* tokenizer,
                       const std::function<void(const std::string&)>& print) {
  torch::nn::Module& model = pm.module();
  const std::string path = resolved_export_path(cfg);
  if (is_hf_export(cfg)) {
    save_hf(path, family, model, hf_export_dtype(cfg));
    print("export: " + path + " (Hugging Face directory, " + cfg.training.export_dtype +
          ": transformers.AutoModelForCausalLM.from_pretrained)");
  }
  if (!path.empty() && ends_with(path, ".safetensors")) {
    save_safetensors(sharded_state_dict(model), path);
    print("export: " + path + " (safetensors)");
  }
  const bool pytorch_export = !path.empty() && !ends_with(path, ".safetensors") && !is_hf_export(cfg);
  if (!pytorch_export && cfg.sample.length == 0) return;
  // Rank 0 receives the whole model (every rank takes part in the gathers).
  const TensorStateDict full = full_state_dict(model, FullStateDictOptions().rank0_only(true));
  if (get_rank() != 0) return;
  if (pytorch_export) {
    const auto parent = std::filesystem::path(path).parent_path();
    if (!parent.empty()) std::filesystem::create_directories(parent);
    save_pytorch_state_dict(full, path);
    print("export: " + path + " (PyTorch state dict: torch.load() in Python)");
  }
  if (cfg.sample.length > 0) print(generate_sample(family, full, cfg.sample, tokenizer));
}

}  // namespace train
}  // namespace fsdp
