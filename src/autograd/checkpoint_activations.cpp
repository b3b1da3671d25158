// checkpoint_activations.cpp — the autograd function behind fsdp::checkpoint
// (fsdp/checkpoint_activations.h): its forward runs the function under no-grad and keeps only
// the inputs and the generators' states (the CPU's and those of the inputs' GPUs); its backward recomputes with grad enabled and
// backpropagates through the recomputation. FSDP modules inside the function see the
// recomputation through the RecomputationScope it opens (recomputation.h); nothing here talks to FSDP
// or to a process group otherwise.
#include <fsdp/checkpoint_activations.h>

#include "src/autograd/recomputation.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/engine.h>

#include <algorithm>
#include <mutex>
#include <vector>

namespace fsdp {
namespace detail {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// One default generator's state: the CPU's, or a GPU's (reached through ATen's context, so this
// file needs no CUDA library: a build without the CUDA path never sees a GPU tensor).
struct GeneratorState {
  c10::Device device;
  at::Tensor state;
};

// What the backward needs besides the saved inputs. Held by the autograd context (as a capsule)
// until the graph is freed.
struct Recomputation : torch::CustomClassHolder {
  CheckpointedFunction function;
  bool preserve_rng_state = true;
  std::vector<GeneratorState> forward_rng_states;  // when the forward began (rng_states_for)
  std::vector<size_t> defined_positions;           // of the function's tensor arguments that are defined
  size_t num_arguments = 0;
  size_t num_outputs = 0;

  // The function's tensor arguments from the defined ones (undefined ones stay undefined).
  std::vector<at::Tensor> arguments(const variable_list& defined) const {
    std::vector<at::Tensor> args(num_arguments);
    for (size_t i = 0; i < defined.size(); ++i) args[defined_positions[i]] = defined[i];
    return args;
  }
};

at::Generator default_generator(c10::Device device) {
  return device.is_cpu() ? at::detail::getDefaultCPUGenerator() : at::globalContext().defaultGenerator(device);
}

at::Tensor rng_state(c10::Device device) {
  at::Generator gen = default_generator(device);
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get_state();
}

void set_rng_state(const GeneratorState& saved) {
  at::Generator gen = default_generator(saved.device);
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(saved.state);
}

// The generators a checkpointed function may draw from, as torch.utils.checkpoint saves them:
// the CPU's, and the default generator of every GPU an input lives on (dropout on a GPU draws
// from that GPU's generator).
std::vector<GeneratorState> rng_states_for(at::TensorList inputs) {
  const c10::Device cpu(c10::kCPU);
  std::vector<GeneratorState> states{{cpu, rng_state(cpu)}};
  for (const auto& t : inputs) {
    if (!t.defined() || t.device().is_cpu()) continue;
    auto same = [&](const GeneratorState& g) { return g.device == t.device(); };
    if (std::none_of(states.begin(), states.end(), same)) states.push_back({t.device(), rng_state(t.device())});
  }
  return states;
}

// For the recomputation's lifetime the generators are where they were when the forward began;
// then they are put back, so the program's random sequence is the one it would be without
// checkpointing.
class ForwardRngState {
 public:
  explicit ForwardRngState(const Recomputation& r) {
    if (!r.preserve_rng_state) return;
    for (const auto& saved : r.forward_rng_states) {
      current_.push_back({saved.device, rng_state(saved.device)});
      set_rng_state(saved);
    }
  }
  ~ForwardRngState() {
    for (const auto& state : current_) set_rng_state(state);
  }
  ForwardRngState(const ForwardRngState&) = delete;
  ForwardRngState& operator=(const ForwardRngState&) = delete;

 private:
  std::vector<GeneratorState> current_;
};

// Detached copies of the saved inputs, leaves that require grad where the inputs did: the
// recomputation's graph starts at them, and their .grad is what backward hands on.
variable_list detached_inputs(const variable_list& saved) {
  variable_list detached;
  detached.reserve(saved.size());
  for (const auto& t : saved) {
    at::Tensor d = t.detach();
    d.requires_grad_(t.requires_grad());
    detached.push_back(std::move(d));
  }
  return detached;
}

// Backpropagates the outer backward's gradients through the recomputed outputs. Outputs whose
// gradient did not arrive (unused outputs) are left out.
void backpropagate(const variable_list& outputs, const variable_list& grads) {
  variable_list roots, root_grads;
  bool any_requires_grad = false;
  for (size_t i = 0; i < outputs.size(); ++i) {
    if (!outputs[i].requires_grad()) continue;
    any_requires_grad = true;
    if (!grads[i].defined()) continue;
    roots.push_back(outputs[i]);
    root_grads.push_back(grads[i]);
  }
  TORCH_CHECK(any_requires_grad,
              "fsdp::checkpoint: none of the recomputed outputs requires grad, so there is "
              "nothing to backpropagate through; the checkpoint is not needed here");
  if (!roots.empty()) torch::autograd::backward(roots, root_grads);
}

struct CheckpointFunction : torch::autograd::Function<CheckpointFunction> {
  static variable_list forward(AutogradContext* ctx, at::TensorList inputs,
                               const c10::intrusive_ptr<Recomputation>& recomputation) {
    Recomputation& r = *recomputation;
    if (r.preserve_rng_state) r.forward_rng_states = rng_states_for(inputs);
    variable_list outputs = r.function(r.arguments(inputs.vec()));  // grad mode is off here
    for (size_t i = 0; i < outputs.size(); ++i) {
      TORCH_CHECK(outputs[i].defined(), "fsdp::checkpoint: output ", i,
                  " of the checkpointed function is an "
                  "undefined tensor; return defined tensors only");
    }
    r.num_outputs = outputs.size();
    ctx->save_for_backward(inputs.vec());
    ctx->saved_data["recomputation"] = at::IValue::make_capsule(recomputation);
    ctx->set_materialize_grads(false);  // unused outputs need no zeros
    return outputs;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    TORCH_CHECK(torch::autograd::Engine::get_default_engine().is_checkpoint_valid(),
                "fsdp::checkpoint: backward through a checkpoint must be a plain backward(); "
                "torch::autograd::grad() and backward with `inputs` are not supported, because the "
                "recomputation's backward accumulates into every leaf's .grad");
    auto recomputation =
        c10::static_intrusive_pointer_cast<Recomputation>(ctx->saved_data["recomputation"].toCapsule());
    const Recomputation& r = *recomputation;
    variable_list inputs = detached_inputs(ctx->get_saved_variables());
    {
      RecomputationScope scope;  // FSDP modules called now are recomputed, through the nested backward too
      variable_list outputs;
      {
        ForwardRngState rng(r);
        at::AutoGradMode enable_grad(true);
        outputs = r.function(r.arguments(inputs));
      }
      TORCH_CHECK(outputs.size() == r.num_outputs, "fsdp::checkpoint: the recomputation returned ", outputs.size(),
                  " tensors but the forward returned ", r.num_outputs,
                  "; a checkpointed function must compute "
                  "the same thing when it is called again");
      backpropagate(outputs, grads);
    }
    variable_list input_grads;
    input_grads.reserve(inputs.size() + 1);
    for (const auto& in : inputs) input_grads.push_back(in.requires_grad() ? in.grad() : at::Tensor());
    input_grads.emplace_back();  // no gradient for the recomputation argument
    return input_grads;
  }
};

}  // namespace

void check_checkpoint_options(const CheckpointOptions& options) {
  TORCH_CHECK(options.use_reentrant(),
              "fsdp::checkpoint: use_reentrant(false) is not supported yet: LibTorch 2.x's "
              "C++ API still has no default saved-tensor hooks (at::SavedTensorDefaultHooks takes Python callables, "
              "and only Python's autograd engine consults them), which non-reentrant checkpointing needs. Use "
              "fsdp::CheckpointOptions().use_reentrant(true), the default");
}

bool checkpoint_records_graph(const CheckpointOptions& options) {
  check_checkpoint_options(options);
  return at::GradMode::is_enabled();
}

std::vector<at::Tensor> run_checkpointed(const CheckpointOptions& options, CheckpointedFunction function,
                                         std::vector<at::Tensor> inputs) {
  auto recomputation = c10::make_intrusive<Recomputation>();
  recomputation->function = std::move(function);
  recomputation->preserve_rng_state = options.preserve_rng_state();
  recomputation->num_arguments = inputs.size();
  std::vector<at::Tensor> defined;
  bool any_requires_grad = false;
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (!inputs[i].defined()) continue;
    recomputation->defined_positions.push_back(i);
    defined.push_back(inputs[i]);
    any_requires_grad = any_requires_grad || inputs[i].requires_grad();
  }
  if (!any_requires_grad) {
    TORCH_WARN_ONCE(
        "fsdp::checkpoint: no tensor argument requires grad, so the outputs do not either and the "
        "parameters used inside get no gradient; pass an input that requires grad");
  }
  return CheckpointFunction::apply(at::TensorList(defined), recomputation);
}

}  // namespace detail
}  // namespace fsdp
