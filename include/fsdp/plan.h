// layer: plan (what may include what: docs/architecture.md)
/// \file
/// fsdp/plan.h — how much memory and communication a training step needs, per rank, before
/// anything runs: the memory/communication planner behind `fsdp-train plan`.
///
/// \code{.cpp}
///   fsdp::plan::ModelSpec model = fsdp::plan::transformer_spec(shape, activations);
///   fsdp::plan::Plan p = fsdp::plan::plan(model, fsdp::plan::PlanOptions().world(4).micro_batches(2));
///   std::printf("rank 0 peak %lld bytes\n", static_cast<long long>(p.ranks[0].peak_tensor_bytes));
///   // On GPUs, shards in pinned host memory, AdamW's state on the GPU: two peaks per rank.
///   fsdp::plan::Plan g = fsdp::plan::plan(model, fsdp::plan::PlanOptions().world(8).device(fsdp::plan::Device::kCuda)
///                                                    .offload(true).optimizer(fsdp::plan::Optimizer::kDeviceStateAdamW));
///   // g.ranks[0].peak_tensor_bytes: the GPU's; g.ranks[0].host_peak_tensor_bytes: the host's
/// \endcode
///
/// The planner replays one optimizer step the way fully_shard runs it (src/fsdp/param_group.cpp,
/// state.cpp): each group's all-gather buffer and unsharded parameters from its pre-forward (or the
/// forward prefetch one group earlier) to its post-forward reshard (or, without
/// reshard_after_forward, to its post-backward), the root kept unsharded for the whole step, the
/// backward prefetch of the group before, the unsharded gradients until the reduce-scatter copies
/// them in, the sharded gradients until the optimizer has stepped, and each stage's activations:
/// kept from its forward to its backward, recomputed in backward when checkpointed. It adds up the
/// live bytes at each point and keeps the largest: the peak tensor bytes that
/// fsdp::memory::max_allocated_bytes() reports for a step (include/fsdp/memory.h), and what is
/// alive then, by module.
///
/// Tensor parallelism (ModelSpec::tensor_parallel > 1): every rank holds its tp pieces of the
/// parameters (the GroupSpecs give those local shapes), FSDP shards each piece over the world / tp
/// data-parallel ranks, and the stages' tp all-reduces (in forward, in backward, and again in a
/// checkpointed stage's recomputation) run on the tp group.
///
/// Device cuda (PlanOptions::device): the step computes on a GPU and the host's memory is apart.
/// The replay then keeps two ledgers: the GPU's (all-gather buffers, unsharded parameters and
/// gradients, reduce-scatter buffers, activations, the micro-batch's tokens, and whatever the
/// placement leaves there) and the host's (the step's data, and under offload the pinned sharded
/// parameters and gradients, and the optimizer state where it lives there). The placements are the
/// trainer's three on cuda:
/// \code{.cpp}
///   no offload                    everything of the model on the GPU, as on device cpu;
///   offload, AdamW / FusedAdamW   FSDP2's CPUOffloadPolicy: sharded parameters and gradients
///                                 pinned on the host, AdamW's state there too, and AdamW steps
///                                 there; the GPU holds each group's copy of its shard for the
///                                 all-gather, the all-gather and reduce-scatter buffers until the
///                                 reduce-scatter's output is copied to the host;
///   offload, kDeviceStateAdamW    the shards and gradients as above, AdamW's state on the GPU,
///                                 and at the step each parameter's shard and gradient copied up,
///                                 two parameters' copies at a time (fsdp/device_state_adamw.h).
/// \endcode
/// Collective buffers are NCCL's own there, not tensors: no scratch is counted. This is a model of
/// the GPU allocator's peak (torch.cuda.max_memory_allocated's), restated from the runtime's code;
/// unlike the cpu figures it has not been compared with a measured run.
///
/// A module of your own: describe its FSDP groups (the parameters of each fully_shard call, the
/// root first) and its stages (what each part of forward keeps for backward), then call plan().
/// Nothing here is collective, allocates tensors or needs LibTorch; every function is thread-safe.
/// Errors (an impossible option, an empty model) throw std::invalid_argument naming the option.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace fsdp {
namespace plan {

/// The dtypes the planner knows: fp32, bf16, fp16.
enum class Dtype { kFloat32, kBFloat16, kFloat16 };
int64_t bytes_of(Dtype d);     ///< 4, 2 or 2
const char* name_of(Dtype d);  ///< fp32 | bf16 | fp16

/// One parameter: its name and shape. fully_shard splits it along dim 0 into world pieces of
/// ceil(rows / world) rows (the last pieces padded).
struct ParamSpec {
  std::string name;            ///< its name, for the report
  std::vector<int64_t> shape;  ///< its whole shape (one tp rank's piece under tensor parallelism)
  int64_t numel() const;       ///< the product of shape
};

/// The parameters of one fully_shard call. groups[0] of a ModelSpec is the root, which FSDP2 keeps
/// gathered from its forward to the end of backward.
struct GroupSpec {
  std::string name;               ///< the module's name ("" for the root)
  std::vector<ParamSpec> params;  ///< its parameters, in registration order
  /// false: kept gathered from its forward to its backward whatever PlanOptions says (a group
  /// whose backward comes first, such as an output head of its own); it reshards after backward.
  bool reshard_after_forward = true;
};

/// All-reduces of one size on the tp group that a stage runs per micro-batch: in its forward, in
/// its backward, and the forward's again when a checkpointed stage recomputes it (recomputed =
/// false for those outside the recomputed part, such as the loss's).
struct TpAllReduce {
  int64_t forward = 0;     ///< all-reduces in forward
  int64_t backward = 0;    ///< all-reduces in backward
  double bytes = 0;        ///< the size of each
  bool recomputed = true;  ///< the forward's run again in a checkpointed stage's recomputation
};

/// One part of forward, in forward order, run by one group's module (the root's embeddings and
/// its output head are two stages of group 0). Bytes are per micro-batch, in the dtypes the stage
/// computes in.
struct StageSpec {
  std::string name;                 ///< its name, for the report (e.g. "layers.0")
  int group = 0;                    ///< index into ModelSpec::groups
  std::vector<int> grads;           ///< indices of the group's params whose gradients its backward makes
  double saved_bytes = 0;           ///< kept from its forward to its backward (the output included)
  double output_bytes = 0;          ///< its output, the next stage's input
  double forward_extra_bytes = 0;   ///< above saved_bytes at the high point of its forward
  double backward_extra_bytes = 0;  ///< above saved_bytes at the high point of its backward
  bool grads_before_peak = true;    ///< its parameters' gradients exist at its backward's high point
  bool checkpointed = false;        ///< keeps only output_bytes; recomputes its forward in backward
                                    ///< (forward_extra_bytes is then the high point of the no-grad forward)
  int64_t pieces = 1;               ///< checkpointed in this many pieces, one at a time (the bytes are per piece)
  /// Its backward accumulates its parameters' gradients in fp32 from the first piece on, and casts
  /// them to the compute dtype at the end (false: they are made in the compute dtype).
  bool grads_accumulated_in_fp32 = false;
  double forward_flops = 0;          ///< matmul FLOPs of one forward (all pieces), on this rank
  double other_bytes_moved = 0;      ///< bytes the non-matmul operations of one forward read and write
  bool elementwise_in_fp32 = false;  ///< those run in fp32 whatever the compute dtype (the loss)
  /// Tensor parallelism: the stage's all-reduces on the tp group, by size.
  std::vector<TpAllReduce> tp_all_reduces;
};

/// A model as the planner sees it: its FSDP groups (the root first), its stages in forward order,
/// and the step's data. transformer_spec() builds the reference Transformer's.
struct ModelSpec {
  std::vector<GroupSpec> groups;  ///< one per fully_shard call, groups[0] the root
  std::vector<StageSpec> stages;  ///< the parts of forward, in order
  double input_bytes = 0;         ///< what the step's data holds on each rank during the step (tokens)
  /// Device cuda: what of the data the GPU holds besides (a micro-batch's inputs and targets,
  /// copied there); input_bytes then stays in host memory. Unused on device cpu.
  double device_input_bytes = 0;
  int tensor_parallel = 1;  ///< tp ranks per model copy; the groups' shapes are one tp rank's pieces
};

/// The shape of fsdp::models::Transformer (include/fsdp/models/transformer.h) and of the batch.
struct TransformerShape {
  /** @{ */
  /// As fsdp::models::ModelArgs (the "tiny" preset by default).
  int64_t n_layers = 2, vocab_size = 8, max_seq_len = 16, dim = 16, n_heads = 4;
  double dropout_p = 0.0;
  /** @} */
};
/// How the trainer cuts the Transformer into FSDP groups and tensor-parallel pieces.
struct TransformerSharding {
  bool output_head_group = false;  ///< the final norm and the output head a group of their own
  int64_t tensor_parallel = 1;     ///< the blocks split over this many tp ranks (fsdp::models::parallelize)
  bool vocab_parallel = true;      ///< with tensor_parallel > 1: the embedding and head split by vocabulary too
};
/// What the Transformer's stages keep for backward depends on the batch, the compute dtype,
/// activation checkpointing and the chunked loss: the trainer's settings of them.
struct ActivationOptions {
  int64_t micro_batch = 1;          ///< rows per rank per micro-batch
  int64_t seq = 16;                 ///< training sequence length
  Dtype compute = Dtype::kFloat32;  ///< the parameters' compute dtype (MixedPrecisionPolicy::param_dtype)
  int64_t checkpoint_every = 0;     ///< 0: none; k: block i when (i + 1) % k == 0
  int64_t loss_chunks = 1;          ///< the loss in this many checkpointed pieces of the sequence
  int64_t global_rows = 1;          ///< rows of the step's global batch, which every rank draws whole
};
/// The Transformer as the trainer shards it: one group per block, the root holding the
/// embeddings, the final norm and the output head (or, with output_head_group, a last group
/// holding the final norm and the head, kept gathered from its forward to its backward). With
/// tensor_parallel k each block holds its Megatron pieces (wq, wk, wv, w1 split by rows, wo, w2 by
/// columns, the norms and w2's bias whole) and all-reduces its activations on the tp group twice in
/// forward and twice in backward. With vocab_parallel the token embedding and the head hold
/// vocab_size / k rows: the embedding all-reduces its output, the head its input's gradient, and
/// the loss two numbers per row (the vocab-parallel cross-entropy); without it they stay whole. Throws
/// std::invalid_argument for sizes the model refuses (dim not divisible by n_heads, loss_chunks
/// outside [1, seq], seq > max_seq_len, a tp size that does not divide n_heads and dim, or with
/// vocab_parallel the vocabulary).
ModelSpec transformer_spec(const TransformerShape& shape, const ActivationOptions& activations,
                           const TransformerSharding& sharding = {});

/// The shape of fsdp::models::Llama (include/fsdp/models/llama.h), as its config.json gives it.
struct LlamaShape {
  int64_t n_layers = 2;                   ///< num_hidden_layers
  int64_t vocab_size = 64;                ///< vocab_size
  int64_t hidden_size = 32;               ///< hidden_size
  int64_t intermediate_size = 64;         ///< SwiGLU's width (gate_proj, up_proj, down_proj)
  int64_t n_heads = 4;                    ///< num_attention_heads
  int64_t n_kv_heads = 2;                 ///< num_key_value_heads (grouped-query attention)
  int64_t head_dim = 8;                   ///< head_dim
  int64_t max_position_embeddings = 128;  ///< the longest sequence
  bool attention_bias = false;            ///< q/k/v biases (Qwen2)
  bool tie_word_embeddings = false;       ///< one weight for the embedding and the head, counted once
};
/// The Llama family as the trainer shards it: one group per decoder layer, the root holding the
/// embedding, the final norm and the head (the tied weight once). A layer keeps its RMSNorms'
/// outputs and normalised inputs, the rotated queries, the (repeated) keys and values, the
/// attention's output, the residual, SwiGLU's gate, up, SiLU and product, and its output. Throws
/// std::invalid_argument for sizes the model refuses (n_heads not a multiple of n_kv_heads, an
/// odd head_dim, seq beyond max_position_embeddings, loss_chunks outside [1, seq]). With
/// output_head_group the final norm and the head are a last group (untied heads only), kept
/// gathered from their forward to their backward. With tensor_parallel k each layer holds its
/// Megatron pieces (fsdp/models/llama_parallelize.h: q, k, v, gate and up by rows, o and down by
/// columns, the norms whole; k must divide n_kv_heads and intermediate_size) and all-reduces its
/// activations twice in forward and twice in backward; vocab_parallel splits the embedding and an
/// untied head by vocabulary as the Transformer's are.
ModelSpec llama_spec(const LlamaShape& shape, const ActivationOptions& activations,
                     const TransformerSharding& sharding = {});

/// The shape of fsdp::models::Gpt2 (include/fsdp/models/gpt2.h), as its config.json gives it.
struct Gpt2Shape {
  int64_t n_layers = 2;             ///< n_layer
  int64_t vocab_size = 64;          ///< vocab_size
  int64_t n_embd = 32;              ///< n_embd
  int64_t n_inner = 128;            ///< the MLP's width
  int64_t n_heads = 4;              ///< n_head
  int64_t n_positions = 128;        ///< rows of wpe: the longest sequence
  bool tie_word_embeddings = true;  ///< one weight for wte and the head, counted once
  double embd_pdrop = 0.0;          ///< dropout after the embeddings
  double attn_pdrop = 0.0;          ///< dropout on the attention's probabilities
  double resid_pdrop = 0.0;         ///< dropout after each residual branch
};
/// GPT-2 as the trainer shards it: one group per block, the root holding wte, wpe, ln_f and the
/// head (the tied weight once). A block keeps its LayerNorms' outputs and statistics, c_attn's
/// output (whose q, k and v views the attention reads), the attention's output and log-sum-exp,
/// c_proj's contiguous input, the residual, c_fc's and GELU's outputs and its own output; with
/// dropout, each site's mask and output (the attention's: its scores and probabilities too, which
/// the attention then keeps). With output_head_group ln_f and the head are a last group (untied
/// heads only). Tensor parallelism is not planned: throws std::invalid_argument for
/// tensor_parallel > 1, and for sizes the model refuses (n_embd not a multiple of n_heads, seq
/// beyond n_positions, loss_chunks outside [1, seq]).
ModelSpec gpt2_spec(const Gpt2Shape& shape, const ActivationOptions& activations,
                    const TransformerSharding& sharding = {});

/// The process-group backend the collectives run on: its rates, and whether its scratch is in
/// tensor bytes (Gloo's always; MPI's for the collectives from 256 KiB that run on fsdp-cpp's
/// rings, while OpenMPI allocates its own for the smaller ones outside LibTorch).
enum class Backend { kGloo, kMpi };
const char* name_of(Backend b);  ///< gloo | mpi

/// What one rank computes at, in one setting of its threads.
struct ComputeRates {
  double matmul_flops_fp32 = 50e9;             ///< OpenBLAS's sgemm (bench/bench_matmul)
  double matmul_flops_bf16 = 50e9;             ///< oneDNN
  double elementwise_bytes_per_s_fp32 = 10e9;  ///< a block's non-matmul work per byte the spec counts
  double elementwise_bytes_per_s_bf16 = 10e9;  ///< (bench/plan_elementwise.py)
};

/// Rates of this machine, measured by bench/bench_matmul, bench/bench_collectives,
/// bench/plan_elementwise.py and the trainer itself (configs/plan_constants.json, regenerated by
/// bench/plan_constants.py).
struct Constants {
  int cpu_cores = 1;  ///< the machine's cores, which the ranks on it share
  /// One thread per rank (fsdprun's workers, several on a machine: OMP_NUM_THREADS=1 and
  /// OPENBLAS_NUM_THREADS=1); ranks beyond cpu_cores share the cores.
  ComputeRates one_thread;
  /// One rank alone on the machine with no thread variables: LibTorch's and OpenBLAS's own choice.
  ComputeRates single_rank;
  double memory_bytes_per_s = 10e9;  ///< one thread, streaming (the optimizer)
  /** @{ */
  /// Per collective: a latency per step of its ring (ranks - 1 of them), and the bus bandwidth.
  /// "oversubscribed": the latency per step with two ranks per core. These three: Gloo's.
  double collective_bytes_per_s = 1e9;  ///< Gloo
  double collective_latency_s = 1e-4;
  double collective_latency_s_oversubscribed = 1e-4;
  /** @} */
  /** @{ */
  /// The same for the MPI backend.
  double mpi_collective_bytes_per_s = 1e9;
  double mpi_collective_latency_s = 1e-4;
  double mpi_collective_latency_s_oversubscribed = 1e-4;
  /** @} */
  /** @{ */
  /// Per micro-batch and stage, one thread, beyond the arithmetic: FSDP's hooks, autograd and the
  /// trainer (computing in fp32, or below, which adds the parameters' casts), and a checkpointed
  /// stage's recomputation on top.
  double stage_overhead_s = 0;
  double bf16_stage_overhead_s = 0;
  double checkpointed_stage_overhead_s = 0;
  /** @} */
  double runtime_rss_bytes = 0;    ///< RSS of a rank with no tensors (LibTorch, Gloo, the program)
  double rss_per_tensor_byte = 1;  ///< peak RSS above the runtime per byte of peak tensors (block cache)
  std::string source;              ///< where the numbers came from (machine, date, commit)
};
/// The constants of configs/plan_constants.json as built into the library.
Constants measured_constants();
/// Parses the JSON of a constants file; throws std::invalid_argument naming a missing key.
Constants constants_from_json(const std::string& json_text);

/// kDeviceStateAdamW: fsdp::optim::DeviceStateAdamW (fsdp/device_state_adamw.h), which with
/// offloaded parameters on device cuda keeps AdamW's state on the GPU and steps there; it needs
/// device(Device::kCuda) and offload(true).
enum class Optimizer { kAdamW, kFusedAdamW, kDeviceStateAdamW };
/// Where the step computes: kCpu, one memory; kCuda, a GPU with the host's memory apart.
enum class Device { kCpu, kCuda };
const char* name_of(Device d);  ///< cpu | cuda
/// kAsLaunched: kOnePerRank when several ranks share a machine, kLibraryDefaults for a rank alone.
enum class Threads { kAsLaunched, kOnePerRank, kLibraryDefaults };

/// The run to plan, LibTorch style: `PlanOptions().world(8).micro_batches(2)`. Each setter
/// returns the options; plan() checks them together.
struct PlanOptions {
  /// The number of ranks (the world size).
  PlanOptions& world(int v) {
    world_ = v;
    return *this;
  }
  /// HSDP replicas (1: FULL_SHARD); must divide the world.
  PlanOptions& replicate(int v) {
    replicate_ = v;
    return *this;
  }
  /// NO_SHARD: fsdp::replicate (DDP), whole parameters on every rank.
  PlanOptions& no_shard(bool v) {
    no_shard_ = v;
    return *this;
  }
  /// Whether the blocks free their gathered parameters after forward (ZeRO-3) or keep them to
  /// backward (ZeRO-2); groups whose GroupSpec says false keep them either way.
  PlanOptions& reshard_after_forward(bool v) {
    reshard_after_forward_ = v;
    return *this;
  }
  /// MixedPrecisionPolicy's param_dtype: the dtype of the all-gathers and unsharded parameters.
  PlanOptions& param_dtype(Dtype v) {
    param_dtype_ = v;
    return *this;
  }
  /// MixedPrecisionPolicy's reduce_dtype: the dtype of the reduce-scatters.
  PlanOptions& reduce_dtype(Dtype v) {
    reduce_dtype_ = v;
    return *this;
  }
  /// CPUOffloadPolicy: identity copies on device cpu; on device cuda the sharded parameters and
  /// gradients in pinned host memory (and, unless the optimizer is kDeviceStateAdamW, AdamW's
  /// state, which then steps on the host).
  PlanOptions& offload(bool v) {
    offload_ = v;
    return *this;
  }
  /// kCpu (default): one memory; kCuda: GPU and host apart.
  PlanOptions& device(Device v) {
    device_ = v;
    return *this;
  }
  /// The optimizer whose state is planned (AdamW's two moments for each).
  PlanOptions& optimizer(Optimizer v) {
    optimizer_ = v;
    return *this;
  }
  /// Micro-batches per optimizer step (gradient accumulation).
  PlanOptions& micro_batches(int64_t v) {
    micro_batches_ = v;
    return *this;
  }
  /// Ranks on one machine (0, the default: the whole world): HSDP's default replicas and the cores
  /// the ranks share.
  PlanOptions& local_world(int v) {
    local_world_ = v;
    return *this;
  }
  /// The process-group backend whose rates and scratch are planned.
  PlanOptions& backend(Backend v) {
    backend_ = v;
    return *this;
  }
  /// How the ranks' threads are set: one per rank when several share a machine (fsdprun sets
  /// OMP_NUM_THREADS and OPENBLAS_NUM_THREADS to 1), the libraries' own choice for a rank alone.
  PlanOptions& threads(Threads v) {
    threads_ = v;
    return *this;
  }
  /// A checkpoint saved in the background (fsdp::CheckpointManager::save_async) holds a staged copy
  /// of this rank's parameters and optimizer state until the step after it: plan that step too.
  PlanOptions& background_checkpoints(bool v) {
    background_checkpoints_ = v;
    return *this;
  }
  /// The plan of an evaluation (`fsdp-train eval`) instead of a training step: forward passes
  /// without grad over the sharded model, no gradients, no optimizer state. A stage's high point
  /// is its no-grad forward's (a checkpointed stage's forward_extra_bytes; of any other stage its
  /// saved and forward_extra bytes together, an upper bound), only the last stage's output is kept,
  /// and the root keeps its gathered parameters from its first use on. No step time is modelled
  /// and no collective is listed.
  PlanOptions& evaluation(bool v) {
    evaluation_ = v;
    return *this;
  }
  /// The measured rates (default: measured_constants(), the library's built-in ones).
  PlanOptions& constants(Constants v) {
    constants_ = std::move(v);
    return *this;
  }
  /** @{ */
  /// The options as set, which plan() reads (set them with the setters above).
  int world_ = 1, replicate_ = 1, local_world_ = 0;
  bool no_shard_ = false, reshard_after_forward_ = true, offload_ = false, background_checkpoints_ = false,
       evaluation_ = false;
  Backend backend_ = Backend::kGloo;
  Device device_ = Device::kCpu;
  Threads threads_ = Threads::kAsLaunched;
  Dtype param_dtype_ = Dtype::kFloat32, reduce_dtype_ = Dtype::kFloat32;
  Optimizer optimizer_ = Optimizer::kAdamW;
  int64_t micro_batches_ = 1;
  Constants constants_ = measured_constants();
  /** @} */
};

/// Bytes of one dtype.
struct DtypeBytes {
  Dtype dtype;    ///< the dtype
  int64_t bytes;  ///< the bytes of it
};
/// A tensor (or a set of them) alive at the peak.
struct Buffer {
  std::string module;  ///< group or stage name ("" = root)
  std::string what;    ///< "sharded params", "all-gather buffer (prefetch)", "activations", ...
  int64_t bytes;       ///< its size
};
/// The collectives of one kind that one group issues per optimizer step.
struct Collectives {
  std::string group;  ///< the module ("" = root)
  std::string kind;   ///< all_gather | reduce_scatter | all_reduce
  std::string mesh;   ///< shard | replicate | world | tp
  int64_t count = 0;  ///< per optimizer step
  int64_t bytes = 0;  ///< per step: the full (gathered / unreduced) buffers, summed
};

/// Where the sharded state of a rank lives: the compute device's memory (the host's on device
/// cpu), or host memory apart from the GPU (device cuda under offload).
enum class Memory { kDevice, kHost };

/// The plan of one rank (`fsdp-train plan` prints ranks whose plans are equal together).
struct RankPlan {
  int rank = 0;  ///< the rank this plan is for
  /** @{ */
  /// The sharded parameters, gradients and optimizer state, by dtype.
  std::vector<DtypeBytes> params, grads, optimizer_state;
  /** @} */
  /** @{ */
  /// Where each of them lives.
  Memory params_in = Memory::kDevice, grads_in = Memory::kDevice, optimizer_state_in = Memory::kDevice;
  /** @} */
  int64_t activation_bytes = 0;  ///< saved activations at the end of the last forward
  /// The compute device's peak: the one memory's on device cpu, the GPU's on device cuda.
  int64_t peak_tensor_bytes = 0;
  std::string peak_at;          ///< where in the step the peak is
  std::vector<Buffer> at_peak;  ///< everything alive at the peak
  /** @{ */
  /// Device cuda only: the host's tensors, apart (0 and empty on device cpu): its peak, where in
  /// the step it is, and what is alive then.
  int64_t host_peak_tensor_bytes = 0;
  std::string host_peak_at;
  std::vector<Buffer> host_at_peak;
  /** @} */
  /** @{ */
  /// A background checkpoint's staged copy (parameters and optimizer state, in host memory: on
  /// cuda, pinned), and the peaks of the step after a background save, which it is alive through
  /// (= the peaks without background_checkpoints).
  int64_t checkpoint_staging_bytes = 0;
  int64_t peak_tensor_bytes_after_save = 0;
  /** @} */
  int64_t host_peak_tensor_bytes_after_save = 0;  ///< device cuda only
  /// Runtime + the larger peak, with the block cache's overhead. Device cpu only: 0 on cuda, whose
  /// runtime's host memory (the CUDA context, NCCL) has not been measured.
  int64_t peak_rss_bytes = 0;
  std::vector<Collectives> collectives;  ///< per group and kind, per optimizer step
};

/// The plan of one optimizer step: each rank's memory and collectives, and the step time.
struct Plan {
  std::vector<RankPlan> ranks;  ///< one per rank, in rank order
  /// false on device cuda: the rates are CPU and Gloo measurements, so no GPU step time is
  /// predicted and the times below are 0.
  bool step_time_modeled = true;
  double step_time_s = 0;  ///< the predicted time of one optimizer step, in seconds
  /** @{ */
  /// Its parts, which add up to it: compute, communication, the optimizer, and the per-stage
  /// overheads.
  double compute_s = 0, communication_s = 0, optimizer_s = 0, overhead_s = 0;
  /** @} */
  std::string constants_source;  ///< Constants::source of the rates used
};

/// The plan of one optimizer step of `model` (in steady state: the optimizer state exists).
/// Throws std::invalid_argument naming the option for an impossible combination (among them
/// kDeviceStateAdamW without device cuda and offload, and no_shard on device cuda, which the
/// trainer does not run).
Plan plan(const ModelSpec& model, const PlanOptions& options);

}  // namespace plan
}  // namespace fsdp
