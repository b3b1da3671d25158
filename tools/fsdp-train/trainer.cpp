// trainer.cpp — the fsdp-train run: model, sharding, optimizer, resume, the training loop,
// checkpoints, export and the generated sample.
//
// Per optimizer step every rank runs k = gradient_accumulation_steps micro-batches; only the
// last one reduce-scatters (set_requires_gradient_sync), so k micro-batches of B rows give the
// gradients of one batch of kB rows. Then clip_grad_norm_, AdamW, and ONE small all-gather of
// every rank's numbers (loss, memory, a stop request) that the log line, the non-finite check
// and the signal stop all use, so that every rank takes the same decision at the same step.
#include "trainer.h"

#include "data.h"
#include "report.h"

#include <fsdp/call.h>
#include <fsdp/checkpoint.h>
#include <fsdp/clip_grad.h>
#include <fsdp/device_mesh.h>
#include <fsdp/distributed.h>
#include <fsdp/fully_shard.h>
#include <fsdp/memory.h>
#include <fsdp/models/transformer.h>
#include <fsdp/optim_state_dict.h>
#include <fsdp/safetensors.h>
#include <fsdp/state_dict.h>
#include <fsdp/trace.h>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Functions.h>
#include <ATen/core/grad_mode.h>
#include <torch/nn/functional/loss.h>
#include <torch/optim/adamw.h>
#include <torch/utils.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>

namespace fsdp {
namespace train {
namespace {

std::atomic<int> g_stop_signal{0};

extern "C" void on_stop_signal(int sig) {
  g_stop_signal.store(sig);
  std::signal(sig, SIG_DFL);  // a second one stops the process at once
}

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

// Linear warm-up to lr over warmup_steps, then cosine from lr to min_lr over decay_steps, then
// min_lr. `step` is 1-based; as in PyTorch's CosineAnnealingLR, the first step after the warm-up
// runs at the full lr and the decay reaches min_lr after its last step.
double lr_at(const TrainConfig& cfg, int64_t step) {
  const double lr = cfg.optimizer.lr, min_lr = cfg.schedule.min_lr;
  const int64_t warmup = cfg.schedule.warmup_steps;
  if (step <= warmup) return lr * static_cast<double>(step) / static_cast<double>(warmup);
  const int64_t decay = cfg.schedule.decay_steps > 0 ? cfg.schedule.decay_steps : cfg.training.steps - warmup;
  const double t = std::min(1.0, static_cast<double>(step - warmup - 1) / static_cast<double>(std::max<int64_t>(decay, 1)));
  return min_lr + 0.5 * (lr - min_lr) * (1.0 + std::cos(M_PI * t));
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

double median(std::vector<double> v) {
  if (v.empty()) return NAN;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// ---------------------------------------------------------------------- the run

class Run {
 public:
  explicit Run(const TrainConfig& cfg) : cfg_(cfg) {}
  int main();

 private:
  void set_up();
  void resume();
  ShardedStateDict checkpoint_state();
  void save_checkpoint(int64_t step, bool async);
  StepReport train_step(int64_t step);
  std::vector<RankStep> gather_rank_numbers(const RankStep& mine, bool stop_requested, bool* any_stop);
  bool report_step(StepReport& r);
  int stop_non_finite(int64_t step, double loss);
  int stop_on_signal(int64_t step);
  void write_trace();
  void finish(int64_t last_step);
  void export_and_sample();
  std::string generate_sample(const TensorStateDict& full);
  void write_summary(int64_t steps_run);
  int64_t full_parameter_count() {
    int64_t n = 0;
    for (const auto& item : sharded_state_dict(*model_)) {
      int64_t numel = 1;
      for (int64_t d : item.value().sizes()) numel *= d;
      n += numel;
    }
    return n;
  }
  void print(const std::string& text) {
    if (rank_ != 0) return;
    if (console_) console_->line(text);
    else std::cout << text << "\n" << std::flush;  // before the console exists (resume)
  }

  const TrainConfig& cfg_;
  int rank_ = 0, world_ = 1;
  models::ModelArgs args_;
  int64_t seq_ = 0, batch_ = 0, accumulation_ = 1;
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

void Run::set_up() {
  const RendezvousInfo env = rendezvous_info_from_env();
  check_against_launcher(cfg_, env.world_size, env.local_rank);
  args_ = model_args_of(cfg_.model);
  seq_ = seq_len_of(cfg_, args_);
  batch_ = cfg_.training.micro_batch_size;
  accumulation_ = cfg_.training.gradient_accumulation_steps;
  const bool reshard = reshard_after_forward(cfg_);
  data_ = data_of(cfg_, args_);

  init_process_group(env);
  rank_ = get_rank();
  world_ = get_world_size();
  mesh_ = init_device_mesh("cpu", {world_});

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

  const auto& o = cfg_.optimizer;
  optimizer_ = std::make_unique<torch::optim::AdamW>(
      model_->parameters(),
      torch::optim::AdamWOptions(o.lr).betas({o.beta1, o.beta2}).eps(o.eps).weight_decay(o.weight_decay));
  checkpoints_ = std::make_unique<CheckpointManager>(cfg_.fsdp_config.checkpoint_dir,
                                                     static_cast<int>(cfg_.training.keep_checkpoints));
}

// Model, optimizer and the loop's own state, under one key space:
//   model.<fqn>, optim.state.<fqn>.<name>, optim.param_groups.<fqn>.<option>,
//   trainer.counters ([steps done, tokens seen]), trainer.rng (the CPU generator, for dropout).
// The data position is the step: a step's batch depends only on it (data.h).
ShardedStateDict Run::checkpoint_state() {
  ShardedStateDict sd;
  for (const auto& item : sharded_state_dict(*model_)) sd.insert("model." + item.key(), item.value());
  for (const auto& item : sharded_optimizer_state_dict(*model_, *optimizer_))
    sd.insert("optim." + item.key(), item.value());
  auto replicated = [&](const at::Tensor& t) { return DTensor::from_local(t, mesh_, {Replicate()}); };
  at::Tensor counters = at::tensor(std::vector<int64_t>{done_steps_, tokens_seen_}, at::kLong);
  sd.insert("trainer.counters", replicated(counters));
  sd.insert("trainer.rng", replicated(at::detail::getDefaultCPUGenerator().get_state()));
  return sd;
}

void Run::save_checkpoint(int64_t step, bool async) {
  const ShardedStateDict sd = checkpoint_state();
  if (async) checkpoints_->save_async(step, sd);
  else checkpoints_->save(step, sd);
  last_saved_step_ = step;
}

void Run::resume() {
  const std::string& r = cfg_.training.resume;
  std::optional<std::string> dir;
  if (r == "auto") dir = checkpoints_->latest();
  else if (r != "never") dir = r;
  if (!dir) return;
  init_optimizer_state(*optimizer_);  // so that the state dict lists the state to load into
  const ShardedStateDict like = checkpoint_state();
  const ShardedStateDict loaded = load_checkpoint(*dir, like);
  ShardedStateDict model_sd, optim_sd;
  for (const auto& item : loaded) {
    const std::string& k = item.key();
    if (k.rfind("model.", 0) == 0) model_sd.insert(k.substr(6), item.value());
    else if (k.rfind("optim.", 0) == 0) optim_sd.insert(k.substr(6), item.value());
  }
  load_sharded_state_dict(*model_, model_sd);
  load_sharded_optimizer_state_dict(*model_, *optimizer_, optim_sd);
  const at::Tensor counters = loaded["trainer.counters"].to_local();
  start_step_ = done_steps_ = counters[0].item<int64_t>();
  tokens_seen_ = counters[1].item<int64_t>();
  at::Generator rng = at::detail::getDefaultCPUGenerator();  // a handle to the same generator
  rng.set_state(loaded["trainer.rng"].to_local());
  last_saved_step_ = start_step_;
  print("resumed from " + *dir + " at step " + std::to_string(start_step_));
}

std::vector<RankStep> Run::gather_rank_numbers(const RankStep& mine, bool stop_requested, bool* any_stop) {
  constexpr int64_t kFields = 5;
  at::Tensor local = at::tensor(std::vector<double>{mine.local_loss, mine.live_mib, mine.peak_mib, mine.rss_mib,
                                                    stop_requested ? 1.0 : 0.0},
                                at::kDouble);
  at::Tensor all = at::empty({world_ * kFields}, at::kDouble);
  world()->all_gather_into(all, local)->wait();
  const double* p = all.data_ptr<double>();
  std::vector<RankStep> ranks(world_);
  *any_stop = false;
  for (int q = 0; q < world_; ++q, p += kFields) {
    ranks[q] = RankStep{p[0], p[1], p[2], p[3]};
    *any_stop = *any_stop || p[4] != 0.0;
  }
  return ranks;
}

StepReport Run::train_step(int64_t step) {
  StepReport r;
  r.step = step;
  r.steps = cfg_.training.steps;
  r.lr = lr_at(cfg_, step);
  for (auto& group : optimizer_->param_groups())
    static_cast<torch::optim::AdamWOptions&>(group.options()).lr(r.lr);
  const at::Tensor batch = data_->global_batch(step - 1, world_ * accumulation_ * batch_, seq_);
  const CollectiveStats comm_start = mesh_.get_group(0)->stats();
  memory::reset_peak_allocated();

  trace::Span step_span("compute", "step " + std::to_string(step));
  const double t0 = now_seconds();
  double loss_sum = 0;
  for (int64_t m = 0; m < accumulation_; ++m) {
    // Gradients are reduce-scattered only after the last micro-batch; before, the unsharded
    // gradients accumulate on every rank.
    root_.set_requires_gradient_sync(m == accumulation_ - 1);
    auto [inputs, targets] = micro_batch(batch, rank_, accumulation_, m, batch_);
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
    loss_sum += loss.item<double>();
  }
  r.loss = loss_sum;  // this rank's mean over its rows (the micro-batch losses are already / k)
  const double o0 = now_seconds();
  {
    trace::Span span("compute", "optimizer");
    r.grad_norm = cfg_.training.max_grad_norm > 0
                      ? clip_grad_norm_(model_->parameters(), cfg_.training.max_grad_norm)
                      : NAN;
    optimizer_->step();
    // Drop the gradients rather than zeroing them (PyTorch's zero_grad(set_to_none=True)): the
    // next backward's reduce-scatter writes fresh ones, and forward runs without them in memory.
    for (auto& group : optimizer_->param_groups())
      for (auto& p : group.params()) p.mutable_grad() = at::Tensor();
  }
  r.optimizer_s = now_seconds() - o0;
  r.step_s = now_seconds() - t0;

  const CommSeconds comm(comm_start, mesh_.get_group(0)->stats());
  r.ag_busy_s = comm.all_gather;
  r.ag_wait_s = comm.all_gather_wait;
  r.rs_busy_s = comm.reduce_scatter;
  r.rs_wait_s = comm.reduce_scatter_wait;

  const int64_t tokens = static_cast<int64_t>(world_) * accumulation_ * batch_ * seq_;
  tokens_seen_ += tokens;
  r.tokens_seen = tokens_seen_;
  r.tokens_per_s = tokens / r.step_s;
  return r;
}

int Run::main() {
  set_up();
  resume();
  // The whole model built before sharding, a loaded state dict or checkpoint: blocks that the
  // training steps will not ask for again. Give them back instead of keeping them cached.
  memory::empty_cache();
  console_ = std::make_unique<Console>(rank_ == 0 ? cfg_.logging.progress : "off", start_step_, cfg_.training.steps);
  const std::string jsonl = jsonl_path_for_rank(cfg_.logging.jsonl, rank_);
  if (!jsonl.empty()) jsonl_.open(jsonl, /*append=*/start_step_ > 0);
  std::ostringstream hello;
  hello << "fsdp-train: " << full_parameter_count() << " parameters (" << args_.n_layers << " layers, dim " << args_.dim
        << ", " << args_.n_heads << " heads, vocab " << args_.vocab_size << ", max_seq_len " << args_.max_seq_len
        << ") sharded over " << world_ << " rank(s), " << to_string(cfg_.fsdp_config.sharding_strategy) << "; "
        << data_->describe() << "; global batch " << world_ * accumulation_ * batch_ << " x " << seq_ << " tokens";
  print(hello.str());
  if (start_step_ >= cfg_.training.steps) {
    print("training already complete at step " + std::to_string(start_step_) + " (training.steps " +
          std::to_string(cfg_.training.steps) + ")");
    finish(start_step_);
    return kExitOk;
  }
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

// Turns r.loss (this rank's) into the global-batch mean and logs the step. Returns whether any
// rank was asked to stop by a signal.
bool Run::report_step(StepReport& r) {
  const RankStep mine{r.loss, memory::allocated_bytes() / kMiB, memory::max_allocated_bytes() / kMiB,
                      memory::current_rss_bytes() / kMiB};
  bool stop = false;
  r.ranks = gather_rank_numbers(mine, g_stop_signal.load() != 0, &stop);
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
  const int sig = g_stop_signal.load() ? g_stop_signal.load() : SIGTERM;  // another rank's signal
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
  if (cfg_.sample.length > 0) print(generate_sample(full));
}

// Text generated by the trained model from sample.prompt, token by token, on an unsharded copy
// of the model: rank 0 alone, no collectives.
std::string Run::generate_sample(const TensorStateDict& full) {
  models::ModelArgs eval_args = args_;
  eval_args.dropout_p = 0;
  models::Transformer local(eval_args);
  at::NoGradGuard no_grad;
  auto params = local->named_parameters();
  for (const auto& item : full) params[item.key()].copy_(item.value());
  local->eval();
  // Byte-level data: the prompt's bytes, and the sample printed as text; otherwise token ids.
  const bool bytes = cfg_.data.source == "tokens" && data_->vocab_size() <= 256;
  const std::string prompt = cfg_.sample.prompt.empty() ? std::string("\n") : cfg_.sample.prompt;
  std::vector<int64_t> ids;
  if (bytes) {
    for (unsigned char c : prompt) ids.push_back(c);
  } else {
    ids.push_back(0);
  }
  const size_t prompt_len = ids.size();
  at::Generator gen = at::detail::createCPUGenerator(static_cast<uint64_t>(cfg_.sample.seed));
  for (int64_t i = 0; i < cfg_.sample.length; ++i) {
    const int64_t n = std::min<int64_t>(static_cast<int64_t>(ids.size()), args_.max_seq_len);
    at::Tensor context = at::tensor(std::vector<int64_t>(ids.end() - n, ids.end()), at::kLong).unsqueeze(0);
    at::Tensor logits = local->forward(context).select(1, n - 1).squeeze(0) / cfg_.sample.temperature;
    ids.push_back(at::multinomial(at::softmax(logits, -1), 1, false, gen).item<int64_t>());
  }
  std::ostringstream out;
  out << "sample (" << cfg_.sample.length << " tokens, temperature " << cfg_.sample.temperature << "):\n";
  if (bytes) {
    out << bytes_text(ids);
  } else {
    for (size_t i = prompt_len; i < ids.size(); ++i) out << ids[i] << ' ';
  }
  return out.str();
}

void Run::write_summary(int64_t steps_run) {
  const size_t warm = std::min<size_t>(static_cast<size_t>(cfg_.logging.summary_warmup),
                                       step_times_.size() > 1 ? step_times_.size() - 1 : 0);
  RankTotals mine;
  mine.median_step_s = median(std::vector<double>(step_times_.begin() + warm, step_times_.end()));
  mine.peak_rss_mib = memory::peak_rss_bytes() / kMiB;
  mine.peak_tensor_mib = memory::max_allocated_bytes() / kMiB;
  const CommSeconds comm(comm_before_, mesh_.get_group(0)->stats());
  mine.ag_s = comm.all_gather, mine.ag_wait_s = comm.all_gather_wait;
  mine.rs_s = comm.reduce_scatter, mine.rs_wait_s = comm.reduce_scatter_wait;
  // Every rank's totals, for rank 0's summary.
  at::Tensor all = at::empty({world_ * RankTotals::kFields}, at::kDouble);
  world()->all_gather_into(all, at::tensor(mine.to_vector(), at::kDouble))->wait();
  if (rank_ != 0) return;
  std::vector<RankTotals> ranks;
  for (int q = 0; q < world_; ++q) ranks.push_back(RankTotals::from(all.data_ptr<double>() + q * RankTotals::kFields));
  const double tokens_per_s = static_cast<double>(world_) * accumulation_ * batch_ * seq_ / mine.median_step_s;
  console_->finish();
  std::cout << format_summary(steps_run, losses_.front(), losses_.back(), mine.median_step_s, warm, tokens_per_s, ranks)
            << std::flush;
  if (cfg_.logging.summary_json.empty()) return;

  // Field names follow ../shared/bench/peer/peer_fsdp1.py's JSON, so bench/peer_ab.py reads both.
  nlohmann::json j = {{"world", world_}, {"preset", cfg_.model.preset}, {"params", full_parameter_count()},
                      {"batch", batch_}, {"gradient_accumulation_steps", accumulation_}, {"seq", seq_},
                      {"steps", steps_run}, {"warmup", warm}, {"median_step_s", mine.median_step_s},
                      {"tokens_per_s", tokens_per_s}, {"losses", losses_}, {"step_s_rank0", step_times_},
                      {"torch_threads", at::get_num_threads()}};
  j["model_args"] = {{"n_layers", args_.n_layers}, {"vocab_size", args_.vocab_size}, {"max_seq_len", args_.max_seq_len},
                     {"dim", args_.dim}, {"n_heads", args_.n_heads}, {"dropout_p", args_.dropout_p}};
  const std::pair<const char*, double RankTotals::*> per_rank_fields[] = {
      {"median_step_s_per_rank", &RankTotals::median_step_s}, {"peak_rss_mib_per_rank", &RankTotals::peak_rss_mib},
      {"peak_tensor_mib_per_rank", &RankTotals::peak_tensor_mib}, {"all_gather_s_per_rank", &RankTotals::ag_s},
      {"all_gather_wait_s_per_rank", &RankTotals::ag_wait_s}, {"reduce_scatter_s_per_rank", &RankTotals::rs_s},
      {"reduce_scatter_wait_s_per_rank", &RankTotals::rs_wait_s}};
  for (const auto& [name, field] : per_rank_fields) {
    std::vector<double> values;
    for (const RankTotals& r : ranks) values.push_back(r.*field);
    j[name] = values;
  }
  std::ofstream f(cfg_.logging.summary_json);
  f << j.dump() << "\n";
  if (!f) throw std::runtime_error(cfg_.logging.summary_json + ": cannot write the summary (logging.summary_json)");
}

}  // namespace

void install_stop_signal_handlers() {
  std::signal(SIGTERM, on_stop_signal);
  std::signal(SIGINT, on_stop_signal);
}

int run_training(const TrainConfig& cfg) { return Run(cfg).main(); }

}  // namespace train
}  // namespace fsdp
