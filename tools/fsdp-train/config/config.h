// config.h — the configuration of an fsdp-train run.
//
// A run is described by a YAML file with the sections below, then adjusted by command-line
// overrides `--section.key=value`. These are plain
// structs without torch types so that the loader can be tested and reused on its own; turning
// them into ModelArgs, an optimizer, etc. is the trainer's job.
//
// Every default is written next to its field; configs/*.yaml show complete files.
//
// The YAML is read strictly: a key or section written twice is an error naming both lines (YAML
// loaders would keep the last one silently), and a quoted value must end on the line it starts
// (write \n for a newline), so that a forgotten closing quote is reported at the line that opens
// it instead of swallowing the keys after it.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace fsdp {
namespace train {

// Every problem with a configuration: the message names the key (section.key) and where the
// value came from (file:line, or "command line").
struct ConfigError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

enum class ShardingStrategy {
  FULL_SHARD,          // params, grads and optimizer state sharded; reshard after forward (ZeRO-3)
  SHARD_GRAD_OP,       // as FULL_SHARD but params stay gathered between forward and backward (ZeRO-2)
  NO_SHARD,            // replicate everything: data parallelism (fsdp::replicate, DDP's bucketed all-reduce)
  HYBRID_SHARD,        // FULL_SHARD within each replica group, gradients all-reduced across them (HSDP)
  HYBRID_SHARD_ZERO2,  // HYBRID_SHARD keeping the parameters gathered from forward to backward
};
const char* to_string(ShardingStrategy s);

// A floating-point dtype of fsdp_config.param_dtype / reduce_dtype, without torch types.
enum class Dtype { kFloat32, kBFloat16, kFloat16 };
const char* to_string(Dtype d);   // the key's spelling: float32 | bfloat16 | float16
const char* short_name(Dtype d);  // for logs: fp32 | bf16 | fp16

struct FsdpConfig {
  // -1 = take the launcher's (WORLD_SIZE). Otherwise >= 1 and must match the launcher.
  int world_size = -1;
  // -1 or 0 = take the launcher's (LOCAL_RANK): one file is read by every rank, so only a
  // positive value can be meant for one particular rank; a positive value must match.
  int local_rank = -1;
  // FSDP2 always keeps optimizer state on the local shards; false is not supported.
  bool shard_optimizer_state = true;
  // Mixed precision: one FSDP2 MixedPrecisionPolicy on every fully_shard call (blocks and
  // root). The parameters the optimizer, checkpoints and exports see stay fp32 (the master
  // weights); only the all-gathered copies that forward and backward compute with, and the
  // gradient reduction, change dtype. The loss is computed in fp32 either way.
  //   mixed_precision: true  = param_dtype bfloat16, reduce_dtype float32 (torchtitan's default)
  //   param_dtype, reduce_dtype: float32 | bfloat16 | float16, or unset (`key:`) to leave it to
  //     mixed_precision. Each one set wins over mixed_precision, whatever its value: as in
  //     torchtitan the dtypes are the policy, so `param_dtype: bfloat16` alone turns bf16 on
  //     and `param_dtype: float32` turns it off again under mixed_precision: true.
  // All float32 (the default) is no policy at all. float16 parameters compute with LibTorch
  // 2.x's fp16 kernels (on CPU too), without a gradient scaler. The resolved
  // dtypes: precision_of(). With bf16 parameters, rank 0 checks at start-up that the CPU has
  // native bf16 and warns with measured rates when it has not (hardware.h).
  bool mixed_precision = false;
  std::optional<Dtype> param_dtype;
  std::optional<Dtype> reduce_dtype;
  // fp16 compute with a gradient scaler (fsdp::GradScaler, torch.amp's GradScaler): param_dtype
  // float16 and reduce_dtype float32 unless those keys are set, the loss scaled before backward,
  // the gradients unscaled before clipping, and a step whose gradients overflowed skipped (the
  // scale backs off) instead of stopping the run. Device cuda only: on cpu it is refused at
  // configuration time with its reason (check_supported). The scaler's state is in every
  // checkpoint of the run's own format (checkpoint_state.h).
  bool fp16 = false;
  // Activation checkpointing (fsdp::call_checkpointed): the checkpointed blocks keep no
  // activations and recompute their forward in backward. Every activation_checkpointing_every-th
  // block is checkpointed (1 = every block, 2 = every second one, as torchtitan's selective
  // layer option counts). Only reentrant checkpointing exists in C++ (LibTorch's C++ API has no
  // default saved-tensor hooks), so activation_checkpointing with use_reentrant: false is refused.
  bool activation_checkpointing = false;
  int64_t activation_checkpointing_every = 1;  // >= 1; only meaningful with activation_checkpointing
  // The final norm and the output head as an FSDP group of their own instead of the root's
  // (models::sharded_transformer's head_options form): their gathered parameters and unsharded
  // gradients are freed right after the head's backward, before the blocks' backward. Not with
  // NO_SHARD (fsdp::replicate has no groups).
  bool output_head_group = false;
  // How many FSDP groups ahead each group's all-gather is issued, in forward and in backward.
  // 1: FSDP2's implicit prefetch (the next group). k > 1: each group prefetches the next k in
  // forward order and the previous k in backward (FSDPModule::set_modules_to_forward_prefetch /
  // set_modules_to_backward_prefetch, as a torchtitan user writes them), so that a slow link
  // carries all-gathers while compute runs ahead, and a backward all-gather is queued before the
  // reduce-scatters that the group's own backward then issues; each step ahead keeps one more
  // group gathered. Not with NO_SHARD (no groups); fsdp-train plan models 1 only.
  int64_t prefetch_depth = 1;
  // How many reduce-scatters each group may have in flight
  // (FSDPModule::set_reduce_scatter_max_input_buffers). 1 is FSDP2's: issuing the next
  // reduce-scatter first waits for the previous one, so over a slow link backward's compute stops
  // until the link has carried it. k > 1 lets backward run ahead while k reduce-scatter inputs wait
  // for the link, each one group's unsharded gradients in memory. The sums are the same. Not with
  // NO_SHARD (no reduce-scatters); fsdp-train plan models 1 only.
  int reduce_scatter_max_input_buffers = 1;
  std::string device = "cpu";  // cpu | cuda (cuda not supported by this CPU build)
  // Offload, on device cuda:
  //   offload_params: true, offload_optimizer_state: true   FSDP2's CPUOffloadPolicy: sharded
  //     parameters, gradients and AdamW's state in pinned host memory, AdamW stepping on the host;
  //   offload_params: true, offload_optimizer_state: false  the parameters and gradients as above,
  //     AdamW's state on the GPU, each shard copied up to step there and back
  //     (fsdp::optim::DeviceStateAdamW; not with optimizer.fused);
  //   offload_params: false, offload_optimizer_state: true  not supported yet (refused);
  //   both false: everything on the GPU.
  // On device cpu device memory is host memory, so every pair means the same placement: the
  // offload path runs with identity copies when offload_params is true, and rank 0 says once
  // that the keys change nothing there.
  bool offload_params = false;
  bool offload_optimizer_state = false;
  // Only meaningful with activation_checkpointing (as in PyTorch), so either value is accepted
  // without it. Default true, as the FSDP example's configuration has it.
  bool use_reentrant = true;
  // >= 1: tensor-parallel ranks per model copy. k > 1 trains on the mesh (world / k, k) named
  // (dp, tp): the blocks split over tp (fsdp::models::parallelize), FSDP over dp.
  int model_parallel_size = 1;
  // With model_parallel_size k > 1: the token embedding and the output head split by vocabulary
  // over tp too (models::ParallelizeOptions::vocab_parallel), the loss computed from each rank's slice of
  // the logits; model.vocab_size must be divisible by k. false keeps both whole on every tp rank.
  // Without tensor parallelism there is nothing to split, and either value trains the same.
  bool vocab_parallel = true;
  int64_t checkpoint_interval = 0;  // save every N steps; 0 = only the last step, before an export
  // Created if needed and checked for writing at start-up (rank 0), before any training.
  std::string checkpoint_dir = "./checkpoints";
  // How checkpoint_dir/step_<N> is written: fsdp = the project's own format (fsdp/checkpoint.h:
  // CRC-checked, saved in the background, `latest` and pruning by the CheckpointManager); dcp =
  // PyTorch's Distributed Checkpoint layout (fsdp/dcp.h), which Python's dcp.load reads at any
  // world size: saved in the foreground, pruned to training.keep_checkpoints, no checksums, and
  // without the dropout RNG state (a resumed run with model.dropout_p > 0 draws other masks).
  std::string checkpoint_format = "fsdp";
  ShardingStrategy sharding_strategy = ShardingStrategy::FULL_SHARD;
  // How many replicas of the model the data-parallel ranks form: HYBRID_SHARD shards each
  // parameter over world / replicate_degree ranks and replicates it replicate_degree times.
  // Unset: HYBRID_SHARD* take one replica per node (world / LOCAL_WORLD_SIZE, sharding within a
  // node as PyTorch's FSDP does); NO_SHARD is the world; FULL_SHARD and SHARD_GRAD_OP are 1.
  std::optional<int> replicate_degree;
  // The blocks' reshard_after_forward as a group size k (FSDP2's int form): after forward each
  // block keeps 1/k of its parameters and backward all-gathers them among k ranks instead of
  // the whole shard group. Unset: the strategy's (FULL_SHARD and HYBRID_SHARD reshard fully,
  // the ZeRO-2 strategies not at all). Only with a strategy that reshards; k must divide the
  // ranks each parameter is sharded over. The root keeps FSDP2's default.
  std::optional<int> reshard_after_forward;
  // Fewer bytes between hosts (fsdp/quantized_comm.h), each unset (off) by default:
  //   quantized_weights: int8 | float8_e4m3 | bfloat16   ZeRO++'s qwZ: the all-gathers carry the
  //     shards encoded; the shards and the optimizer stay in their dtype.
  //   quantized_gradients: int8 | float8_e4m3 | bfloat16   ZeRO++'s qgZ, HYBRID_SHARD* only: the
  //     all-reduce between replicas carries the gradient encoded, with error feedback.
  //   quantization_block_size: elements per scale (16 to 4096), for both.
  //   quantized_gradients_skip_zero_blocks: with quantized_gradients int8 or float8_e4m3, send only
  //     the blocks where a rank's gradient is not all zeros (an embedding's untouched rows).
  std::optional<std::string> quantized_weights;
  std::optional<std::string> quantized_gradients;
  int64_t quantization_block_size = 256;
  bool quantized_gradients_skip_zero_blocks = false;
  // DiLoCo (fsdp/diloco.h), HYBRID_SHARD* only: diloco_inner_steps H > 0 shards each replica
  // within itself only, and every H steps averages the replicas' pseudo-gradient with an outer
  // Nesterov SGD (diloco_outer_lr, diloco_outer_momentum), in diloco_fragments fragments taking
  // turns, encoded as diloco_quantized on the link (unset: fp32). 0 (the default): off.
  int64_t diloco_inner_steps = 0;
  double diloco_outer_lr = 0.7;
  double diloco_outer_momentum = 0.9;
  int64_t diloco_fragments = 1;
  std::optional<std::string> diloco_quantized;
  // How long any collective (and the start-up rendezvous) may wait for the other ranks before
  // the run stops naming the ranks it waited for; in (0, kMaxCollectiveTimeoutS]. Unset = the
  // library's default (300 s), or FSDP_COLLECTIVE_TIMEOUT_MS from the environment, which the
  // library lets win over this key (the trainer then says so).
  std::optional<double> collective_timeout_s;
  // The process-group backend: "gloo", "mpi" (the job started by mpirun or srun), or "auto"
  // (default): mpi under mpirun/srun when the build has MPI, else gloo. FSDP_BACKEND in the
  // environment wins over it (the trainer then says so).
  std::string backend = "auto";
};
constexpr double kMaxCollectiveTimeoutS = 30.0 * 24 * 3600;  // 30 days

// The model: its family (architecture) and what shapes it: for fsdp-cpp's own model a preset
// (tiny | small | medium, as fsdp::models::ModelArgs::preset) and optional overrides of each size
// (an unset override keeps the preset's value); for one of transformers' models a Hugging Face
// config.json. The families and which keys apply to each are models/registry.cpp's and
// docs/models.md's; a key that does not apply to the chosen family stops the run.
struct ModelConfig {
  // The model family (models/registry.cpp). Empty: not given: the family whose config.json
  // "architectures" names, when a config.json shapes the model (hf_config, or init_from when it
  // is a Hugging Face directory), else fsdp-cpp's own model.
  std::string architecture;
  std::string hf_config;  // a config.json that shapes the model, without a Hugging Face init_from
  std::string preset = "tiny";
  std::optional<int64_t> n_layers;     // > 0
  std::optional<int64_t> vocab_size;   // > 0
  std::optional<int64_t> max_seq_len;  // > 0
  std::optional<int64_t> dim;          // > 0
  std::optional<int64_t> n_heads;      // > 0
  std::optional<double> dropout_p;     // [0, 1)
  // The weights to start from instead of the seeded random initialisation; empty = none. A
  // PyTorch state dict file (Python's torch.save(model.state_dict(), path)), read whole on every
  // rank, or a safetensors directory (training.export=<name>.safetensors writes one), of which
  // each rank reads only its shards' rows, or a Hugging Face model directory (config.json and
  // safetensors: the family config.json names, its shape from config.json, each rank reading its
  // rows).
  std::string init_from;
  // Parameters that do not train, each entry a parameter or module FQN (tok_embeddings,
  // layers.0.attention.wq.weight): their parameters get requires_grad = false, so they have no
  // gradient, no optimizer state and no place in the gradient norm, and keep their values. An
  // entry that names nothing stops the run.
  std::vector<std::string> freeze;
};

struct DataConfig {
  std::string source = "synthetic";  // synthetic | tokens (a token file; then path is required)
  std::string path;                  // the token file for source: tokens
  int64_t data_seed = 1234;          // step s's batch (s from 0) is drawn with a generator seeded data_seed + s
  // The SentencePiece model the token files were made with (`fsdp-train tokenize --tokenizer`):
  // the sample after training encodes its prompt and decodes its text with it. Empty = none: a
  // byte-level token file's sample is printed as text, any other as token ids.
  std::string tokenizer;
};

// The model's mean cross-entropy over the start of a token file (`fsdp-train eval`, and during
// training every `interval` steps): `batches` global batches of dp world x
// training.micro_batch_size windows each, as training's are made up, of consecutive,
// non-overlapping windows of training.seq_len + 1 tokens from the start of `path`, in order;
// every predicted token weighs alike. The windows depend on the global batch only, so the same
// global batch gives the same loss at any world size.
struct EvalConfig {
  std::string path;      // a token file (either format data.path reads); required by eval and interval
  int64_t batches = 1;   // >= 1; the file must hold batches x global batch x (seq_len + 1) tokens
  int64_t interval = 0;  // >= 0; evaluate after every N-th training step (and the last); 0 = never
};

// AdamW.
struct OptimizerConfig {
  double lr = 1e-3;            // > 0
  double beta1 = 0.9;          // [0, 1); also settable as betas: [b1, b2]
  double beta2 = 0.999;        // [0, 1)
  double weight_decay = 0.01;  // >= 0 (torch.optim.AdamW default)
  double eps = 1e-8;           // > 0
  // fsdp::optim::FusedAdamW (the same math, state and checkpoints as torch::optim::AdamW, one
  // vectorized pass per FSDP group's flat shard) instead of torch::optim::AdamW. Checkpoints of
  // either resume with the other.
  bool fused = false;
};

// Linear warm-up from 0 to optimizer.lr over warmup_steps, then cosine decay to min_lr over
// decay_steps (0 = the remaining training steps), then min_lr.
struct ScheduleConfig {
  int64_t warmup_steps = 0;  // >= 0
  double min_lr = 0.0;       // >= 0
  int64_t decay_steps = 0;   // >= 0
};

struct TrainingConfig {
  int64_t steps = 100;                      // > 0, optimizer steps
  int64_t micro_batch_size = 4;             // > 0, rows per rank per micro-batch
  int64_t gradient_accumulation_steps = 1;  // > 0, micro-batches per optimizer step
  int64_t seq_len = 0;                      // 0 = the model's max_seq_len, else > 0
  // The loss over the sequence in this many pieces (in [1, seq_len]), each one's final norm,
  // output head and fp32 cross-entropy checkpointed (fsdp/models/causal_lm.h's forward_loss): the whole
  // [micro_batch_size, seq_len, vocab] logits, their log-softmax and gradient are never in
  // memory, one piece's at a time instead, for one more forward of the output head in backward.
  // The loss and gradients are the same up to float rounding. 1 = the whole logits at once.
  // Independent of fsdp_config.activation_checkpointing, which leaves it at 1.
  int64_t loss_chunks = 1;
  // clip_grad_norm_ threshold; 0 = no clipping. The global gradient norm is computed every
  // step either way, and a step whose gradient norm or loss is NaN or infinite stops the run
  // before the optimizer steps (PyTorch's clip_grad_norm_(error_if_nonfinite=True)): exit 3,
  // naming the step; nothing of that step is applied or saved.
  double max_grad_norm = 1.0;
  int64_t seed = 0;  // model initialisation (same on every rank)
  // auto: the checkpoint `latest` names under fsdp_config.checkpoint_dir; when that is missing
  // or incomplete, the newest complete step_<N> (saying so); when checkpoints exist but none is
  // complete, the run stops with an error instead of starting over. never: start from step 0.
  // <path>: that checkpoint, which must be complete.
  std::string resume = "auto";
  // With resume: auto, a checkpoint whose recorded model shape, seed or data (run_identity.h)
  // differ from this configuration's stops the run naming the differences; true resumes anyway.
  bool allow_resume_mismatch = false;
  int64_t keep_checkpoints = 2;  // >= 0; newest checkpoints kept (0 = all)
  // The trained model as one file: auto = <checkpoint_dir>/model.pt (PyTorch format), none, or a
  // path (ending in .safetensors: a safetensors directory of that name; else PyTorch format).
  // hf (a family of transformers' models): a Hugging Face directory <checkpoint_dir>/hf (config.json, sharded
  // safetensors and the index) that transformers' from_pretrained loads; hf:<dir> the same in
  // <dir>.
  std::string export_path = "auto";      // key: training.export
  std::string export_dtype = "float32";  // float32 | bfloat16 | float16: the tensors of an hf export
};

struct LoggingConfig {
  int64_t log_interval = 1;           // > 0, rank 0 prints every N steps
  std::string jsonl;                  // per-rank JSONL metrics path; empty = none
  bool trace = false;                 // write a Chrome/Perfetto trace per rank
  std::string progress = "auto";      // auto (when stdout is a terminal) | on | off
  std::string trace_dir = "./trace";  // with trace: trace_rank<r>.json per rank
  std::string summary_json;           // rank 0 writes the run's summary here (one JSON object); empty = none
  int64_t summary_warmup = 2;         // >= 0; leading steps left out of the summary's medians
  std::string tensorboard_dir;        // rank 0 writes TensorBoard event files here (tensorboard.h); empty = none
};

// After training, rank 0 generates a sample with the trained model (length 0 = none).
struct SampleConfig {
  int64_t length = 0;        // >= 0, tokens to generate
  std::string prompt;        // text (byte-level data) to start from; empty = a newline
  double temperature = 0.8;  // > 0; softmax temperature (tiny = nearly greedy)
  int64_t seed = 0;          // sampling RNG
};

struct TrainConfig {
  FsdpConfig fsdp_config;
  ModelConfig model;
  DataConfig data;
  EvalConfig eval;
  OptimizerConfig optimizer;
  ScheduleConfig schedule;
  TrainingConfig training;
  LoggingConfig logging;
  SampleConfig sample;
  // The configuration as given, for the logs that record it (TensorBoard's Text tab): the
  // config file's path and text (both empty without a file) and the command-line overrides.
  struct Source {
    std::string path, text;
    std::vector<std::string> overrides;
  };
  Source source;
  // Where each key given was set, "file.yaml:12" or "command line (--section.key=v)", by
  // "section.key"; keys left at their default are absent. For errors found after loading.
  std::map<std::string, std::string> origins;
};

// Where `key` ("section.key") was set, as origins holds it; "" when it was left at its default.
std::string origin_of(const TrainConfig& cfg, const std::string& key);

// Reads yaml_path (empty = defaults only), then applies overrides in order, each
// "--section.key=value" with value in YAML syntax (so lists work: --optimizer.betas=[0.9,0.95]).
// Throws ConfigError on a missing, malformed or empty file, one larger than 1 MiB or that is not
// a regular file or pipe, unknown sections or keys, a key or section
// given twice in the file, wrong types and out-of-range values; file errors name the file (and
// the line). Never throws anything else for bad input. A key that needs a feature this build left
// out (data.tokenizer without SentencePiece) is refused here, naming the key and the build option.
TrainConfig load_config(const std::string& yaml_path, const std::vector<std::string>& overrides = {});

// Whether this build reads SentencePiece models (CMake's FSDP_WITH_SENTENCEPIECE), and the message
// that refuses `key` (data.tokenizer, --tokenizer) naming `model` when it does not.
bool built_with_sentencepiece();
std::string without_sentencepiece(const std::string& key, const std::string& model);

// The dtypes a run computes and reduces in, resolved from fsdp_config (see FsdpConfig).
struct Precision {
  Dtype param = Dtype::kFloat32;   // the all-gathered parameters: forward and backward compute
  Dtype reduce = Dtype::kFloat32;  // the gradients' reduce-scatter
  bool loss_scaling = false;       // fp16: true: a GradScaler scales the loss
  bool is_mixed() const { return param != Dtype::kFloat32 || reduce != Dtype::kFloat32; }
  // "fp32" when nothing changes, else "param bf16, reduce fp32"; " with loss scaling" appended
  // under fp16: true.
  std::string describe() const;
};
Precision precision_of(const FsdpConfig& f);

// Whether this build and machine can train on a GPU. This library has no torch: the program
// fills it from fsdp/device.h (cuda_available(), cuda_unavailable_reason()).
struct DeviceSupport {
  bool cuda = false;
  std::string why_no_cuda = "the program did not say whether this machine has a GPU";
};
// Parameters offloaded with AdamW's state kept on the GPU (device cuda, offload_params: true,
// offload_optimizer_state: false): the trainer steps with fsdp::optim::DeviceStateAdamW.
bool steps_with_device_state_adamw(const TrainConfig& cfg);

// Throws ConfigError naming every key set to a capability that does not exist yet, or that
// this machine cannot run (fp16 compute on device cpu, device cuda without a GPU).
void check_supported(const TrainConfig& cfg, const DeviceSupport& devices = DeviceSupport());

// Throws ConfigError when fsdp_config.world_size / local_rank are given and differ from the
// launcher's environment, saying which and both values.
void check_against_launcher(const TrainConfig& cfg, int env_world_size, int env_local_rank);

// FULL_SHARD and HYBRID_SHARD -> true; SHARD_GRAD_OP and HYBRID_SHARD_ZERO2 -> false; NO_SHARD
// has nothing to reshard (throws, naming the strategy).
bool reshard_after_forward(const TrainConfig& cfg);

// The data-parallel mesh of a run: `replicate` copies of the model, each sharded over `shard`
// ranks (replicate * shard = world). A 1-D mesh unless the strategy is HYBRID_SHARD*.
struct DataParallelShape {
  int replicate = 1;
  int shard = 1;
  bool hybrid = false;  // a 2-D (replicate, shard) mesh
};
// How a model's gradients are reduced: replicated (NO_SHARD), sharded over one mesh dim, or
// hybrid (HYBRID_SHARD*: sharded within each replica, all-reduced across them).
enum class DataParallelKind : uint8_t { kReplicated, kSharded, kHybrid };
// Validates fsdp_config.replicate_degree against the strategy and the launcher's world
// (`world` ranks, `local_world` per node); throws ConfigError naming the key and both values.
DataParallelShape data_parallel_shape(const TrainConfig& cfg, int world, int local_world);
// fsdp_config.reshard_after_forward against the shard group of `shape`; throws ConfigError
// naming the key and the group size when it does not divide it.
void check_reshard_group(const TrainConfig& cfg, const DataParallelShape& shape);

// Throws ConfigError naming fsdp_config.model_parallel_size when it does not divide the world,
// or the model's n_heads or dim (each tensor-parallel rank computes whole heads), or, with
// fsdp_config.vocab_parallel, vocab_size.
void check_model_parallel(const TrainConfig& cfg, int world, int64_t n_heads, int64_t dim, int64_t vocab_size);

}  // namespace train
}  // namespace fsdp
