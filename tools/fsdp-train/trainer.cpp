// trainer.cpp — one fsdp-train run: the configuration turned into model, sharding, optimizer and
// data; resume; the training loop; the stops (non-finite loss, signal); and the end of the run
// (final checkpoint, trace, summary, export, sample). The checkpoint's key layout lives in
// checkpoint_state.cpp, the LR schedule in schedule.cpp, sampling in sample.cpp, the start-up
// check of native bf16 in hardware.cpp and what is printed or written as metrics in report.cpp.
//
// Per optimizer step every rank runs k = gradient_accumulation_steps micro-batches; only the
// last one reduce-scatters (set_requires_gradient_sync), so k micro-batches of B rows give the
// gradients of one batch of kB rows. Then the global gradient norm (clip_grad_norm_, which also
// clips the gradients), and ONE small all-gather of every rank's step numbers (loss, gradient
// norm, a stop request, a failed background save) BEFORE the optimizer steps: every rank takes
// the same decision at the same step, and a non-finite step is never applied. Then AdamW. The
// other ranks' memory numbers are gathered only for the steps rank 0 prints.
//
// Mixed precision (fsdp_config.mixed_precision, param_dtype, reduce_dtype; config.h) is one
// MixedPrecisionPolicy given to every fully_shard call; the loss is computed in fp32, and the
// shards the optimizer and checkpoints hold stay fp32, so a checkpoint resumes under any policy.
#include "trainer.h"

#include "agreement.h"
#include "checkpoint_state.h"
#include "dcp_checkpoints.h"
#include "data.h"
#include "errors.h"
#include "hardware.h"
#include "model_size.h"
#include "report.h"
#include "resume.h"
#include "run_identity.h"
#include "run_lock.h"
#include "sample.h"
#include "schedule.h"
#include "stop_signal.h"

#include <fsdp/call.h>
#include <fsdp/checkpoint.h>
#include <fsdp/dcp.h>
#include <fsdp/checkpoint_activations.h>
#include <fsdp/clip_grad.h>
#include <fsdp/device_mesh.h>
#include <fsdp/distributed.h>
#include <fsdp/fully_shard.h>
#include <fsdp/tensor_parallel.h>
#include <fsdp/fused_adamw.h>
#include <fsdp/memory.h>
#include <fsdp/mixed_precision.h>
#include <fsdp/models/parallelize.h>
#include <fsdp/models/transformer.h>
#include <fsdp/replicate.h>
#include <fsdp/safetensors.h>
#include <fsdp/state_dict.h>
#include <fsdp/trace.h>

#include <ATen/Functions.h>
#include <torch/nn/functional/loss.h>
#include <torch/optim/adamw.h>
#include <torch/utils.h>

#include <cerrno>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <unistd.h>
#include <vector>

namespace fsdp {
namespace train {
namespace {

constexpr double kMiB = 1024.0 * 1024.0;

// ---------------------------------------------------------------------- configuration -> objects

models::ModelArgs model_args_of(const ModelConfig& m) {
  models::ModelArgs a = models::ModelArgs::preset(m.preset);
  if (m.n_layers) a.n_layers = *m.n_layers;
  if (m.vocab_size) a.vocab_size = *m.vocab_size;
  if (m.max_seq_len) a.max_seq_len = *m.max_seq_len;
  if (m.dim) a.dim = *m.dim;
  if (m.n_heads) a.n_heads = *m.n_heads;
  if (m.dropout_p) a.dropout_p = *m.dropout_p;
  if (a.dim % a.n_heads != 0)
    throw ConfigError("model.dim (" + std::to_string(a.dim) + ") must be divisible by model.n_heads (" +
                      std::to_string(a.n_heads) + ")");
  return a;
}

// Says where both values come from, as the loader's own errors do: the line of each key, or
// the preset that gave max_seq_len.
std::string seq_len_too_long(const TrainConfig& cfg, int64_t seq, int64_t max_seq_len) {
  const std::string seq_at = origin_of(cfg, "training.seq_len"), max_at = origin_of(cfg, "model.max_seq_len");
  const std::string max_from = max_at.empty() ? "model.preset " + cfg.model.preset + "'s" : "set at " + max_at;
  return (seq_at.empty() ? std::string() : seq_at + ": ") + "training.seq_len (" + std::to_string(seq) +
         ") is longer than model.max_seq_len (" + std::to_string(max_seq_len) + ", " + max_from +
         "); lower training.seq_len or raise model.max_seq_len";
}

int64_t seq_len_of(const TrainConfig& cfg, const models::ModelArgs& a) {
  const int64_t seq = cfg.training.seq_len > 0 ? cfg.training.seq_len : a.max_seq_len;
  if (seq > a.max_seq_len) throw ConfigError(seq_len_too_long(cfg, seq, a.max_seq_len));
  if (cfg.training.loss_chunks > seq)
    throw ConfigError("training.loss_chunks (" + std::to_string(cfg.training.loss_chunks) +
                      ") is more than the sequence has positions (training.seq_len " + std::to_string(seq) +
                      "); use at most one piece per position");
  return seq;
}

// Before anything is allocated: a model or batch this machine cannot hold (model_size.h).
void check_memory(const TrainConfig& cfg, const models::ModelArgs& a, int64_t seq, const RendezvousInfo& env) {
  const ModelSizes m{a.n_layers, a.vocab_size, a.max_seq_len, a.dim, a.n_heads};
  const DataParallelShape shape = data_parallel_shape(cfg, env.world_size, env.local_world_size);
  const StepSizes s{env.world_size, env.local_world_size, cfg.training.micro_batch_size,
                    cfg.training.gradient_accumulation_steps, seq, shape.shard};
  check_fits_in_memory(m, s, machine_memory_bytes());
}

at::ScalarType scalar_type(Dtype d) {
  switch (d) {
    case Dtype::kFloat32: return at::kFloat;
    case Dtype::kBFloat16: return at::kBFloat16;
    case Dtype::kFloat16: return at::kHalf;
  }
  return at::kFloat;
}

// FSDP2's policy for the configured dtypes. A dtype left at fp32 stays unset: the parameters
// are fp32, and FSDP2 computes and reduces in their dtype by default. reduce_dtype unset means
// "as param_dtype", so it is set whenever it differs from the compute dtype.
MixedPrecisionPolicy mp_policy_of(const Precision& p) {
  MixedPrecisionPolicy policy;
  if (p.param != Dtype::kFloat32) policy.param_dtype(scalar_type(p.param));
  if (p.reduce != p.param) policy.reduce_dtype(scalar_type(p.reduce));
  return policy;
}

InitOptions init_options(const FsdpConfig& f) {
  InitOptions o;
  if (f.collective_timeout_s)
    o.timeout(std::chrono::milliseconds(static_cast<int64_t>(std::llround(*f.collective_timeout_s * 1000))));
  if (f.backend != "auto") o.backend(f.backend);
  return o;
}

// Why the checkpoint directory cannot take checkpoints ("" when it can): created if needed,
// then a probe file written and removed.
std::string checkpoint_dir_problem(const std::string& dir) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (fs::exists(dir, ec) && !fs::is_directory(dir, ec)) return dir + " exists and is not a directory";
  fs::create_directories(dir, ec);
  if (ec) return "cannot create " + dir + " (" + ec.message() + ")";
  const std::string probe = dir + "/.fsdp-train-probe-" + std::to_string(::getpid());
  bool written = false;
  {
    std::ofstream f(probe);
    written = static_cast<bool>(f << "probe\n" << std::flush);
  }
  const int err = errno;
  fs::remove(probe, ec);
  return written ? "" : "cannot write in " + dir + " (" + std::strerror(err) + ")";
}

// The parameters of an init_from file that hold NaN or infinite values, as "name (n of m)".
std::vector<std::string> non_finite_tensors(const TensorStateDict& sd) {
  std::vector<std::string> bad;
  for (const auto& item : sd) {
    const at::Tensor& t = item.value();
    if (!t.is_floating_point()) continue;
    const int64_t n = t.numel() - t.isfinite().sum().item<int64_t>();
    if (n > 0) bad.push_back(item.key() + " (" + std::to_string(n) + " of " + std::to_string(t.numel()) + ")");
  }
  return bad;
}

std::unique_ptr<DataSource> data_of(const TrainConfig& cfg, const models::ModelArgs& a) {
  if (cfg.data.source == "synthetic") return synthetic_data(a.vocab_size, cfg.data.data_seed);
  std::unique_ptr<DataSource> d = token_file_data(cfg.data.path, cfg.data.data_seed);
  if (d->vocab_size() > a.vocab_size)
    throw ConfigError("data.path " + cfg.data.path + " has a vocabulary of " + std::to_string(d->vocab_size()) +
                      " but model.vocab_size is " + std::to_string(a.vocab_size) + "; raise model.vocab_size");
  return d;
}

// A directory of safetensors files: what training.export=<name>.safetensors writes, or any
// Hugging Face layout (an index and its files, or one model.safetensors).
bool is_safetensors_dir(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  return fs::is_directory(path, ec) && (fs::exists(fs::path(path) / "model.safetensors.index.json", ec) ||
                                        fs::exists(fs::path(path) / "model.safetensors", ec));
}

// Lists the tensors with NaN or infinite values, or "" when there are none.
std::string non_finite_problem(const TensorStateDict& sd, const std::string& where) {
  const std::vector<std::string> bad = non_finite_tensors(sd);
  if (bad.empty()) return "";
  std::string list;
  for (const auto& b : bad) list += (list.empty() ? "" : ", ") + b;
  return std::to_string(bad.size()) + " tensor(s) hold NaN or infinite values" + where + ": " + list +
         "; training cannot start from them";
}

// model.init_from: a file (ConfigError naming the key otherwise) that loads as a state dict
// (errors name the key and the file) of finite values. `ignored` receives the other entries of
// a bundle ("'epoch' (int)"), which are read but not used.
TensorStateDict init_state_dict(const std::string& path, std::vector<std::string>* ignored) {
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) throw ConfigError("model.init_from: " + path + " does not exist");
  if (std::filesystem::is_directory(path, ec))
    throw ConfigError("model.init_from: " + path + " is a directory without model.safetensors.index.json or "
                      "model.safetensors; expected a file written by torch.save, or a safetensors directory");
  TensorStateDict sd;
  try {
    sd = load_pytorch_state_dict(path, ignored);
  } catch (const std::exception& e) {
    throw std::runtime_error("model.init_from " + path + ": " + error_text(e));
  }
  const std::string problem = non_finite_problem(sd, "");
  if (problem.empty()) return sd;
  throw std::runtime_error("model.init_from " + path + ": " + problem);
}

std::string resolved_export_path(const TrainConfig& cfg) {
  const std::string& e = cfg.training.export_path;
  if (e == "none") return "";
  if (e == "auto") return cfg.fsdp_config.checkpoint_dir + "/model.pt";
  return e;
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// Seconds of all-gather, reduce-scatter and all-reduce between two snapshots of the mesh's
// counters: busy on the communication threads, and waited for by the training thread (exposed);
// and the payload bytes this rank sent.
struct CommSeconds {
  CommSeconds(const CollectiveStats& before, const CollectiveStats& after) {
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
  double all_gather, all_gather_wait, reduce_scatter, reduce_scatter_wait, all_reduce, all_reduce_wait;
  double all_gather_bytes, reduce_scatter_bytes, all_reduce_bytes;
};

// The counters of each process group of `mesh`, one per dim: the shard group and, on a 2-D
// mesh, the replicate group or (model_parallel_size > 1) the tp group, whose all-reduces the
// tensor-parallel layers issue.
std::vector<CollectiveStats> mesh_dim_stats(const DeviceMesh& mesh) {
  std::vector<CollectiveStats> by_dim;
  for (int64_t d = 0; d < mesh.ndim(); ++d) by_dim.push_back(mesh.get_group(d)->stats());
  return by_dim;
}

// The same, summed over the dims.
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

// A number for a message: NaN and infinities spelled out (a stream writes "-nan").
std::string shown(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  std::ostringstream s;
  s << v;
  return s.str();
}

// The sharded state dict's tensors have the full parameters' sizes.
int64_t full_parameter_count(models::Transformer& model) {
  int64_t n = 0;
  for (const auto& item : sharded_state_dict(*model)) {
    int64_t numel = 1;
    for (int64_t d : item.value().sizes()) numel *= d;
    n += numel;
  }
  return n;
}

// What every rank decided about a step from everyone's numbers (the same on every rank).
struct StepVotes {
  double loss = 0;               // the global-batch mean
  double grad_norm = 0;          // rank 0's (all ranks computed the same all-reduced norm)
  bool non_finite = false;       // any rank's loss or gradient norm is NaN or infinite
  bool stop_requested = false;   // a rank received SIGTERM/SIGINT
  std::vector<int> save_failed;  // the ranks whose background save failed
  std::vector<double> local_losses;
};

// ---------------------------------------------------------------------- the run

class Run {
 public:
  explicit Run(const TrainConfig& cfg) : cfg_(cfg), precision_(precision_of(cfg.fsdp_config)) {}
  int main();

 private:
  void set_up();
  void join_job(const RendezvousInfo& env);
  void check_checkpoint_dir();
  void shard_model();
  void freeze_parameters();
  void build_sharded_model(const MixedPrecisionPolicy& policy, const std::optional<CPUOffloadPolicy>& offload);
  void load_initial_weights();
  void load_initial_safetensors(const std::string& path);
  std::string data_parallel_description() const;
  void set_gradient_sync_for(int64_t micro);
  void resume();
  std::string agreed_resume_dir();
  void load_resume_checkpoint(const std::string& dir);
  std::string older_checkpoint_hint(const std::string& dir) const;
  void start_logging();
  int train();
  std::string save_checkpoint(int64_t step);
  void save_checkpoint_in_background(int64_t step);
  std::string save_dcp_checkpoint(int64_t step);
  bool dcp_format() const { return cfg_.fsdp_config.checkpoint_format == "dcp"; }
  void poll_background_save();
  StepReport compute_step(int64_t step);
  StepVotes vote_on_step(const StepReport& r);
  void apply_step(StepReport& r);
  void set_learning_rate(double lr);
  double forward_backward(const at::Tensor& batch, int64_t micro, StepReport& r);
  void optimizer_step();
  void report_step(StepReport& r, const StepVotes& votes);
  int stop_non_finite(int64_t step, const StepVotes& votes);
  int stop_on_failed_save(int64_t step, const StepVotes& votes);
  int stop_on_signal(int64_t step);
  std::string last_good_checkpoint();
  void write_trace();
  void finish(int64_t last_step);
  void export_and_sample();
  void build_tensor_parallel_model(FullyShardOptions block_options, FullyShardOptions root_options);
  void write_summary(int64_t steps_run);
  RankTotals my_totals(size_t warmup) const;
  RunShape run_shape();
  int64_t tokens_per_step() const { return static_cast<int64_t>(dp_world_) * accumulation_ * batch_ * seq_; }
  void print(const std::string& text) {
    if (rank_ != 0) return;
    if (console_) console_->line(text);
    else std::cout << text << "\n" << std::flush;  // before the console exists (resume)
  }
  // One line on stderr from this rank, whichever it is.
  void print_error(const std::string& text) const {
    std::cerr << "fsdp-train: rank " << rank_ << ": " << text << "\n" << std::flush;
  }

  const TrainConfig& cfg_;
  const Precision precision_;
  int rank_ = 0, world_ = 1;
  // The data-parallel ranks: every rank, or with model_parallel_size k the world / k rows of the
  // (dp, tp) mesh, whose k tp ranks train on the same rows.
  int dp_rank_ = 0, dp_world_ = 1, tp_ = 1;
  models::ModelArgs args_;
  int64_t seq_ = 0, batch_ = 0, accumulation_ = 1;
  LrSchedule schedule_;
  int64_t parameter_count_ = 0;  // of the whole model, not of this rank's shards
  int64_t build_peak_tensor_bytes_ = 0;  // peak of tensor bytes while building and sharding the model
  std::unique_ptr<DataSource> data_;
  DataParallelShape shape_;  // replicas x shards of the data-parallel mesh
  DeviceMesh mesh_;
  models::Transformer model_{nullptr};
  FSDPModule root_;             // FULL_SHARD, SHARD_GRAD_OP, HYBRID_SHARD*
  ReplicatedModule replicated_;  // NO_SHARD
  std::unique_ptr<torch::optim::AdamW> optimizer_;
  CheckpointDirLock dir_lock_;  // rank 0's, held until the run ends (released after checkpoints_'s last save)
  std::unique_ptr<CheckpointManager> checkpoints_;
  std::unique_ptr<Console> console_;
  JsonlWriter jsonl_;

  int64_t start_step_ = 0;  // steps done before this process started (restored from a checkpoint)
  int64_t done_steps_ = 0;  // optimizer steps done so far
  int64_t tokens_seen_ = 0;
  int64_t last_saved_step_ = -1;
  std::string last_saved_dir_;     // the checkpoint of last_saved_step_ when resumed from or saved in the
                                   // foreground (finish() names it; it never runs after a background save)
  int64_t background_step_ = -1;   // the step the latest background save is writing
  std::string save_error_;         // this rank's failed background save, as poll() reported it
  std::vector<double> losses_, step_times_;
  CollectiveStats comm_before_;
  std::vector<CollectiveStats> comm_before_by_dim_;
};

void Run::set_up() {
  const RendezvousInfo env = rendezvous_info_from_env();
  check_against_launcher(cfg_, env.world_size, env.local_rank);
  args_ = model_args_of(cfg_.model);
  seq_ = seq_len_of(cfg_, args_);
  check_memory(cfg_, args_, seq_, env);
  batch_ = cfg_.training.micro_batch_size;
  accumulation_ = cfg_.training.gradient_accumulation_steps;
  schedule_ = lr_schedule(cfg_);
  data_ = data_of(cfg_, args_);

  join_job(env);
  check_checkpoint_dir();
  check_model_parallel(cfg_, world_, args_.n_heads, args_.dim, args_.vocab_size);
  shape_ = data_parallel_shape(cfg_, world_, env.local_world_size);
  check_reshard_group(cfg_, shape_);
  tp_ = cfg_.fsdp_config.model_parallel_size;
  if (tp_ > 1) {
    // Row-major: each tp group is tp_ consecutive ranks, each dp group a column.
    mesh_ = init_device_mesh("cpu", {world_ / tp_, tp_}, {"dp", "tp"});
  } else {
    // HSDP: row-major, so each replica's shard group is world / replicate_degree consecutive ranks.
    mesh_ = shape_.hybrid ? init_device_mesh("cpu", {shape_.replicate, shape_.shard}, {"replicate", "shard"})
                          : init_device_mesh("cpu", {world_});
  }
  dp_world_ = world_ / tp_;
  dp_rank_ = tp_ > 1 ? static_cast<int>(mesh_.get_local_rank(0)) : rank_;
  shard_model();
  parameter_count_ = full_parameter_count(model_);

  const auto& o = cfg_.optimizer;
  const auto options = torch::optim::AdamWOptions(o.lr).betas({o.beta1, o.beta2}).eps(o.eps).weight_decay(o.weight_decay);
  // FusedAdamW is an AdamW (same state and checkpoints), so the rest of the trainer needs no branch.
  if (o.fused) {
    optimizer_ = std::make_unique<optim::FusedAdamW>(model_->parameters(), options);
  } else {
    optimizer_ = std::make_unique<torch::optim::AdamW>(model_->parameters(), options);
  }
  checkpoints_ = std::make_unique<CheckpointManager>(cfg_.fsdp_config.checkpoint_dir,
                                                     static_cast<int>(cfg_.training.keep_checkpoints));
  checkpoints_->set_attributes(run_identity(cfg_, args_));
}

// The process group, with fsdp_config.collective_timeout_s; the library lets
// FSDP_COLLECTIVE_TIMEOUT_MS win over it, and then the run says so rather than ignore the key.
// Decided from the timeout in force, not from the variable: the library ignores an empty one.
void Run::join_job(const RendezvousInfo& env) {
  const InitOptions options = init_options(cfg_.fsdp_config);
  if (cfg_.fsdp_config.backend == "mpi" && !mpi_available()) {
    throw ConfigError("fsdp_config.backend: mpi, but this build has no MPI backend (CMake found no MPI): install "
                      "libopenmpi-dev (scripts/install-deps.sh) and rebuild, or use gloo");
  }
  init_process_group(env, options);
  rank_ = get_rank();
  world_ = get_world_size();
  if (cfg_.fsdp_config.backend != "auto" && backend() != cfg_.fsdp_config.backend) {
    print("fsdp-train: note: FSDP_BACKEND=" + backend() + " in the environment selects the process-group backend; "
          "fsdp_config.backend (" + cfg_.fsdp_config.backend + ") is not used");
  }
  const std::chrono::milliseconds in_force = world()->timeout();
  if (!cfg_.fsdp_config.collective_timeout_s || in_force == options.timeout()) return;
  std::ostringstream note;
  note << "fsdp-train: note: FSDP_COLLECTIVE_TIMEOUT_MS=" << in_force.count() << " in the environment sets the "
       << "collective timeout; fsdp_config.collective_timeout_s (" << *cfg_.fsdp_config.collective_timeout_s
       << " s) is not used";
  print(note.str());
}

// At start-up rather than at the first save, which can be hours in: rank 0 creates the
// directory, writes a probe file and takes the directory's lock (run_lock.h), and every rank
// stops together when that fails.
void Run::check_checkpoint_dir() {
  std::string problem;
  if (rank_ == 0) {
    problem = checkpoint_dir_problem(cfg_.fsdp_config.checkpoint_dir);
    if (problem.empty()) problem = dir_lock_.acquire(cfg_.fsdp_config.checkpoint_dir);
  }
  problem = from_rank0(problem);
  if (!problem.empty()) throw ConfigError("fsdp_config.checkpoint_dir: " + problem);
}

// Every block is its own FSDP unit, the root holds the rest (embeddings, final norm, output).
void Run::shard_model() {
  // One policy for every group, the root included (torchtitan's choice): the root's
  // embeddings, final norm and output head compute in param_dtype too. Its inputs are token
  // ids, which no policy casts; the model returns fp32 logits, and the loss is fp32.
  const MixedPrecisionPolicy policy = mp_policy_of(precision_);
  // A CPU build has no pinned memory; the copies are identities on a cpu device anyway.
  std::optional<CPUOffloadPolicy> offload;
  if (cfg_.fsdp_config.offload_params) offload = CPUOffloadPolicy().pin_memory(false);
  // Same seed on every rank: fully_shard keeps each rank's piece of identical weights.
  torch::manual_seed(cfg_.training.seed);
  memory::reset_peak_allocated();
  if (cfg_.fsdp_config.sharding_strategy == ShardingStrategy::NO_SHARD) {
    // Whole parameters on every rank, gradients averaged in buckets during backward (DDP). The
    // gradients are views of the buckets: backward accumulates into what is all-reduced, so
    // there is neither a copy nor a second set of gradients in memory.
    model_ = models::Transformer(args_);
    freeze_parameters();  // before replicate, which buckets only what trains
    replicated_ = replicate(model_, ReplicateOptions().mesh(mesh_).gradient_as_bucket_view(true));
  } else {
    build_sharded_model(policy, offload);
    freeze_parameters();  // the shards: FSDP follows their requires_grad
  }
  if (cfg_.fsdp_config.activation_checkpointing) {
    model_->set_activation_checkpointing(cfg_.fsdp_config.activation_checkpointing_every,
                                         CheckpointOptions().use_reentrant(cfg_.fsdp_config.use_reentrant));
  }
  build_peak_tensor_bytes_ = memory::max_allocated_bytes();
  load_initial_weights();
}

// Every block is its own group; the root holds the rest (embeddings, final norm, output). On
// a 2-D mesh (HYBRID_SHARD*) the same calls shard within each replica. Each block is sharded
// as soon as it is built, so no rank ever holds the whole model: the largest trainable model is
// bounded by the shards, not by one rank's memory. The values are those of building the whole
// model first (fully_shard draws no random numbers), so a seed gives the same run either way.
void Run::build_sharded_model(const MixedPrecisionPolicy& policy, const std::optional<CPUOffloadPolicy>& offload) {
  const bool reshard = reshard_after_forward(cfg_);
  FullyShardOptions block_options =
      FullyShardOptions().mesh(mesh_).reshard_after_forward(reshard).mp_policy(policy).offload_policy(offload);
  if (cfg_.fsdp_config.reshard_after_forward) block_options.reshard_after_forward(*cfg_.fsdp_config.reshard_after_forward);
  // The root's parameters are needed first in backward, so it keeps them gathered (FSDP2's
  // default for the root) unless SHARD_GRAD_OP says to keep everything anyway.
  FullyShardOptions root_options = FullyShardOptions().mesh(mesh_).mp_policy(policy).offload_policy(offload);
  if (!reshard) root_options.reshard_after_forward(false);
  if (tp_ > 1) {
    build_tensor_parallel_model(block_options, root_options);
  } else if (cfg_.fsdp_config.output_head_group) {
    // The head runs backward first, so keeping it gathered from forward saves an all-gather and
    // no memory (torchtitan does the same for its last group); it reshards after its backward.
    FullyShardOptions head_options = block_options;
    head_options.reshard_after_forward(false);
    model_ = models::sharded_transformer(args_, block_options, head_options, root_options);
  } else {
    model_ = models::sharded_transformer(args_, block_options, root_options);
  }
  root_ = get_fsdp_module(*model_);
}

// model_parallel_size k > 1: each block is split over tp as soon as it is built (the Megatron
// plan: fsdp::models::parallelize), then sharded over dp; with vocab_parallel the token embedding
// and the output head are split by vocabulary over tp; the root shards what it holds (the
// embeddings, the final norm, the head) over dp.
void Run::build_tensor_parallel_model(FullyShardOptions block_options, FullyShardOptions root_options) {
  const auto dp_dims = DataParallelMeshDims().shard("dp");
  block_options.dp_mesh_dims(dp_dims);
  root_options.dp_mesh_dims(dp_dims);
  const tp::TensorParallelMesh tp_mesh(mesh_, "tp");
  model_ = models::Transformer(args_, [&](models::TransformerBlock& block) {
    models::parallelize_block(*block, args_, tp_mesh);
    fully_shard(block, block_options);
  });
  if (cfg_.fsdp_config.vocab_parallel) models::parallelize_vocab(*model_, tp_mesh);
  tp::register_replicated(*model_, tp_mesh);
  fully_shard(model_, root_options);
}

// model.freeze: requires_grad = false on every parameter an entry names (the parameter itself,
// or a module above it). An entry that names nothing is a configuration error, so a typo never
// trains what was meant to stay fixed.
void Run::freeze_parameters() {
  for (const std::string& entry : cfg_.model.freeze) {
    bool found = false;
    for (auto& item : model_->named_parameters()) {
      const std::string& name = item.key();
      if (name != entry && name.rfind(entry + ".", 0) != 0) continue;
      item.value().set_requires_grad(false);
      found = true;
    }
    if (!found)
      throw ConfigError("model.freeze: '" + terminal_safe(entry) + "' names no parameter of the model (names are "
                        "like tok_embeddings, layers.0.attention.wq.weight)");
  }
}

// model.init_from, into whatever the strategy made of the model. A safetensors directory is
// read a rank's rows at a time, so that a model built sharded is never whole on any rank; a
// torch.save file is read whole by every rank.
void Run::load_initial_weights() {
  if (cfg_.model.init_from.empty()) return;
  const std::string& path = cfg_.model.init_from;
  if (is_safetensors_dir(path)) {
    load_initial_safetensors(path);
    return;
  }
  std::vector<std::string> ignored;
  const TensorStateDict sd = init_state_dict(path, &ignored);
  if (!ignored.empty()) {
    std::string list;
    for (const auto& entry : ignored) list += (list.empty() ? "" : ", ") + entry;
    print(terminal_safe("fsdp-train: note: model.init_from " + path + " is a bundle: only its model state dict is "
                        "loaded; these entries are ignored (nothing of them runs): " + list));
  }
  try {
    load_full_state_dict(*model_, sd);
  } catch (const std::exception& e) {
    throw std::runtime_error("model.init_from " + path + ": " + error_text(e));
  }
}

// Each rank reads its own rows and checks them; the ranks agree before any weight is replaced,
// so that all stop together when one rank's rows are unreadable or not finite.
void Run::load_initial_safetensors(const std::string& path) {
  ShardedStateDict loaded;
  std::string problem;
  try {
    loaded = load_safetensors(path, sharded_state_dict(*model_));
    TensorStateDict local;
    for (const auto& item : loaded) local.insert(item.key(), item.value().to_local());
    problem = non_finite_problem(local, " in this rank's rows");
  } catch (const std::exception& e) {
    problem = error_text(e);
  }
  throw_unless_every_rank_ok(problem, "model.init_from " + path);
  load_sharded_state_dict(*model_, loaded);
}

// Returns the directory written.
std::string Run::save_checkpoint(int64_t step) {
  if (dcp_format()) return save_dcp_checkpoint(step);
  const std::string dir =
      checkpoints_->save(step, checkpoint_state(*model_, *optimizer_, mesh_, {done_steps_, tokens_seen_}));
  last_saved_step_ = step;
  last_saved_dir_ = dir;
  return dir;
}

// Training goes on while it is written; a failure is noticed by poll_background_save(). A DCP
// checkpoint is written in the foreground (save_dcp has no background writer).
void Run::save_checkpoint_in_background(int64_t step) {
  if (dcp_format()) {
    save_checkpoint(step);
    return;
  }
  checkpoints_->save_async(step, checkpoint_state(*model_, *optimizer_, mesh_, {done_steps_, tokens_seen_}));
  background_step_ = step;
  last_saved_step_ = step;
}

// checkpoint_dir/step_<N> in DCP layout; then rank 0 prunes to training.keep_checkpoints
// (save_dcp returns on every rank only once the checkpoint is complete).
std::string Run::save_dcp_checkpoint(int64_t step) {
  const std::string dir = dcp_step_dir(cfg_.fsdp_config.checkpoint_dir, step);
  save_dcp_state(dir, *model_, *optimizer_, done_steps_, cfg_.optimizer.lr);
  if (rank_ == 0) {
    const std::string problems = prune_dcp(cfg_.fsdp_config.checkpoint_dir, cfg_.training.keep_checkpoints, dir);
    if (!problems.empty()) print("checkpoint: pruning old checkpoints: " + terminal_safe(problems));
  }
  last_saved_step_ = step;
  last_saved_dir_ = dir;
  return dir;
}

// A failed background save is noticed at the next step, not at the next save.
void Run::poll_background_save() {
  if (!save_error_.empty()) return;
  try {
    checkpoints_->poll();
  } catch (const std::exception& e) {
    save_error_ = error_text(e);
  }
}

// training.resume: rank 0 chooses (resume.h) and says what it found; every rank then loads the
// same checkpoint, or every rank stops naming the ranks that could not.
void Run::resume() {
  const std::string dir = agreed_resume_dir();
  if (dir.empty()) return;
  load_resume_checkpoint(dir);
  print("resumed from " + dir + " at step " + std::to_string(start_step_));
}

// Rank 0's choice, on every rank: "D<dir>", or "C<message>" / "E<message>" for a configuration
// / runtime error that every rank then throws.
std::string Run::agreed_resume_dir() {
  std::string mine;
  if (rank_ == 0) {
    try {
      const ResumeChoice c = resume_choice(cfg_.training.resume, *checkpoints_, cfg_.fsdp_config.checkpoint_dir,
                                           run_identity(cfg_, args_), cfg_.training.allow_resume_mismatch);
      for (const auto& note : c.notes) print(terminal_safe(note));
      mine = "D" + c.dir;
    } catch (const ConfigError& e) {
      mine = "C" + std::string(e.what());
    } catch (const std::exception& e) {
      mine = "E" + error_text(e);
    }
  }
  const std::string decided = from_rank0(mine);
  const std::string text = decided.substr(1);
  const std::string seen_by = rank_ == 0 ? text : "rank 0 found no checkpoint to resume from (see its message)";
  if (decided[0] == 'C') throw ConfigError(seen_by);
  if (decided[0] == 'E') throw std::runtime_error(seen_by);
  return text;
}

void Run::load_resume_checkpoint(const std::string& dir) {
  std::string why;
  const bool dcp = is_dcp_dir(dir);  // a DCP checkpoint, whatever checkpoint_format this run writes
  const bool readable = dcp ? is_complete_dcp(dir, &why) : CheckpointManager::is_complete(dir, &why);
  throw_unless_every_rank_ok(readable ? "" : why, "cannot resume from " + dir + ", which rank 0 chose");
  std::string problem;
  try {
    if (dcp) {
      // Every step trains tokens_per_step() tokens: the count follows from the steps.
      start_step_ = done_steps_ = load_dcp_state(dir, *model_, *optimizer_);
      tokens_seen_ = done_steps_ * tokens_per_step();
    } else {
      const TrainerCounters counters = load_checkpoint_state(dir, *model_, *optimizer_, mesh_);
      start_step_ = done_steps_ = counters.steps_done;
      tokens_seen_ = counters.tokens_seen;
    }
  } catch (const std::exception& e) {
    problem = error_text(e);
  }
  try {
    throw_unless_every_rank_ok(problem, "cannot load the checkpoint " + dir);
  } catch (const std::runtime_error& e) {
    throw std::runtime_error(e.what() + older_checkpoint_hint(dir));
  }
  last_saved_step_ = start_step_;
  last_saved_dir_ = dir;
}

// A checkpoint that scans complete can still fail its checksums; the older one that would
// load is named, since training.resume: auto would choose the broken one again (rank 0 says
// it; the other ranks' lines stay short).
std::string Run::older_checkpoint_hint(const std::string& dir) const {
  if (rank_ != 0) return "";
  const std::string root = std::filesystem::path(dir).parent_path().string();
  const std::optional<std::string> older = older_complete_checkpoint(root, dir);
  if (!older) return ". No older complete checkpoint is left under " + root;
  const std::string again = cfg_.training.resume == "auto" ? " (training.resume: auto would choose " + dir + " again)" : "";
  return ". The older complete checkpoint " + *older + " may load: run again with training.resume: " + *older +
         " to continue from it" + again;
}

// "sharded over 4 rank(s), FULL_SHARD", "replicated on 4 rank(s), NO_SHARD", or for HSDP
// "sharded over 2 rank(s) in each of 2 replicas, HYBRID_SHARD".
std::string Run::data_parallel_description() const {
  const std::string strategy = to_string(cfg_.fsdp_config.sharding_strategy);
  if (replicated_.valid()) return "replicated on " + std::to_string(world_) + " rank(s), " + strategy;
  std::string where = "sharded over " + std::to_string(shape_.shard) + " rank(s)";
  if (shape_.hybrid) where += " in each of " + std::to_string(shape_.replicate) + " replicas";
  if (tp_ > 1) {
    where += " (dp) x tensor-parallel over " + std::to_string(tp_) + " (tp";
    where += cfg_.fsdp_config.vocab_parallel ? ", embedding and head split by vocabulary)" : ", embedding and head whole)";
  }
  return where + ", " + strategy;
}

// The console, this rank's JSONL file and the opening line.
void Run::start_logging() {
  console_ = std::make_unique<Console>(rank_ == 0 ? cfg_.logging.progress : "off", start_step_, cfg_.training.steps);
  const std::string jsonl = jsonl_path_for_rank(cfg_.logging.jsonl, rank_);
  if (!jsonl.empty()) jsonl_.open(jsonl, /*append=*/start_step_ > 0);
  std::ostringstream hello;
  hello << "fsdp-train: " << parameter_count_ << " parameters (" << args_.n_layers << " layers, dim " << args_.dim
        << ", " << args_.n_heads << " heads, vocab " << args_.vocab_size << ", max_seq_len " << args_.max_seq_len
        << ") " << data_parallel_description() << ", "
        << precision_.describe() << "; " << data_->describe() << "; global batch " << dp_world_ * accumulation_ * batch_
        << " x " << seq_ << " tokens; collectives on " << backend();
  print(hello.str());
  // Only rank 0 probes (its line is the one printed); the others go on to the first step's
  // all-gather and wait there the ~50 ms it takes.
  if (rank_ == 0 && precision_.param == Dtype::kBFloat16) print(check_bf16_support());
  if (rank_ == 0 && cfg_.fsdp_config.offload_params && cfg_.fsdp_config.device == "cpu") {
    print("fsdp-train: offload_params: on device cpu the sharded parameters, gradients and optimizer state "
          "already live in host memory; the offload path runs with identity copies");
  }
}

int Run::main() {
  set_up();
  resume();
  // The whole model built before sharding, a loaded state dict or checkpoint: blocks that the
  // training steps will not ask for again. Give them back instead of keeping them cached.
  memory::empty_cache();
  start_logging();
  if (start_step_ >= cfg_.training.steps) {
    print("training already complete at step " + std::to_string(start_step_) + " (training.steps " +
          std::to_string(cfg_.training.steps) + ")");
    finish(start_step_);
    return kExitOk;
  }
  return train();
}

// The loop, from the step after start_step_ to training.steps; returns the exit code. A step
// is computed, voted on by every rank, and only then applied.
int Run::train() {
  if (cfg_.logging.trace) {
    trace::start();
    trace::set_thread_name("train");
  }
  comm_before_ = mesh_stats(mesh_);
  comm_before_by_dim_ = mesh_dim_stats(mesh_);
  const int64_t interval = cfg_.fsdp_config.checkpoint_interval;
  for (int64_t step = start_step_ + 1; step <= cfg_.training.steps; ++step) {
    StepReport r = compute_step(step);
    poll_background_save();
    const StepVotes votes = vote_on_step(r);
    if (votes.non_finite) return stop_non_finite(step, votes);
    if (!votes.save_failed.empty()) return stop_on_failed_save(step, votes);
    apply_step(r);
    done_steps_ = step;
    report_step(r, votes);
    if (votes.stop_requested) return stop_on_signal(step);
    if (interval > 0 && step % interval == 0 && step < cfg_.training.steps) save_checkpoint_in_background(step);
  }
  finish(cfg_.training.steps);
  return kExitOk;
}

void Run::set_learning_rate(double lr) {
  for (auto& group : optimizer_->param_groups()) static_cast<torch::optim::AdamWOptions&>(group.options()).lr(lr);
}

// Micro-batch `micro` of the step's global batch: forward and backward, timed into r. Returns
// the micro-batch's loss (already divided by the number of micro-batches).
double Run::forward_backward(const at::Tensor& batch, int64_t micro, StepReport& r) {
  set_gradient_sync_for(micro);
  auto [inputs, targets] = micro_batch(batch, dp_rank_, accumulation_, micro, batch_);
  const double f0 = now_seconds();
  at::Tensor loss;
  {
    trace::Span span("compute", "forward");
    // The loss in fp32 whatever the compute dtype (torchtitan's .float()): a bf16 log-softmax
    // over the vocabulary loses the small differences training follows.
    // training.loss_chunks > 1 computes it a piece of the sequence at a time (forward_loss).
    loss = call_method(model_, &models::TransformerImpl::forward_loss, inputs, targets, cfg_.training.loss_chunks);
    if (accumulation_ > 1) loss = loss / static_cast<double>(accumulation_);
  }
  const double b0 = now_seconds();
  {
    trace::Span span("compute", "backward");
    loss.backward();
  }
  r.forward_s += b0 - f0;
  r.backward_s += now_seconds() - b0;
  return loss.item<double>();
}

// Gradient accumulation: the reductions of one step's micro-batches. NO_SHARD all-reduces and
// FULL_SHARD / SHARD_GRAD_OP reduce-scatter only after the last micro-batch (before, the whole
// gradients accumulate on every rank). HSDP reduce-scatters every micro-batch, so only 1/shards
// of the gradients accumulates, and all-reduces across replicas only after the last one.
void Run::set_gradient_sync_for(int64_t micro) {
  const bool last = micro == accumulation_ - 1;
  if (replicated_.valid()) {
    replicated_.set_requires_gradient_sync(last);
  } else if (shape_.hybrid) {
    root_.set_requires_gradient_sync(true);
    root_.set_requires_all_reduce(last);
  } else {
    root_.set_requires_gradient_sync(last);
  }
}

// AdamW on the gradients compute_step has already clipped.
void Run::optimizer_step() {
  trace::Span span("compute", "optimizer");
  optimizer_->step();
  // Drop the gradients rather than zeroing them (PyTorch's zero_grad(set_to_none=True)): the
  // next backward's reduce-scatter writes fresh ones, and forward runs without them in memory.
  // NO_SHARD's gradients are views of its all-reduce buckets, which stay allocated anyway:
  // zeroed in place they stay views, and the next backward accumulates straight into them.
  at::NoGradGuard no_grad;
  for (auto& group : optimizer_->param_groups()) {
    for (auto& p : group.params()) {
      if (replicated_.valid() && p.grad().defined()) {
        p.mutable_grad().zero_();
      } else {
        p.mutable_grad() = at::Tensor();
      }
    }
  }
}

// Forward, backward, the global gradient norm and clipping of step `step`; nothing applied yet.
StepReport Run::compute_step(int64_t step) {
  StepReport r;
  r.step = step;
  r.steps = cfg_.training.steps;
  r.lr = lr_at(schedule_, step);
  r.precision = precision_.describe();
  set_learning_rate(r.lr);
  const at::Tensor batch = data_->global_batch(step - 1, dp_world_ * accumulation_ * batch_, seq_);
  const CollectiveStats comm_start = mesh_stats(mesh_);
  memory::reset_peak_allocated();

  trace::Span step_span("compute", "step " + std::to_string(step));
  const double t0 = now_seconds();
  double loss_sum = 0;
  for (int64_t m = 0; m < accumulation_; ++m) loss_sum += forward_backward(batch, m, r);
  r.loss = loss_sum;  // this rank's mean over its rows (the micro-batch losses are already / k)
  const double n0 = now_seconds();
  {
    // The norm before clipping, and the gradients scaled by max_norm / (norm + 1e-6) when that is
    // below 1; an infinite max_norm (clipping off) never scales. Clipping before the vote is
    // safe: the gradients of a step the vote stops are never applied, whatever clipping made
    // of them.
    trace::Span span("compute", "grad_norm");
    const double max_norm = cfg_.training.max_grad_norm;
    r.grad_norm = clip_grad_norm_(model_->parameters(), max_norm > 0 ? max_norm : INFINITY);
  }
  r.optimizer_s = now_seconds() - n0;
  r.step_s = now_seconds() - t0;

  const CommSeconds comm(comm_start, mesh_stats(mesh_));
  r.ag_busy_s = comm.all_gather;
  r.ag_wait_s = comm.all_gather_wait;
  r.rs_busy_s = comm.reduce_scatter;
  r.rs_wait_s = comm.reduce_scatter_wait;
  return r;
}

// The per-step all-gather: every rank's loss, gradient norm, stop request and failed save.
StepVotes Run::vote_on_step(const StepReport& r) {
  constexpr size_t kFields = 4;
  const std::vector<double> all = all_gather_numbers(
      {r.loss, r.grad_norm, stop_signal() != 0 ? 1.0 : 0.0, save_error_.empty() ? 0.0 : 1.0});
  StepVotes v;
  v.grad_norm = all[1];
  for (int q = 0; q < world_; ++q) {
    const double* p = all.data() + q * kFields;
    v.local_losses.push_back(p[0]);
    v.loss += p[0] / world_;
    v.non_finite = v.non_finite || !std::isfinite(p[0]) || !std::isfinite(p[1]);
    v.stop_requested = v.stop_requested || p[2] != 0.0;
    if (p[3] != 0.0) v.save_failed.push_back(q);
  }
  return v;
}

// AdamW, timed into r, and the step's token counts.
void Run::apply_step(StepReport& r) {
  const double o0 = now_seconds();
  optimizer_step();
  const double o = now_seconds() - o0;
  r.optimizer_s += o;
  r.step_s += o;
  tokens_seen_ += tokens_per_step();
  r.tokens_seen = tokens_seen_;
  r.tokens_per_s = tokens_per_step() / r.step_s;
}

// Logs an applied step: the JSONL line of every rank, and rank 0's step line, for which the
// other ranks' memory numbers are gathered (only on the steps it prints).
void Run::report_step(StepReport& r, const StepVotes& votes) {
  const RankStep mine{r.loss, memory::allocated_bytes() / kMiB, memory::max_allocated_bytes() / kMiB,
                      memory::current_rss_bytes() / kMiB};
  r.loss = votes.loss;
  // Off the printed steps only this rank's entry is read (its JSONL line).
  r.ranks.assign(world_, RankStep{});
  r.ranks[rank_] = mine;
  const bool printed = r.step % cfg_.logging.log_interval == 0 || r.step == cfg_.training.steps;
  if (printed) {
    const std::vector<double> all = all_gather_numbers({mine.live_mib, mine.peak_mib, mine.rss_mib});
    for (int q = 0; q < world_; ++q)
      r.ranks[q] = RankStep{votes.local_losses[q], all[3 * q], all[3 * q + 1], all[3 * q + 2]};
  }
  losses_.push_back(r.loss);
  step_times_.push_back(r.step_s);
  jsonl_.write(r, rank_);
  if (rank_ != 0) return;
  if (printed) console_->step_line(r);
  else console_->progress(r.step);
}

// After any background save has ended: the newest complete checkpoint as rank 0 sees it
// ("none" when there is none; "" on the other ranks). Every checkpoint saved holds finite
// values only: a non-finite step is never applied.
std::string Run::last_good_checkpoint() {
  try {
    checkpoints_->wait();
  } catch (const std::exception& e) {
    if (save_error_.empty()) save_error_ = error_text(e);
  }
  if (rank_ != 0) return "";
  const CheckpointManager::Scan scan = checkpoints_->scan();
  const std::optional<std::string> dir =
      dcp_format() ? newest_complete_dcp(cfg_.fsdp_config.checkpoint_dir) : resumable_checkpoint(scan);
  return dir ? *dir : std::string("none");
}

// Every rank gets here at the same step (the votes are the same everywhere). The step was not
// applied: no optimizer step, nothing saved.
int Run::stop_non_finite(int64_t step, const StepVotes& votes) {
  const std::string good = last_good_checkpoint();
  std::ostringstream msg;
  msg << "fsdp-train: stopping at step " << step << ": the loss is " << shown(votes.loss) << " and the gradient norm is "
      << shown(votes.grad_norm) << " (non-finite); this step was not applied (no optimizer step) and nothing of it is "
      << "saved. The last good checkpoint is " << good << ". Lower optimizer.lr";
  if (cfg_.training.max_grad_norm > 0) msg << " (clipping at training.max_grad_norm cannot help a non-finite norm)";
  else msg << " or set training.max_grad_norm (clipping is off)";
  msg << ", then run again with training.resume: auto.";
  print(msg.str());
  write_trace();
  return kExitNonFinite;
}

// Every rank stops at the same step (the failed save travels with the step's votes), each with
// one line; the checkpoint before the failed one stays complete and resumable.
int Run::stop_on_failed_save(int64_t step, const StepVotes& votes) {
  const std::string good = last_good_checkpoint();
  std::string ranks;
  for (int q : votes.save_failed) ranks += (ranks.empty() ? "" : ", ") + std::to_string(q);
  const std::string saved = "the checkpoint of step " + std::to_string(background_step_);
  std::string line = !save_error_.empty()
                         ? "saving " + saved + " failed: " + save_error_
                         : "stopping at step " + std::to_string(step) + ": rank(s) " + ranks + " failed saving " + saved;
  if (rank_ == 0)
    line += "; stopped at step " + std::to_string(step) + " (not applied); the last complete checkpoint is " + good +
            ": fix the cause and run again with training.resume: auto";
  print_error(line);
  write_trace();
  return kExitError;
}

// Every rank gets here at the same step (the stop request travels with the step's votes).
int Run::stop_on_signal(int64_t step) {
  const std::string dir = save_checkpoint(step);
  const int sig = stop_signal() ? stop_signal() : SIGTERM;  // another rank's signal
  print("fsdp-train: stop requested (signal " + std::to_string(sig) + "): saved step " + std::to_string(step) +
        " to " + dir + "; run again with training.resume: auto to continue");
  write_trace();
  return 128 + sig;
}

void Run::write_trace() {
  if (!cfg_.logging.trace) return;
  trace::stop();
  std::filesystem::create_directories(cfg_.logging.trace_dir);
  const std::string path = cfg_.logging.trace_dir + "/trace_rank" + std::to_string(rank_) + ".json";
  const int64_t n = trace::write_chrome_trace(path, rank_);
  print("trace: " + path + " (" + std::to_string(n) + " spans; one file per rank, open in ui.perfetto.dev)");
}

void Run::finish(int64_t last_step) {
  if (cfg_.fsdp_config.checkpoint_interval > 0 && last_saved_step_ != last_step) save_checkpoint(last_step);
  checkpoints_->wait();
  if (last_saved_step_ == last_step) print("checkpoint: " + last_saved_dir_);
  write_trace();
  if (last_step > start_step_) write_summary(last_step - start_step_);
  export_and_sample();
}

// training.export (.safetensors: written by every rank from its shards; otherwise one PyTorch
// file written by rank 0), then the sample.
void Run::export_and_sample() {
  const std::string path = resolved_export_path(cfg_);
  if (!path.empty() && ends_with(path, ".safetensors")) {
    save_safetensors(sharded_state_dict(*model_), path);
    print("export: " + path + " (safetensors)");
  }
  const bool pytorch_export = !path.empty() && !ends_with(path, ".safetensors");
  if (!pytorch_export && cfg_.sample.length == 0) return;
  // Rank 0 receives the whole model (every rank takes part in the gathers).
  const TensorStateDict full = full_state_dict(*model_, FullStateDictOptions().rank0_only(true));
  if (rank_ != 0) return;
  if (pytorch_export) {
    const auto parent = std::filesystem::path(path).parent_path();
    if (!parent.empty()) std::filesystem::create_directories(parent);
    save_pytorch_state_dict(full, path);
    print("export: " + path + " (PyTorch state dict: torch.load() in Python)");
  }
  // Byte-level data: the prompt's bytes, and the sample printed as text; otherwise token ids.
  const bool byte_level = cfg_.data.source == "tokens" && data_->vocab_size() <= 256;
  if (cfg_.sample.length > 0) print(generate_sample(args_, full, cfg_.sample, byte_level));
}

RankTotals Run::my_totals(size_t warmup) const {
  RankTotals mine;
  mine.median_step_s = median_after(step_times_, warmup);
  mine.peak_rss_mib = memory::peak_rss_bytes() / kMiB;
  mine.peak_tensor_mib = memory::max_allocated_bytes() / kMiB;
  mine.build_peak_tensor_mib = static_cast<double>(build_peak_tensor_bytes_) / kMiB;
  const CommSeconds comm(comm_before_, mesh_stats(mesh_));
  mine.ag_s = comm.all_gather, mine.ag_wait_s = comm.all_gather_wait;
  mine.rs_s = comm.reduce_scatter, mine.rs_wait_s = comm.reduce_scatter_wait;
  mine.ar_s = comm.all_reduce, mine.ar_wait_s = comm.all_reduce_wait;
  mine.ag_bytes = comm.all_gather_bytes, mine.rs_bytes = comm.reduce_scatter_bytes;
  mine.ar_bytes = comm.all_reduce_bytes;
  const std::vector<CollectiveStats> now = mesh_dim_stats(mesh_);
  for (size_t d = 0; d < now.size(); ++d) mine.by_mesh_dim.push_back(dim_totals(comm_before_by_dim_.at(d), now[d]));
  return mine;
}

RunShape Run::run_shape() {
  RunShape s;
  s.world = world_;
  s.preset = cfg_.model.preset;
  s.params = parameter_count_;
  s.batch = batch_;
  s.gradient_accumulation_steps = accumulation_;
  s.seq = seq_;
  s.torch_threads = at::get_num_threads();
  s.param_dtype = to_string(precision_.param), s.reduce_dtype = to_string(precision_.reduce);
  s.n_layers = args_.n_layers, s.vocab_size = args_.vocab_size, s.max_seq_len = args_.max_seq_len;
  s.dim = args_.dim, s.n_heads = args_.n_heads, s.dropout_p = args_.dropout_p;
  s.model_parallel_size = tp_;
  s.vocab_parallel = tp_ > 1 && cfg_.fsdp_config.vocab_parallel;
  s.mesh_dim_names = dim_labels(mesh_);
  s.mesh_shape = mesh_.shape();
  return s;
}

// Every rank's totals go to rank 0, which prints the summary (and writes logging.summary_json).
void Run::write_summary(int64_t steps_run) {
  RunSummary s;
  s.steps_run = steps_run;
  s.precision = precision_.describe();
  s.warmup = summary_warmup_steps(cfg_.logging.summary_warmup, step_times_.size());
  const RankTotals mine = my_totals(s.warmup);
  const std::vector<double> all = all_gather_numbers(mine.to_vector());
  if (rank_ != 0) return;
  const size_t dims = mine.by_mesh_dim.size(), fields = RankTotals::field_count(dims);
  for (int q = 0; q < world_; ++q) s.ranks.push_back(RankTotals::from(all.data() + q * fields, dims));
  s.median_step_s = mine.median_step_s;
  s.tokens_per_s = static_cast<double>(tokens_per_step()) / mine.median_step_s;
  s.losses = losses_;
  s.step_s = step_times_;
  console_->finish();
  std::cout << format_summary(s) << std::flush;
  if (!cfg_.logging.summary_json.empty()) write_summary_json(cfg_.logging.summary_json, run_shape(), s);
}

}  // namespace

int run_training(const TrainConfig& cfg) { return Run(cfg).main(); }

}  // namespace train
}  // namespace fsdp
