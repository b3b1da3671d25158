// layer: optim (what may include what: docs/architecture.md)
/// \file
/// fsdp/fused_adamw.h — torch::optim::AdamW, with each step done in one multi-threaded,
/// vectorized pass over the memory of many parameters at once.
///
/// \code{.cpp}
///   #include <fsdp/fused_adamw.h>
///
///   for (auto& block : model->blocks()) fsdp::fully_shard(block);
///   fsdp::fully_shard(model);
///   fsdp::optim::FusedAdamW opt(model->parameters(),
///                               torch::optim::AdamWOptions(3e-4).weight_decay(0.1));
///   ...
///   loss.backward();
///   opt.step();   // one pass per fully_shard group; see last_step_stats()
/// \endcode
///
/// Same optimizer, same state. FusedAdamW IS a torch::optim::AdamW (it derives from it and
/// replaces only step()): the same constructors and AdamWOptions (lr, betas, eps, weight_decay,
/// amsgrad, per param group, read at every step, so changing a group's lr between steps works),
/// the same per-parameter AdamWParamState (step, exp_avg, exp_avg_sq, max_exp_avg_sq) under the
/// same state() keys, and AdamW's save()/load(). Everything that takes an AdamW takes it:
/// torch::save / torch::load, fsdp::sharded_optimizer_state_dict and its loader,
/// fsdp::init_optimizer_state, checkpoints. State written by either optimizer loads into the
/// other, and training continues as it would have: the arithmetic is AdamW's, in its order, each
/// operation rounded to the parameter's dtype, so a step differs from AdamW's by an ulp or two
/// (over 20 training steps of the tests' Transformer, at most 3e-7 in fp32).
///
/// What is fused. Each step, the parameters of a param group that have a gradient are grouped
/// into runs: parameters that are views into one storage (fully_shard makes each group's sharded
/// parameters views into one flat shard buffer) form one run; every other parameter is a run of
/// its own. A run is updated in ONE pass: one at::parallel_for over all its elements, which for
/// each element reads p, g, exp_avg, exp_avg_sq (and max_exp_avg_sq) once, writes p and the state
/// once, and allocates nothing (ATen's AdamW makes about nine passes and two temporaries per
/// parameter). The gradients and the state may live anywhere (a reduce-scatter output, separate
/// tensors after a checkpoint load); the state this class creates for a run is one flat buffer
/// per run, with each parameter's AdamWParamState tensors views into it. A parameter the fused
/// pass cannot take is updated with AdamW's own per-parameter ops, with identical results: one
/// whose dtype is not float or double (e.g. bf16), that is not a contiguous CPU tensor, or whose
/// gradient or state tensors are not contiguous, of another dtype or shape.
///
/// Threads and memory. A pass uses at::parallel_for, so ATen's intra-op thread pool
/// (at::get_num_threads(), OMP_NUM_THREADS; fsdprun sets 1 per rank); runs under 32768 elements
/// stay on the calling thread. On shards larger than the caches a pass is bound by memory
/// bandwidth (28 bytes per fp32 element), so more threads help only as far as the bandwidth
/// grows; bench/bench_optimizer.cpp measures both. step() blocks until every run is done, and
/// allocates only at a parameter's first step (its state: per run, one buffer per state tensor,
/// kept alive by the views in state()). Not collective: no communication, each rank updates its
/// own shards. Like AdamW, not safe to call concurrently with anything that reads or writes the
/// parameters, their gradients or this optimizer.
///
/// Where AdamW would fail and FusedAdamW does not: a parameter whose state lacks max_exp_avg_sq
/// while amsgrad is on (amsgrad switched on after the first step) gets a zero one. As in AdamW,
/// a parameter listed twice in a group is updated twice, in order.
#pragma once

#include <torch/optim/adamw.h>

#include <cstdint>

namespace fsdp {
namespace optim {

/// What the last step() did, for tests and benchmarks. Zeros before the first step.
struct FusedAdamWStepStats {
  int64_t fused_runs = 0;          ///< fused passes (at::parallel_for calls), summed over param groups
  int64_t fused_params = 0;        ///< parameters updated by those passes
  int64_t largest_run_params = 0;  ///< parameters in the largest run
  int64_t unfused_params = 0;      ///< parameters updated by AdamW's per-parameter ops instead
};

/// AdamW with one vectorized pass per run of parameters (see the file comment): AdamW's math,
/// options and checkpoints.
class FusedAdamW : public torch::optim::AdamW {
 public:
  /// AdamW's constructors: (`std::vector<OptimizerParamGroup>`, AdamWOptions) and
  /// (`std::vector<Tensor>`, AdamWOptions), with AdamW's checks of the options.
  using torch::optim::AdamW::AdamW;

  /// One AdamW step for every parameter with a gradient (parameters without one are skipped
  /// and keep their step count, as in AdamW). Creates a parameter's state at its first step.
  /// `closure`, when given, is called with grad mode on and its result returned, as in AdamW.
  torch::Tensor step(LossClosure closure = nullptr) override;

  /// What the last step() did (see FusedAdamWStepStats).
  const FusedAdamWStepStats& last_step_stats() const { return last_step_stats_; }

 private:
  void step_group(torch::optim::OptimizerParamGroup& group);

  FusedAdamWStepStats last_step_stats_;
};

}  // namespace optim
}  // namespace fsdp
