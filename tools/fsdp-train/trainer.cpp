// trainer.cpp — one fsdp-train run: the configuration turned into model, sharding, optimizer and
// data; resume; the training loop; the stops (non-finite loss, signal); and the end of the run
// (final checkpoint, trace, summary, export, sample). The checkpoint's key layout lives in
// checkpoint_state.cpp, the LR schedule in schedule.cpp, sampling in sample.cpp and what is
// printed or written as metrics in report.cpp.
//
// Per optimizer step every rank runs k = gradient_accumulation_steps micro-batches; only the
// last one reduce-scatters (set_requires_gradient_sync), so k micro-batches of B rows give the
// gradients of one batch of kB rows. Then clip_grad_norm_, AdamW, and ONE small all-gather of
// every rank's numbers (loss, memory, a stop request) that the log line, the non-finite check
// and the signal stop all use, so that every rank takes the same decision at the same step.
#include "trainer.h"

#include "checkpoint_state.h"
#include "data.h"
#include "report.h"
#include "sample.h"
#include "schedule.h"
#include "stop_signal.h"

#include <fsdp/call.h>
#include <fsdp/checkpoint.h>
#include <fsdp/clip_grad.h>
#include <fsdp/device_mesh.h>
#include <fsdp/distributed.h>
#include <fsdp/fully_shard.h>
#include <fsdp/memory.h>
#include <fsdp/models/transformer.h>
#include <fsdp/safetensors.h>
#include <fsdp/state_dict.h>
#include <fsdp/trace.h>

#include <ATen/Functions.h>
#include <torch/nn/functional/loss.h>
#include <torch/optim/adamw.h>
#include <torch/utils.h>

#include <algorithm>
#include <cmath>
#include <csignal>
#include <filesystem>
#include <iostream>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
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

int64_t seq_len_of(const TrainConfig& cfg, const models::ModelArgs& a) {
  const int64_t seq = cfg.training.seq_len > 0 ? cfg.training.seq_len : a.max_seq_len;
  if (seq > a.max_seq_len)
    throw ConfigError("training.seq_len (" + std::to_string(seq) + ") is longer than model.max_seq_len (" +
                      std::to_string(a.max_seq_len) + ")");
  return seq;
}

std::unique_ptr<DataSource> data_of(const TrainConfig& cfg, const models::ModelArgs& a) {
  if (cfg.data.source == "synthetic") return synthetic_data(a.vocab_size, cfg.data.data_seed);
  std::unique_ptr<DataSource> d = token_file_data(cfg.data.path, cfg.data.data_seed);
  if (d->vocab_size() > a.vocab_size)
    throw ConfigError("data.path " + cfg.data.path + " has a vocabulary of " + std::to_string(d->vocab_size()) +
                      " but model.vocab_size is " + std::to_string(a.vocab_size) + "; raise model.vocab_size");
  return d;
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

// Seconds of all-gather and reduce-scatter between two snapshots of a group's counters: busy on
// the communication thread, and waited for by the training thread (exposed).
struct CommSeconds {
  CommSeconds(const CollectiveStats& before, const CollectiveStats& after) {
    auto secs = [&](CollectiveKind k, int64_t CollectiveCounters::*ns) {
      return 1e-9 * static_cast<double>(after[k].*ns - before[k].*ns);
    };
    all_gather = secs(CollectiveKind::kAllGather, &CollectiveCounters::busy_ns);
    all_gather_wait = secs(CollectiveKind::kAllGather, &CollectiveCounters::blocked_ns);
    reduce_scatter = secs(CollectiveKind::kReduceScatter, &CollectiveCounters::busy_ns);
    reduce_scatter_wait = secs(CollectiveKind::kReduceScatter, &CollectiveCounters::blocked_ns);
  }
  double all_gather, all_gather_wait, reduce_scatter, reduce_scatter_wait;
};

// Every rank's `fields` numbers, rank after rank (a collective over the world).
std::vector<double> all_gather_numbers(const std::vector<double>& mine, int world_size) {
  at::Tensor all = at::empty({static_cast<int64_t>(world_size * mine.size())}, at::kDouble);
  world()->all_gather_into(all, at::tensor(mine, at::kDouble))->wait();
  const double* p = all.data_ptr<double>();
  return std::vector<double>(p, p + all.numel());
}

// ---------------------------------------------------------------------- the run

class Run {
 public:
  explicit Run(const TrainConfig& cfg) : cfg_(cfg) {}
  int main();

 private:
  void set_up();
  void shard_model();
  void resume();
  void start_logging();
  int train();
  void save_checkpoint(int64_t step, bool async);
  StepReport train_step(int64_t step);
  void set_learning_rate(double lr);
  double forward_backward(const at::Tensor& batch, int64_t micro, StepReport& r);
  double optimizer_step();
  std::vector<RankStep> gather_rank_numbers(const RankStep& mine, bool stop_requested, bool* any_stop);
  bool report_step(StepReport& r);
  int stop_non_finite(int64_t step, double loss);
  int stop_on_signal(int64_t step);
  void write_trace();
  void finish(int64_t last_step);
  void export_and_sample();
  void write_summary(int64_t steps_run);
  RankTotals my_totals(size_t warmup) const;
  RunShape run_shape();
  int64_t full_parameter_count();
  int64_t tokens_per_step() const { return static_cast<int64_t>(world_) * accumulation_ * batch_ * seq_; }
  void print(const std::string& text) {
    if (rank_ != 0) return;
    if (console_) console_->line(text);
    else std::cout << text << "\n" << std::flush;  // before the console exists (resume)
  }

  const TrainConfig& cfg_;
  int rank_ = 0, world_ = 1;
  models::ModelArgs args_;
  int64_t seq_ = 0, batch_ = 0, accumulation_ = 1;
  LrSchedule schedule_;
  std::unique_ptr<DataSource> data_;
  DeviceMesh mesh_;
  models::Transformer model_{nullptr};
  FSDPModule root_;
  std::unique_ptr<torch::optim::AdamW> optimizer_;
  std::unique_ptr<CheckpointManager> checkpoints_;
  std::unique_ptr<Console> console_;
  JsonlWriter jsonl_;

  int64_t start_step_ = 0;  // steps done before this process started (restored from a checkpoint)
  int64_t done_steps_ = 0;  // optimizer steps done so far
  int64_t tokens_seen_ = 0;
  int64_t last_saved_step_ = -1;
  std::vector<double> losses_, step_times_;
  CollectiveStats comm_before_;
};

int64_t Run::full_parameter_count() {
  int64_t n = 0;
  for (const auto& item : sharded_state_dict(*model_)) {
    int64_t numel = 1;
    for (int64_t d : item.value().sizes()) numel *= d;
    n += numel;
  }
  return n;
}

void Run::set_up() {
  const RendezvousInfo env = rendezvous_info_from_env();
  check_against_launcher(cfg_, env.world_size, env.local_rank);
  args_ = model_args_of(cfg_.model);
  seq_ = seq_len_of(cfg_, args_);
  batch_ = cfg_.training.micro_batch_size;
  accumulation_ = cfg_.training.gradient_accumulation_steps;
  schedule_ = lr_schedule(cfg_);
  data_ = data_of(cfg_, args_);

  init_process_group(env);
  rank_ = get_rank();
  world_ = get_world_size();
  mesh_ = init_device_mesh("cpu", {world_});
  shard_model();

  const auto& o = cfg_.optimizer;
  optimizer_ = std::make_unique<torch::optim::AdamW>(
      model_->parameters(),
      torch::optim::AdamWOptions(o.lr).betas({o.beta1, o.beta2}).eps(o.eps).weight_decay(o.weight_decay));
  checkpoints_ = std::make_unique<CheckpointManager>(cfg_.fsdp_config.checkpoint_dir,
                                                     static_cast<int>(cfg_.training.keep_checkpoints));
}

// Every block is its own FSDP unit, the root holds the rest (embeddings, final norm, output).
void Run::shard_model() {
  const bool reshard = reshard_after_forward(cfg_);
  // Same seed on every rank: fully_shard keeps each rank's piece of identical weights.
  torch::manual_seed(cfg_.training.seed);
  model_ = models::Transformer(args_);
  for (auto& block : model_->blocks())
    fully_shard(block, FullyShardOptions().mesh(mesh_).reshard_after_forward(reshard));
  // The root's parameters are needed first in backward, so it keeps them gathered (FSDP2's
  // default for the root) unless SHARD_GRAD_OP says to keep everything anyway.
  FullyShardOptions root_options = FullyShardOptions().mesh(mesh_);
  if (!reshard) root_options.reshard_after_forward(false);
  root_ = fully_shard(model_, root_options);
  if (!cfg_.model.init_from.empty()) load_full_state_dict(*model_, load_pytorch_state_dict(cfg_.model.init_from));
}

void Run::save_checkpoint(int64_t step, bool async) {
  const ShardedStateDict sd = checkpoint_state(*model_, *optimizer_, mesh_, {done_steps_, tokens_seen_});
  if (async) checkpoints_->save_async(step, sd);
  else checkpoints_->save(step, sd);
  last_saved_step_ = step;
}

// training.resume: auto = the latest complete checkpoint (if any), never, or a checkpoint path.
void Run::resume() {
  const std::string& r = cfg_.training.resume;
  std::optional<std::string> dir;
  if (r == "auto") dir = checkpoints_->latest();
  else if (r != "never") dir = r;
  if (!dir) return;
  const TrainerCounters counters = load_checkpoint_state(*dir, *model_, *optimizer_, mesh_);
  start_step_ = done_steps_ = counters.steps_done;
  tokens_seen_ = counters.tokens_seen;
  last_saved_step_ = start_step_;
  print("resumed from " + *dir + " at step " + std::to_string(start_step_));
}

// The console, this rank's JSONL file and the opening line.
void Run::start_logging() {
  console_ = std::make_unique<Console>(rank_ == 0 ? cfg_.logging.progress : "off", start_step_, cfg_.training.steps);
  const std::string jsonl = jsonl_path_for_rank(cfg_.logging.jsonl, rank_);
  if (!jsonl.empty()) jsonl_.open(jsonl, /*append=*/start_step_ > 0);
  std::ostringstream hello;
  hello << "fsdp-train: " << full_parameter_count() << " parameters (" << args_.n_layers << " layers, dim " << args_.dim
        << ", " << args_.n_heads << " heads, vocab " << args_.vocab_size << ", max_seq_len " << args_.max_seq_len
        << ") sharded over " << world_ << " rank(s), " << to_string(cfg_.fsdp_config.sharding_strategy) << "; "
        << data_->describe() << "; global batch " << world_ * accumulation_ * batch_ << " x " << seq_ << " tokens";
  print(hello.str());
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

// The loop, from the step after start_step_ to training.steps; returns the exit code.
int Run::train() {
  if (cfg_.logging.trace) {
    trace::start();
    trace::set_thread_name("train");
  }
  comm_before_ = mesh_.get_group(0)->stats();
  const int64_t interval = cfg_.fsdp_config.checkpoint_interval;
  for (int64_t step = start_step_ + 1; step <= cfg_.training.steps; ++step) {
    StepReport r = train_step(step);
    done_steps_ = step;
    const bool stop_requested = report_step(r);
    if (!std::isfinite(r.loss)) return stop_non_finite(step, r.loss);
    if (stop_requested) return stop_on_signal(step);
    if (interval > 0 && step % interval == 0 && step < cfg_.training.steps) save_checkpoint(step, /*async=*/true);
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
  // Gradients are reduce-scattered only after the last micro-batch; before, the unsharded
  // gradients accumulate on every rank.
  root_.set_requires_gradient_sync(micro == accumulation_ - 1);
  auto [inputs, targets] = micro_batch(batch, rank_, accumulation_, micro, batch_);
  const double f0 = now_seconds();
  at::Tensor loss;
  {
    trace::Span span("compute", "forward");
    at::Tensor logits = call(model_, inputs);
    loss = torch::nn::functional::cross_entropy(logits.reshape({-1, args_.vocab_size}), targets.reshape({-1}));
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

// Clipping (when training.max_grad_norm > 0) and AdamW; returns the gradient norm before
// clipping, NaN when not computed.
double Run::optimizer_step() {
  trace::Span span("compute", "optimizer");
  const double grad_norm = cfg_.training.max_grad_norm > 0
                               ? clip_grad_norm_(model_->parameters(), cfg_.training.max_grad_norm)
                               : NAN;
  optimizer_->step();
  // Drop the gradients rather than zeroing them (PyTorch's zero_grad(set_to_none=True)): the
  // next backward's reduce-scatter writes fresh ones, and forward runs without them in memory.
  for (auto& group : optimizer_->param_groups())
    for (auto& p : group.params()) p.mutable_grad() = at::Tensor();
  return grad_norm;
}

StepReport Run::train_step(int64_t step) {
  StepReport r;
  r.step = step;
  r.steps = cfg_.training.steps;
  r.lr = lr_at(schedule_, step);
  set_learning_rate(r.lr);
  const at::Tensor batch = data_->global_batch(step - 1, world_ * accumulation_ * batch_, seq_);
  const CollectiveStats comm_start = mesh_.get_group(0)->stats();
  memory::reset_peak_allocated();

  trace::Span step_span("compute", "step " + std::to_string(step));
  const double t0 = now_seconds();
  double loss_sum = 0;
  for (int64_t m = 0; m < accumulation_; ++m) loss_sum += forward_backward(batch, m, r);
  r.loss = loss_sum;  // this rank's mean over its rows (the micro-batch losses are already / k)
  const double o0 = now_seconds();
  r.grad_norm = optimizer_step();
  r.optimizer_s = now_seconds() - o0;
  r.step_s = now_seconds() - t0;

  const CommSeconds comm(comm_start, mesh_.get_group(0)->stats());
  r.ag_busy_s = comm.all_gather;
  r.ag_wait_s = comm.all_gather_wait;
  r.rs_busy_s = comm.reduce_scatter;
  r.rs_wait_s = comm.reduce_scatter_wait;

  tokens_seen_ += tokens_per_step();
  r.tokens_seen = tokens_seen_;
  r.tokens_per_s = tokens_per_step() / r.step_s;
  return r;
}

std::vector<RankStep> Run::gather_rank_numbers(const RankStep& mine, bool stop_requested, bool* any_stop) {
  constexpr size_t kFields = 5;
  const std::vector<double> all = all_gather_numbers(
      {mine.local_loss, mine.live_mib, mine.peak_mib, mine.rss_mib, stop_requested ? 1.0 : 0.0}, world_);
  std::vector<RankStep> ranks(world_);
  *any_stop = false;
  for (size_t q = 0; q < ranks.size(); ++q) {
    const double* p = all.data() + q * kFields;
    ranks[q] = RankStep{p[0], p[1], p[2], p[3]};
    *any_stop = *any_stop || p[4] != 0.0;
  }
  return ranks;
}

// Turns r.loss (this rank's) into the global-batch mean and logs the step. Returns whether any
// rank was asked to stop by a signal.
bool Run::report_step(StepReport& r) {
  const RankStep mine{r.loss, memory::allocated_bytes() / kMiB, memory::max_allocated_bytes() / kMiB,
                      memory::current_rss_bytes() / kMiB};
  bool stop = false;
  r.ranks = gather_rank_numbers(mine, stop_signal() != 0, &stop);
  double loss = 0;
  for (const RankStep& q : r.ranks) loss += q.local_loss;
  r.loss = loss / world_;
  losses_.push_back(r.loss);
  step_times_.push_back(r.step_s);
  jsonl_.write(r, rank_);
  if (rank_ == 0) {
    if (r.step % cfg_.logging.log_interval == 0 || r.step == cfg_.training.steps) console_->step_line(r);
    else console_->progress(r.step);
  }
  return stop;
}

int Run::stop_non_finite(int64_t step, double loss) {
  print("fsdp-train: stopping: the loss is " + std::to_string(loss) + " at step " + std::to_string(step) +
        " (non-finite). Nothing is saved from this step; the last checkpoint is " +
        (last_saved_step_ >= 0 ? "step " + std::to_string(last_saved_step_) : std::string("none")) +
        ". Lower optimizer.lr or set training.max_grad_norm.");
  checkpoints_->wait();
  write_trace();
  return kExitNonFinite;
}

// Every rank gets here at the same step (the stop request travels with the step's numbers).
int Run::stop_on_signal(int64_t step) {
  save_checkpoint(step, /*async=*/false);
  const int sig = stop_signal() ? stop_signal() : SIGTERM;  // another rank's signal
  print("fsdp-train: stop requested (signal " + std::to_string(sig) + "): saved step " + std::to_string(step) +
        " to " + *checkpoints_->latest() + "; run again with training.resume: auto to continue");
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
  if (cfg_.fsdp_config.checkpoint_interval > 0 && last_saved_step_ != last_step) save_checkpoint(last_step, false);
  checkpoints_->wait();
  if (last_saved_step_ == last_step) print("checkpoint: " + *checkpoints_->latest());
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
  const CommSeconds comm(comm_before_, mesh_.get_group(0)->stats());
  mine.ag_s = comm.all_gather, mine.ag_wait_s = comm.all_gather_wait;
  mine.rs_s = comm.reduce_scatter, mine.rs_wait_s = comm.reduce_scatter_wait;
  return mine;
}

RunShape Run::run_shape() {
  RunShape s;
  s.world = world_;
  s.preset = cfg_.model.preset;
  s.params = full_parameter_count();
  s.batch = batch_;
  s.gradient_accumulation_steps = accumulation_;
  s.seq = seq_;
  s.torch_threads = at::get_num_threads();
  s.n_layers = args_.n_layers, s.vocab_size = args_.vocab_size, s.max_seq_len = args_.max_seq_len;
  s.dim = args_.dim, s.n_heads = args_.n_heads, s.dropout_p = args_.dropout_p;
  return s;
}

// Every rank's totals go to rank 0, which prints the summary (and writes logging.summary_json).
void Run::write_summary(int64_t steps_run) {
  RunSummary s;
  s.steps_run = steps_run;
  s.warmup = summary_warmup_steps(cfg_.logging.summary_warmup, step_times_.size());
  const RankTotals mine = my_totals(s.warmup);
  const std::vector<double> all = all_gather_numbers(mine.to_vector(), world_);
  if (rank_ != 0) return;
  for (int q = 0; q < world_; ++q) s.ranks.push_back(RankTotals::from(all.data() + q * RankTotals::kFields));
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
