// trainer.cpp — one fsdp-train run: set-up and the training loop. The rooms it calls: the
// model on its mesh (model_setup.h) and its initial weights (initial_weights.h), checkpoints
// and resume (run_checkpoints.h), the per-step vote and the stop rules (step_control.h), and
// the end of the run (run_end.h); the LR schedule is schedule.h's, what is printed report.h's.
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
// fp16: true adds a GradScaler: the loss is scaled before backward and the gradients unscaled
// before clipping (one all-reduce agrees on an overflow); a step whose gradients overflowed is
// skipped by the scaler, which lowers the scale, and the run goes on.
#include "run/trainer.h"

#include "checkpoints/run_checkpoints.h"
#include "checkpoints/run_identity.h"
#include "common/agreement.h"
#include "common/errors.h"
#include "data/data.h"
#include "data/tokenizer.h"
#include "models/initial_weights.h"
#include "models/memory_check.h"
#include "models/model_setup.h"
#include "models/registry.h"
#include "outputs/report.h"
#include "outputs/run_end.h"
#include "outputs/tensorboard.h"
#include "run/evaluation.h"
#include "run/hardware.h"
#include "run/schedule.h"
#include "run/step_control.h"
#include "run/stop_signal.h"

#include <fsdp/call.h>
#include <fsdp/clip_grad.h>
#include <fsdp/device_state_adamw.h>
#include <fsdp/diloco.h>
#include <fsdp/distributed.h>
#include <fsdp/fused_adamw.h>
#include <fsdp/grad_scaler.h>
#include <fsdp/memory.h>
#include <fsdp/trace.h>

#include <torch/optim/adamw.h>

#include <chrono>
#include <cmath>
#include <csignal>
#include <iomanip>
#include <cstdio>
#include <iostream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

namespace fsdp {
namespace train {
namespace {

constexpr double kMiB = 1024.0 * 1024.0;

InitOptions init_options(const FsdpConfig& f) {
  InitOptions o;
  if (f.collective_timeout_s)
    o.timeout(std::chrono::milliseconds(static_cast<int64_t>(std::llround(*f.collective_timeout_s * 1000))));
  if (f.backend != "auto") o.backend(f.backend);
  return o;
}

std::unique_ptr<DataSource> data_of(const TrainConfig& cfg, const ModelShape& a) {
  if (cfg.data.source == "synthetic") return synthetic_data(a.vocab_size, cfg.data.data_seed);
  return token_file_data(cfg.data.path, cfg.data.data_seed, a.vocab_size);
}

// data.tokenizer's SentencePiece model (loaded at start-up, so that a wrong file stops the run
// before training), else the byte-level tokenizer for byte-level data, else none (token ids).
std::unique_ptr<Tokenizer> sample_tokenizer(const TrainConfig& cfg, const ModelShape& a, const DataSource& data) {
  if (cfg.data.tokenizer.empty()) return cfg.data.source == "tokens" && data.byte_level() ? byte_tokenizer() : nullptr;
  std::unique_ptr<Tokenizer> t = sentencepiece_tokenizer(cfg.data.tokenizer, "data.tokenizer");
  if (static_cast<int64_t>(t->vocab_size()) > a.vocab_size)
    throw ConfigError("data.tokenizer " + cfg.data.tokenizer + " has a vocabulary of " +
                      std::to_string(t->vocab_size()) + " but model.vocab_size is " + std::to_string(a.vocab_size) +
                      "; raise model.vocab_size");
  return t;
}

// AdamW, FusedAdamW, or, with the parameters offloaded and the optimizer state kept on a GPU,
// DeviceStateAdamW with its state on `device`.
std::unique_ptr<torch::optim::AdamW> optimizer_of(const TrainConfig& cfg, const std::vector<at::Tensor>& params,
                                                  const c10::Device& device) {
  const OptimizerConfig& o = cfg.optimizer;
  const auto options =
      torch::optim::AdamWOptions(o.lr).betas({o.beta1, o.beta2}).eps(o.eps).weight_decay(o.weight_decay);
  if (steps_with_device_state_adamw(cfg)) return std::make_unique<optim::DeviceStateAdamW>(params, options, device);
  // FusedAdamW is an AdamW (same state and checkpoints), so the rest of the trainer needs no branch.
  if (o.fused) return std::make_unique<optim::FusedAdamW>(params, options);
  return std::make_unique<torch::optim::AdamW>(params, options);
}

// What a Run does once the model holds its weights: train, or (`fsdp-train eval`) evaluate them.
enum class RunMode { kTrain, kEvaluate };

std::string eval_loss_text(double loss) {
  char text[32];
  std::snprintf(text, sizeof text, "%.8g", loss);
  return text;
}

class Run {
 public:
  Run(const TrainConfig& cfg, RunMode mode) : cfg_(cfg), mode_(mode), precision_(precision_of(cfg.fsdp_config)) {}
  int main();

 private:
  void set_up();
  int evaluate_only(const TrainerCounters& resumed);
  double evaluate();
  at::Tensor loss_of(const at::Tensor& inputs, const at::Tensor& targets);
  void join_job(const RendezvousInfo& env);
  void start_logging();
  int train();
  StepReport compute_step(int64_t step);
  double forward_backward(const at::Tensor& batch, int64_t micro, StepReport& r);
  void set_learning_rate(double lr);
  void apply_step(StepReport& r);
  bool optimizer_step();
  void report_step(StepReport& r, const StepVotes& votes);
  int stop(int64_t step, StepVerdict verdict, const StepVotes& votes);
  void finish(int64_t last_step);
  TrainingState state() { return {pm_.module(), *optimizer_, pm_.mesh, scaler_.get()}; }
  TrainerCounters counters() const { return {done_steps_, tokens_seen_}; }
  int64_t tokens_per_step() const { return static_cast<int64_t>(pm_.dp_world) * accumulation_ * batch_ * seq_; }
  void print(const std::string& text) {
    if (rank_ != 0 || text.empty()) return;
    if (console_) console_->line(text);
    else std::cout << text << "\n" << std::flush;  // before the console exists (resume)
  }

  const TrainConfig& cfg_;
  const RunMode mode_;
  const Precision precision_;
  int rank_ = 0, world_ = 1;
  std::unique_ptr<const ModelFamily> family_;  // chosen once, from model.architecture or config.json
  ModelShape shape_;
  int64_t seq_ = 0, batch_ = 0, accumulation_ = 1;
  LrSchedule schedule_;
  std::unique_ptr<DataSource> data_;
  std::unique_ptr<Tokenizer> tokenizer_;    // the sample's text: data.tokenizer, or bytes for byte-level data
  std::unique_ptr<Evaluation> evaluation_;  // eval.interval > 0, or `fsdp-train eval`
  ParallelModel pm_;
  std::unique_ptr<torch::optim::AdamW> optimizer_;
  std::unique_ptr<GradScaler> scaler_;  // fp16: true only
  std::unique_ptr<DiLoCo> diloco_;      // fsdp_config.diloco_inner_steps > 0 only
  std::unique_ptr<RunCheckpoints> checkpoints_;
  std::unique_ptr<Console> console_;
  JsonlWriter jsonl_;
  TensorBoardWriter tensorboard_;  // open on rank 0 with logging.tensorboard_dir; the eval loss goes here too

  int64_t start_step_ = 0;  // steps done before this process started (restored from a checkpoint)
  int64_t done_steps_ = 0;  // optimizer steps done so far
  int64_t tokens_seen_ = 0;
  RunRecord record_;
};

void Run::set_up() {
  const RendezvousInfo env = rendezvous_info_from_env();
  check_against_launcher(cfg_, env.world_size, env.local_rank);
  family_ = choose_family(cfg_);
  shape_ = family_->shape();
  seq_ = seq_len_of(cfg_, *family_);
  check_memory(cfg_, *family_, seq_, env);
  batch_ = cfg_.training.micro_batch_size;
  accumulation_ = cfg_.training.gradient_accumulation_steps;
  schedule_ = lr_schedule(cfg_);
  if (mode_ == RunMode::kTrain) {  // evaluation reads eval.path only
    data_ = data_of(cfg_, shape_);
    tokenizer_ = sample_tokenizer(cfg_, shape_, *data_);
  }

  join_job(env);
  for (const std::string& note : family_->config_notes()) print("fsdp-train: note: " + terminal_safe(note));
  checkpoints_ = std::make_unique<RunCheckpoints>(cfg_, run_identity(cfg_, shape_),
                                                  [this](const std::string& line) { print(line); });
  checkpoints_->check_dir();
  if (mode_ == RunMode::kTrain) check_output_destinations(cfg_);  // not hours later, at the end
  pm_ = parallelize_model(cfg_, *family_, precision_, env.local_world_size);
  load_initial_weights(cfg_, *family_, pm_.module(), [this](const std::string& line) { print(line); });
  optimizer_ = optimizer_of(cfg_, pm_.parameters(), pm_.mesh.device());
  if (mode_ == RunMode::kEvaluate || cfg_.eval.interval > 0)
    evaluation_ = std::make_unique<Evaluation>(cfg_, shape_.vocab_size, seq_, pm_.dp_world, pm_.dp_rank);
  // The world group agrees on overflows: every rank skips a step together.
  if (precision_.loss_scaling) scaler_ = std::make_unique<GradScaler>();
  const FsdpConfig& f = cfg_.fsdp_config;
  if (f.diloco_inner_steps > 0) {
    DiLoCoOptions o = DiLoCoOptions()
                          .inner_steps(f.diloco_inner_steps)
                          .outer_lr(f.diloco_outer_lr)
                          .outer_momentum(f.diloco_outer_momentum)
                          .fragments(f.diloco_fragments)
                          .process_group(pm_.mesh.get_group("replicate"));
    if (f.diloco_quantized) {
      o.quantized(QuantizedComm()
                      .dtype(quantized_dtype_from_string(*f.diloco_quantized))
                      .block_size(f.quantization_block_size));
    }
    diloco_ = std::make_unique<DiLoCo>(pm_.parameters(), o);
  }
}

// The process group, with fsdp_config.collective_timeout_s; the library lets
// FSDP_COLLECTIVE_TIMEOUT_MS win over it, and then the run says so rather than ignore the key.
// Decided from the timeout in force, not from the variable: the library ignores an empty one.
void Run::join_job(const RendezvousInfo& env) {
  const InitOptions options = init_options(cfg_.fsdp_config);
  if (cfg_.fsdp_config.backend == "mpi" && !mpi_available()) {
    throw ConfigError(
        "fsdp_config.backend: mpi, but this build has no MPI backend (CMake found no MPI): install "
        "libopenmpi-dev (scripts/install-deps.sh) and rebuild, or use gloo");
  }
  init_process_group(env, options);
  rank_ = get_rank();
  world_ = get_world_size();
  if (cfg_.fsdp_config.backend != "auto" && backend() != cfg_.fsdp_config.backend) {
    print("fsdp-train: note: FSDP_BACKEND=" + backend() +
          " in the environment selects the process-group backend; "
          "fsdp_config.backend (" +
          cfg_.fsdp_config.backend + ") is not used");
  }
  const std::chrono::milliseconds in_force = world()->timeout();
  if (!cfg_.fsdp_config.collective_timeout_s || in_force == options.timeout()) return;
  std::ostringstream note;
  note << "fsdp-train: note: FSDP_COLLECTIVE_TIMEOUT_MS=" << in_force.count() << " in the environment sets the "
       << "collective timeout; fsdp_config.collective_timeout_s (" << *cfg_.fsdp_config.collective_timeout_s
       << " s) is not used";
  print(note.str());
}

// The console, this rank's JSONL file, rank 0's TensorBoard file and the opening line.
void Run::start_logging() {
  console_ = std::make_unique<Console>(rank_ == 0 ? cfg_.logging.progress : "off", start_step_, cfg_.training.steps);
  const std::string jsonl = jsonl_path_for_rank(cfg_.logging.jsonl, rank_);
  if (!jsonl.empty()) jsonl_.open(jsonl, /*append=*/start_step_ > 0);
  if (rank_ == 0 && !cfg_.logging.tensorboard_dir.empty()) {
    tensorboard_.open(cfg_.logging.tensorboard_dir, start_step_ + 1);
    tensorboard_.text(kConfigTag, start_step_, config_markdown(cfg_));
  }
  std::ostringstream hello;
  hello << "fsdp-train: " << pm_.parameter_count << " parameters (" << shape_.n_layers << " layers, dim " << shape_.dim
        << ", " << shape_.n_heads << " heads, vocab " << shape_.vocab_size << ", max_seq_len " << shape_.max_seq_len
        << ") " << pm_.description(cfg_.fsdp_config, world_) << ", " << precision_.describe() << "; "
        << data_->describe() << "; global batch " << pm_.dp_world * accumulation_ * batch_ << " x " << seq_
        << " tokens; collectives on " << backend();
  print(hello.str());
  // Only rank 0 probes (its line is the one printed); the others go on to the first step's
  // all-gather and wait there the ~50 ms it takes.
  if (rank_ == 0 && precision_.param == Dtype::kBFloat16) print(check_bf16_support());
  const auto& f = cfg_.fsdp_config;
  if (rank_ == 0 && (f.offload_params || f.offload_optimizer_state) && f.device == "cpu") {
    print(std::string("fsdp-train: offload_params: ") + (f.offload_params ? "true" : "false") +
          ", offload_optimizer_state: " + (f.offload_optimizer_state ? "true" : "false") +
          ": on device cpu device memory is host memory, so the sharded parameters, gradients and optimizer "
          "state live there whatever the keys say" +
          (f.offload_params ? "; the offload path runs with identity copies" : ""));
  }
}

int Run::main() {
  set_up();
  const TrainerCounters resumed = checkpoints_->resume(state(), tokens_per_step());
  start_step_ = done_steps_ = resumed.steps_done;
  tokens_seen_ = resumed.tokens_seen;
  // The whole model built before sharding, a loaded state dict or checkpoint: blocks that the
  // training steps will not ask for again. Give them back instead of keeping them cached.
  memory::empty_cache();
  if (mode_ == RunMode::kEvaluate) return evaluate_only(resumed);
  start_logging();
  if (start_step_ >= cfg_.training.steps) {
    print("training already complete at step " + std::to_string(start_step_) + " (training.steps " +
          std::to_string(cfg_.training.steps) + ")");
    finish(start_step_);
    return kExitOk;
  }
  return train();
}

// `fsdp-train eval`: says which weights it evaluates, then prints `eval loss: <value>`.
int Run::evaluate_only(const TrainerCounters& resumed) {
  std::string weights;
  if (resumed.steps_done > 0) {
    weights = "the checkpoint " + checkpoints_->last_saved_dir() + " (step " + std::to_string(resumed.steps_done) +
              ", training.resume: " + cfg_.training.resume + ")";
  } else if (!cfg_.model.init_from.empty()) {
    weights = "model.init_from " + cfg_.model.init_from + " (no checkpoint to resume from)";
  } else {
    weights = "the seeded initialisation (training.seed " + std::to_string(cfg_.training.seed) +
              "): no checkpoint to resume from under " + cfg_.fsdp_config.checkpoint_dir + " and no model.init_from";
  }
  print("eval: weights: " + weights);
  print("eval: " + evaluation_->describe() + " on " + std::to_string(world_) + " rank(s)");
  print("eval loss: " + eval_loss_text(evaluate()));
  // Every rank's peak resident memory and peak tensors, as the training summary gives them.
  const std::vector<double> peaks =
      all_gather_numbers({memory::peak_rss_bytes() / kMiB, tensor_memory(pm_.mesh).peak_mib});
  std::ostringstream line;
  line << std::fixed << std::setprecision(1) << "eval: peak RSS per rank";
  for (int q = 0; q < world_; ++q) line << (q ? ", " : " ") << peaks[2 * q] << " MiB";
  line << "; peak tensors per rank";
  for (int q = 0; q < world_; ++q) line << (q ? ", " : " ") << peaks[2 * q + 1] << " MiB";
  print(line.str());
  return kExitOk;
}

// Collective: the eval loss of the weights as they are now. The FSDP root keeps its gathered
// parameters after a forward (it reshards after backward, which evaluation has none of), so it
// is resharded here: training and checkpoints go on from the sharded parameters.
double Run::evaluate() {
  trace::Span span("compute", "eval");
  const double loss = evaluation_->evaluate(
      pm_.module(), [this](const at::Tensor& in, const at::Tensor& tg) { return loss_of(in, tg); }, pm_.mesh.device());
  if (pm_.kind() != DataParallelKind::kReplicated) pm_.root.reshard();
  return loss;
}

// The model's mean fp32 cross-entropy of a batch (training's and evaluation's).
at::Tensor Run::loss_of(const at::Tensor& inputs, const at::Tensor& targets) {
  // The loss in fp32 whatever the compute dtype (torchtitan's .float()): a bf16 log-softmax
  // over the vocabulary loses the small differences training follows.
  // training.loss_chunks > 1 computes it a piece of the sequence at a time (forward_loss).
  return pm_.forward_loss(inputs, targets, cfg_.training.loss_chunks);
}

// The loop, from the step after start_step_ to training.steps; returns the exit code. A step
// is computed, voted on by every rank, and only then applied.
int Run::train() {
  if (cfg_.logging.trace) {
    trace::start();
    trace::set_thread_name("train");
  }
  record_.comm_before = mesh_stats(pm_.mesh);
  record_.comm_before_by_dim = mesh_dim_stats(pm_.mesh);
  for (int64_t step = start_step_ + 1; step <= cfg_.training.steps; ++step) {
    StepReport r = compute_step(step);
    checkpoints_->poll();
    const StepBallot ballot{r.loss, r.grad_norm, stop_signal() != 0, !checkpoints_->save_error().empty()};
    const StepVotes votes = tally_votes(all_gather_numbers(ballot_numbers(ballot)), world_);
    const StepVerdict verdict = verdict_of(votes, precision_.loss_scaling);
    if (verdict == StepVerdict::kStopNonFinite || verdict == StepVerdict::kStopFailedSave)
      return stop(step, verdict, votes);
    apply_step(r);
    done_steps_ = step;
    if (evaluation_ && (step % cfg_.eval.interval == 0 || step == cfg_.training.steps)) r.eval_loss = evaluate();
    report_step(r, votes);
    if (verdict == StepVerdict::kApplyThenStop) return stop(step, verdict, votes);
    if (background_save_after(step, cfg_.fsdp_config.checkpoint_interval, cfg_.training.steps))
      checkpoints_->save_in_background(step, state(), counters());
  }
  finish(cfg_.training.steps);
  return kExitOk;
}

void Run::set_learning_rate(double lr) {
  for (auto& group : optimizer_->param_groups()) static_cast<torch::optim::AdamWOptions&>(group.options()).lr(lr);
}

// Forward, backward, the global gradient norm and clipping of step `step`; nothing applied yet.
StepReport Run::compute_step(int64_t step) {
  StepReport r;
  r.step = step;
  r.steps = cfg_.training.steps;
  r.lr = lr_at(schedule_, step);
  r.precision = precision_.describe();
  set_learning_rate(r.lr);
  const at::Tensor batch = data_->global_batch(step - 1, pm_.dp_world * accumulation_ * batch_, seq_);
  const CollectiveStats comm_start = mesh_stats(pm_.mesh);
  reset_tensor_peak(pm_.mesh);

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
    if (scaler_) scaler_->unscale_(*optimizer_);  // the true gradients, for the norm and clipping
    const double max_norm = cfg_.training.max_grad_norm;
    r.grad_norm = clip_grad_norm_(pm_.parameters(), max_norm > 0 ? max_norm : INFINITY);
  }
  r.optimizer_s = now_seconds() - n0;
  r.step_s = now_seconds() - t0;

  const CommSeconds comm(comm_start, mesh_stats(pm_.mesh));
  r.ag_busy_s = comm.all_gather;
  r.ag_wait_s = comm.all_gather_wait;
  r.rs_busy_s = comm.reduce_scatter;
  r.rs_wait_s = comm.reduce_scatter_wait;
  return r;
}

// Micro-batch `micro` of the step's global batch: forward and backward, timed into r. Returns
// the micro-batch's loss (already divided by the number of micro-batches).
double Run::forward_backward(const at::Tensor& batch, int64_t micro, StepReport& r) {
  const GradientSync sync = gradient_sync_for(pm_.kind(), micro, accumulation_);
  if (pm_.kind() == DataParallelKind::kReplicated) {
    pm_.replicated.set_requires_gradient_sync(sync.requires_gradient_sync);
  } else {
    pm_.root.set_requires_gradient_sync(sync.requires_gradient_sync);
    if (pm_.kind() == DataParallelKind::kHybrid) pm_.root.set_requires_all_reduce(sync.requires_all_reduce);
  }
  auto [host_inputs, host_targets] = micro_batch(batch, pm_.dp_rank, accumulation_, micro, batch_);
  const at::Tensor inputs = host_inputs.to(pm_.mesh.device());
  const at::Tensor targets = host_targets.to(pm_.mesh.device());
  const double f0 = now_seconds();
  at::Tensor loss;
  {
    trace::Span span("compute", "forward");
    loss = loss_of(inputs, targets);
    if (accumulation_ > 1) loss = loss / static_cast<double>(accumulation_);
  }
  const double b0 = now_seconds();
  {
    trace::Span span("compute", "backward");
    (scaler_ ? scaler_->scale(loss) : loss).backward();
  }
  r.forward_s += b0 - f0;
  r.backward_s += now_seconds() - b0;
  return loss.item<double>();
}

// AdamW, timed into r, and the step's token counts.
void Run::apply_step(StepReport& r) {
  const double o0 = now_seconds();
  if (scaler_) r.loss_scale = scaler_->get_scale();
  r.overflow_skipped = !optimizer_step();
  const double o = now_seconds() - o0;
  r.optimizer_s += o;
  r.step_s += o;
  tokens_seen_ += tokens_per_step();
  r.tokens_seen = tokens_seen_;
  r.tokens_per_s = tokens_per_step() / r.step_s;
}

// AdamW on the gradients compute_step has already clipped; through the scaler under fp16: true,
// which skips it after an overflow and updates the scale. Returns whether AdamW stepped.
bool Run::optimizer_step() {
  trace::Span span("compute", "optimizer");
  bool stepped = true;
  if (scaler_) {
    stepped = scaler_->step(*optimizer_);
    scaler_->update();
  } else {
    optimizer_->step();
  }
  if (diloco_) diloco_->step();  // every diloco_inner_steps-th step: the replicas' outer step
  // Drop the gradients rather than zeroing them (PyTorch's zero_grad(set_to_none=True)): the
  // next backward's reduce-scatter writes fresh ones, and forward runs without them in memory.
  // NO_SHARD's gradients are views of its all-reduce buckets, which stay allocated anyway:
  // zeroed in place they stay views, and the next backward accumulates straight into them.
  const bool bucket_views = pm_.kind() == DataParallelKind::kReplicated;
  at::NoGradGuard no_grad;
  for (auto& group : optimizer_->param_groups()) {
    for (auto& p : group.params()) {
      if (bucket_views && p.grad().defined()) {
        p.mutable_grad().zero_();
      } else {
        p.mutable_grad() = at::Tensor();
      }
    }
  }
  return stepped;
}

// Logs an applied step: the JSONL line of every rank, and rank 0's step line, for which the
// other ranks' memory numbers are gathered (only on the steps it prints).
void Run::report_step(StepReport& r, const StepVotes& votes) {
  const TensorMemory tensors = tensor_memory(pm_.mesh);
  const RankStep mine{r.loss, tensors.live_mib, tensors.peak_mib, memory::current_rss_bytes() / kMiB};
  r.loss = votes.loss;
  // Off the printed steps only this rank's entry is read (its JSONL line).
  r.ranks.assign(world_, RankStep{});
  r.ranks[rank_] = mine;
  const bool printed =
      r.step % cfg_.logging.log_interval == 0 || r.step == cfg_.training.steps || r.eval_loss.has_value();
  if (printed) {
    const std::vector<double> all = all_gather_numbers({mine.live_mib, mine.peak_mib, mine.rss_mib});
    for (int q = 0; q < world_; ++q)
      r.ranks[q] = RankStep{votes.local_losses[q], all[3 * q], all[3 * q + 1], all[3 * q + 2]};
  }
  record_.losses.push_back(r.loss);
  record_.step_times.push_back(r.step_s);
  jsonl_.write(r, rank_);
  tensorboard_.step(r, rank_);
  if (r.eval_loss) tensorboard_.eval_loss(r.step, *r.eval_loss);  // open on rank 0 only
  if (rank_ != 0) return;
  if (printed) console_->step_line(r);
  else console_->progress(r.step);
}

// Every rank gets here at the same step with the same verdict (the votes are the same
// everywhere). Returns the exit code. A non-finite step or one after a failed save was not
// applied; a signal's step was, and is saved.
int Run::stop(int64_t step, StepVerdict verdict, const StepVotes& votes) {
  int code = kExitError;
  if (verdict == StepVerdict::kStopNonFinite) {
    print(non_finite_stop_message(step, votes, cfg_.training.max_grad_norm, checkpoints_->last_good()));
    code = kExitNonFinite;
  } else if (verdict == StepVerdict::kStopFailedSave) {
    const std::string good = checkpoints_->last_good();
    std::cerr << "fsdp-train: rank " << rank_ << ": "
              << failed_save_line(step, votes, checkpoints_->background_step(), checkpoints_->save_error(), rank_ == 0,
                                  good)
              << "\n"
              << std::flush;
  } else {
    const std::string dir = checkpoints_->save(step, state(), counters());
    const int sig = stop_signal() ? stop_signal() : SIGTERM;  // another rank's signal
    print(signal_stop_message(step, sig, dir));
    code = 128 + sig;
  }
  print(write_trace(cfg_, rank_));
  return code;
}

void Run::finish(int64_t last_step) {
  // Without a checkpoint of the last step the export would be the only copy of what was trained:
  // the checkpoint is written first, so that an export that fails (a full disk) loses nothing.
  const bool export_only_copy = writes_export(cfg_) && checkpoints_->last_saved_step() != last_step;
  if (export_only_copy ||
      final_save_needed(cfg_.fsdp_config.checkpoint_interval, checkpoints_->last_saved_step(), last_step))
    checkpoints_->save(last_step, state(), counters());
  checkpoints_->wait();
  if (checkpoints_->last_saved_step() == last_step) print("checkpoint: " + checkpoints_->last_saved_dir());
  print(write_trace(cfg_, rank_));
  if (last_step > start_step_) {
    record_.steps_run = last_step - start_step_;
    record_.seq = seq_;
    record_.tokens_per_step = tokens_per_step();
    write_summary(cfg_, shape_, pm_, precision_, record_, rank_ == 0 ? console_.get() : nullptr);
  }
  try {
    export_and_sample(cfg_, *family_, pm_, tokenizer_.get(), [this](const std::string& line) { print(line); });
  } catch (const std::exception& e) {
    if (checkpoints_->last_saved_step() != last_step) throw;
    throw std::runtime_error("training.export " + export_destination(cfg_) + " failed: " + error_text(e) +
                             "; nothing trained is lost: the checkpoint " + checkpoints_->last_saved_dir() +
                             " holds step " + std::to_string(last_step) +
                             ". Free the space or fix the destination, then run again with --training.resume=" +
                             checkpoints_->last_saved_dir() + ": it exports without training");
  }
}

}  // namespace

int run_training(const TrainConfig& cfg) { return Run(cfg, RunMode::kTrain).main(); }

int run_evaluation(const TrainConfig& cfg) { return Run(cfg, RunMode::kEvaluate).main(); }

}  // namespace train
}  // namespace fsdp
