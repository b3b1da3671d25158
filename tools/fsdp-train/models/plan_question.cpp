// plan_question.cpp — a TrainConfig as fsdp::plan's question (plan_question.h).
#include "models/plan_question.h"

#include "config/read_file.h"
#include "data/data.h"
#include "models/model_setup.h"

#include <cstdlib>
#include <cstring>
#include <fstream>
#include <stdexcept>

namespace fsdp {
namespace train {
namespace {

plan::Dtype dtype_of(Dtype d) {
  switch (d) {
    case Dtype::kFloat32: return plan::Dtype::kFloat32;
    case Dtype::kBFloat16: return plan::Dtype::kBFloat16;
    case Dtype::kFloat16: return plan::Dtype::kFloat16;
  }
  return plan::Dtype::kFloat32;
}

// A token file (data.path, or eval.path for `fsdp-train eval`) is read whole into an int64 tensor
// on every rank (data.cpp); its header, read by the data's own reader, says how many tokens.
double token_file_tensor_bytes(const std::string& path, const std::string& key) {
  try {
    return 8.0 * static_cast<double>(read_token_file_header(path, key).num_tokens);
  } catch (const std::runtime_error& e) {
    throw ConfigError(key + ": " + e.what() + " (the plan counts its tokens, which every rank keeps in memory)");
  }
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

}  // namespace

PlanQuestion plan_question(const TrainConfig& cfg, const ModelFamily& family, int64_t seq, int world, int local_world,
                           bool strict, const std::string& constants_file, bool evaluation) {
  const auto& f = cfg.fsdp_config;
  // What the trainer refuses (fp16 on cpu, the optimizer state offloaded alone on cuda, ...),
  // named. A plan for a GPU needs none here: it is checked as if this machine had one.
  DeviceSupport planned = device_support_for(cfg);
  if (f.device == "cuda") planned.cuda = true;
  check_supported(cfg, planned);
  const ModelShape shape = family.shape();
  check_model_parallel(cfg, world, shape.n_heads, shape.dim, shape.vocab_size);
  PlanQuestion q;
  const auto& t = cfg.training;
  q.sizes = family.plan_sizes();
  const int local = local_world > 0 ? local_world : world;
  q.sharding.tensor_parallel = f.model_parallel_size;
  q.sharding.vocab_parallel = f.vocab_parallel;
  q.sharding.output_head_group = f.output_head_group;
  q.mesh = data_parallel_shape(cfg, world, local);
  q.strategy = to_string(f.sharding_strategy);
  // The planner counts every parameter as trained, every layer as resharding fully and FSDP2's
  // implicit prefetch of one group.
  if (strict && f.prefetch_depth > 1)
    throw ConfigError("fsdp-train plan does not model fsdp_config.prefetch_depth: " + std::to_string(f.prefetch_depth) +
                      " (more groups gathered ahead) yet; plan with prefetch_depth: 1, FSDP2's implicit prefetch");
  if (strict && f.reduce_scatter_max_input_buffers > 1)
    throw ConfigError("fsdp-train plan does not model fsdp_config.reduce_scatter_max_input_buffers: " +
                      std::to_string(f.reduce_scatter_max_input_buffers) +
                      " (more unsharded gradients waiting for the link) yet; plan with 1, FSDP2's");
  if (strict && f.reshard_after_forward)
    throw ConfigError(
        "fsdp-train plan does not model fsdp_config.reshard_after_forward (a group size) yet; unset "
        "it to plan the strategy's full resharding");
  if (strict && !cfg.model.freeze.empty())
    throw ConfigError(
        "fsdp-train plan does not model model.freeze yet (frozen parameters have no gradient or "
        "optimizer state); leave it out to plan with every parameter trained, an upper bound");
  const Precision precision = precision_of(f);
  q.activations.micro_batch = t.micro_batch_size;
  q.activations.seq = seq;
  q.activations.compute = dtype_of(precision.param);
  q.activations.checkpoint_every = f.activation_checkpointing ? f.activation_checkpointing_every : 0;
  q.activations.loss_chunks = t.loss_chunks;
  if (evaluation) {
    // `fsdp-train eval` reads eval.path whole and no training data; every layer runs without
    // grad, which is what a checkpointed layer's first forward does: its high point is the one.
    if (cfg.eval.path.empty())
      throw ConfigError("fsdp-train plan --eval: eval.path is empty; `fsdp-train eval` evaluates its windows");
    q.resident_data_bytes = token_file_tensor_bytes(cfg.eval.path, "eval.path");
    q.activations.checkpoint_every = 1;
    q.options.evaluation(true);
  } else if (cfg.data.source == "tokens") {
    // The trainer's own check leaves a file it cannot count to the data's reader, which names
    // what is wrong with it: its tokens add nothing here.
    try {
      q.resident_data_bytes = token_file_tensor_bytes(cfg.data.path, "data.path");
    } catch (const ConfigError&) {
      if (strict) throw;
    }
  }
  // The tp ranks of one dp rank train on the same rows.
  q.activations.global_rows =
      static_cast<int64_t>(world / f.model_parallel_size) * t.gradient_accumulation_steps * t.micro_batch_size;
  const bool no_shard = f.sharding_strategy == ShardingStrategy::NO_SHARD;
  q.options.world(world)
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
  if (!constants_file.empty()) {
    const std::string& c = constants_file;
    const std::string text = read_file(c, {c + " is a directory", "cannot open " + c, "reading " + c + " failed"});
    try {
      q.options.constants(plan::constants_from_json(text));
    } catch (const std::invalid_argument& e) {
      throw ConfigError("--constants " + c + ": " + e.what());
    }
  }
  return q;
}

plan::ModelSpec model_spec_of(const ModelFamily& family, const PlanQuestion& q) {
  return family.plan_spec(q.sizes, q.activations, q.sharding);
}

plan::Plan plan_of(const ModelFamily& family, const PlanQuestion& q) {
  try {
    plan::ModelSpec model = model_spec_of(family, q);
    model.input_bytes += q.resident_data_bytes;
    return plan::plan(model, q.options);
  } catch (const std::invalid_argument& e) {
    throw ConfigError(e.what());
  }
}

int64_t parameter_count(const ModelFamily& family, const PlanQuestion& q) {
  PlanQuestion one = q;
  one.activations = plan::ActivationOptions{1, 1};
  int64_t n = 0;
  for (const auto& g : model_spec_of(family, one).groups)
    for (const auto& p : g.params) n += p.numel();
  return n;
}

}  // namespace train
}  // namespace fsdp
