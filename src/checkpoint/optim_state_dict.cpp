// Optimizer state keyed by parameter FQN: reading LibTorch's Adam/AdamW/SGD state into the
// flattened layout of fsdp/optim_state_dict.h, and writing it back.
#include <fsdp/optim_state_dict.h>

#include "src/checkpoint/state_dict_pieces.h"
#include "src/util/compat.h"

#include <fsdp/fully_shard.h>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <map>
#include <set>
#include <unordered_map>

namespace fsdp {
namespace {

enum class Kind { kAdam, kAdamW, kSGD };

Kind kind_of(torch::optim::Optimizer& opt) {
  if (dynamic_cast<torch::optim::Adam*>(&opt)) return Kind::kAdam;
  if (dynamic_cast<torch::optim::AdamW*>(&opt)) return Kind::kAdamW;
  if (dynamic_cast<torch::optim::SGD*>(&opt)) return Kind::kSGD;
  TORCH_CHECK(false, "fsdp optimizer state dict: only torch::optim::Adam, AdamW and SGD are supported yet");
}

using Options = std::map<std::string, double>;

template <typename O>
Options adam_like_options(const O& o) {
  return {{"lr", o.lr()},   {"beta1", std::get<0>(o.betas())},  {"beta2", std::get<1>(o.betas())},
          {"eps", o.eps()}, {"weight_decay", o.weight_decay()}, {"amsgrad", o.amsgrad() ? 1.0 : 0.0}};
}

template <typename O>
void set_adam_like_options(O& o, const Options& v) {
  o.lr(v.at("lr")).betas(std::make_tuple(v.at("beta1"), v.at("beta2"))).eps(v.at("eps"));
  o.weight_decay(v.at("weight_decay")).amsgrad(v.at("amsgrad") != 0.0);
}

Options options_of(Kind kind, torch::optim::OptimizerOptions& o) {
  switch (kind) {
    case Kind::kAdam: return adam_like_options(static_cast<torch::optim::AdamOptions&>(o));
    case Kind::kAdamW: return adam_like_options(static_cast<torch::optim::AdamWOptions&>(o));
    case Kind::kSGD: {
      auto& s = static_cast<torch::optim::SGDOptions&>(o);
      return {{"lr", s.lr()},
              {"momentum", s.momentum()},
              {"dampening", s.dampening()},
              {"weight_decay", s.weight_decay()},
              {"nesterov", s.nesterov() ? 1.0 : 0.0}};
    }
  }
  return {};
}

void set_options(Kind kind, torch::optim::OptimizerOptions& o, const Options& v) {
  switch (kind) {
    case Kind::kAdam: set_adam_like_options(static_cast<torch::optim::AdamOptions&>(o), v); return;
    case Kind::kAdamW: set_adam_like_options(static_cast<torch::optim::AdamWOptions&>(o), v); return;
    case Kind::kSGD: {
      auto& s = static_cast<torch::optim::SGDOptions&>(o);
      s.lr(v.at("lr")).momentum(v.at("momentum")).dampening(v.at("dampening"));
      s.weight_decay(v.at("weight_decay")).nesterov(v.at("nesterov") != 0.0);
      return;
    }
  }
}

// The per-parameter state tensors an optimizer of `kind` keeps, by name (step is separate).
std::vector<std::string> tensor_state_names(Kind kind) {
  if (kind == Kind::kSGD) return {"momentum_buffer"};
  return {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"};
}

struct ParamRef {
  std::string fqn;
  at::Tensor param;
  bool sharded;
  std::vector<int64_t> global_shape;
  DeviceMesh mesh;                    // the parameter's (the model's for a parameter fully_shard left whole)
  std::vector<Placement> placements;  // over `mesh`: all Replicate() for a whole parameter
  torch::optim::OptimizerParamGroup* group;
};

std::vector<ParamRef> params_in_optimizer(torch::nn::Module& model, torch::optim::Optimizer& opt,
                                          const DeviceMesh& mesh) {
  std::unordered_map<const c10::TensorImpl*, torch::optim::OptimizerParamGroup*> group_of;
  for (auto& g : opt.param_groups()) {
    for (auto& p : g.params()) group_of[p.unsafeGetTensorImpl()] = &g;
  }
  std::vector<ParamRef> out;
  for (const auto& item : model.named_parameters()) {
    auto it = group_of.find(item.value().unsafeGetTensorImpl());
    if (it == group_of.end()) continue;
    const std::optional<DTensor> d = detail::parameter_layout(item.value());
    if (!d) {
      out.push_back({item.key(), item.value(), false, item.value().sizes().vec(), mesh,
                     std::vector<Placement>(mesh.ndim(), Replicate()), it->second});
      continue;
    }
    out.push_back({item.key(), item.value(), true, d->sizes(), d->device_mesh(), d->placements(), it->second});
  }
  return out;
}

DTensor replicated(const at::Tensor& t, const DeviceMesh& mesh) {
  return DTensor::from_local(t, mesh, std::vector<Placement>(mesh.ndim(), Replicate()));
}

DTensor like_param(const ParamRef& p, const at::Tensor& local) {
  return DTensor::from_local(local, p.mesh, p.placements, p.global_shape);
}

// The state tensors of one parameter, by name, read from LibTorch's state object.
std::map<std::string, at::Tensor> state_tensors(Kind kind, torch::optim::OptimizerParamState& st, int64_t* step) {
  std::map<std::string, at::Tensor> out;
  auto put = [&](const char* name, const at::Tensor& t) {
    if (t.defined()) out[name] = t;
  };
  if (kind == Kind::kSGD) {
    put("momentum_buffer", static_cast<torch::optim::SGDParamState&>(st).momentum_buffer());
    return out;
  }
  auto read = [&](auto& s) {
    *step = s.step();
    put("exp_avg", s.exp_avg());
    put("exp_avg_sq", s.exp_avg_sq());
    put("max_exp_avg_sq", s.max_exp_avg_sq());
  };
  if (kind == Kind::kAdam) read(static_cast<torch::optim::AdamParamState&>(st));
  if (kind == Kind::kAdamW) read(static_cast<torch::optim::AdamWParamState&>(st));
  return out;
}

std::unique_ptr<torch::optim::OptimizerParamState> make_state(Kind kind, int64_t step,
                                                              std::map<std::string, at::Tensor>& t) {
  if (kind == Kind::kSGD) {
    auto s = std::make_unique<torch::optim::SGDParamState>();
    s->momentum_buffer(t["momentum_buffer"]);
    return s;
  }
  auto fill = [&](auto s) {
    s->step(step);
    s->exp_avg(t["exp_avg"]);
    s->exp_avg_sq(t["exp_avg_sq"]);
    if (t.count("max_exp_avg_sq")) s->max_exp_avg_sq(t["max_exp_avg_sq"]);
    return s;
  };
  if (kind == Kind::kAdam) return fill(std::make_unique<torch::optim::AdamParamState>());
  return fill(std::make_unique<torch::optim::AdamWParamState>());
}

}  // namespace

ShardedStateDict sharded_optimizer_state_dict(torch::nn::Module& model, torch::optim::Optimizer& optimizer) {
  const Kind kind = kind_of(optimizer);
  const DeviceMesh mesh = detail::model_mesh(model);
  ShardedStateDict out;
  auto& states = optimizer.state();
  for (const ParamRef& p : params_in_optimizer(model, optimizer, mesh)) {
    for (const auto& opt : options_of(kind, p.group->options())) {
      out.insert("param_groups." + p.fqn + "." + opt.first,
                 replicated(at::scalar_tensor(opt.second, at::kDouble), mesh));
    }
    auto it = states.find(compat::optimizer_state_key(states, p.param.unsafeGetTensorImpl()));
    if (it == states.end()) continue;
    int64_t step = -1;
    for (const auto& t : state_tensors(kind, *it->second, &step)) {
      out.insert("state." + p.fqn + "." + t.first, like_param(p, t.second));
    }
    if (step >= 0) out.insert("state." + p.fqn + ".step", replicated(at::scalar_tensor(step, at::kLong), mesh));
  }
  return out;
}

void load_sharded_optimizer_state_dict(torch::nn::Module& model, torch::optim::Optimizer& optimizer,
                                       const ShardedStateDict& state_dict) {
  const Kind kind = kind_of(optimizer);
  const DeviceMesh mesh = detail::model_mesh(model);
  const std::vector<ParamRef> params = params_in_optimizer(model, optimizer, mesh);
  const char* what = "fsdp::load_sharded_optimizer_state_dict";

  // Check every key first.
  std::set<std::string> expected;
  for (const ParamRef& p : params) {
    for (const auto& opt : options_of(kind, p.group->options())) {
      const std::string key = "param_groups." + p.fqn + "." + opt.first;
      TORCH_CHECK(state_dict.find(key), what, ": missing key '", key, "'");
      expected.insert(key);
    }
    expected.insert("state." + p.fqn + ".step");
    for (const auto& name : tensor_state_names(kind)) {
      const std::string key = "state." + p.fqn + "." + name;
      expected.insert(key);
      if (const DTensor* d = state_dict.find(key)) {
        TORCH_CHECK(d->sizes() == p.global_shape, what, ": key '", key, "' has shape ", c10::IntArrayRef(d->sizes()),
                    " but parameter '", p.fqn, "' has ", c10::IntArrayRef(p.global_shape));
      }
    }
  }
  for (const auto& item : state_dict) {
    TORCH_CHECK(expected.count(item.key()), what, ": unexpected key '", item.key(),
                "' (no such parameter in this model and optimizer, or another optimizer's state)");
  }

  // Then the pieces (may gather), then the writes.
  struct Loaded {
    Options options;
    int64_t step = 0;
    std::map<std::string, at::Tensor> tensors;
  };
  std::vector<Loaded> loaded;
  for (const ParamRef& p : params) {
    Loaded l;
    for (const auto& opt : options_of(kind, p.group->options())) {
      l.options[opt.first] = state_dict.find("param_groups." + p.fqn + "." + opt.first)->to_local().item<double>();
    }
    if (const DTensor* step = state_dict.find("state." + p.fqn + ".step")) l.step = step->to_local().item<int64_t>();
    for (const auto& name : tensor_state_names(kind)) {
      if (const DTensor* d = state_dict.find("state." + p.fqn + "." + name)) {
        l.tensors[name] = detail::local_piece(*d, p.mesh, p.placements).clone(at::MemoryFormat::Contiguous);
      }
    }
    loaded.push_back(std::move(l));
  }
  auto& states = optimizer.state();
  for (size_t i = 0; i < params.size(); ++i) {
    set_options(kind, params[i].group->options(), loaded[i].options);
    const auto key = compat::optimizer_state_key(states, params[i].param.unsafeGetTensorImpl());
    if (loaded[i].tensors.empty()) {
      states.erase(key);
    } else {
      states[key] = make_state(kind, loaded[i].step, loaded[i].tensors);
    }
  }
}

void init_optimizer_state(torch::optim::Optimizer& optimizer) {
  kind_of(optimizer);  // rejects optimizers this file does not know
  std::vector<double> lrs;
  std::vector<at::Tensor> given_grad;
  for (auto& g : optimizer.param_groups()) {
    lrs.push_back(g.options().get_lr());
    g.options().set_lr(0.0);
    for (auto& p : g.params()) {
      if (p.grad().defined()) continue;
      p.mutable_grad() = at::zeros_like(p);
      given_grad.push_back(p);
    }
  }
  optimizer.step();
  for (size_t i = 0; i < lrs.size(); ++i) optimizer.param_groups()[i].options().set_lr(lrs[i]);
  for (auto& p : given_grad) p.mutable_grad().reset();
}

}  // namespace fsdp
