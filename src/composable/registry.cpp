// registry.cpp — the maps behind registry.h: module -> state (owning), state id -> state (weak),
// tensor -> (state id, role, slot).
#include "src/composable/registry.h"

#include <c10/util/Exception.h>

#include <atomic>
#include <mutex>
#include <unordered_map>

namespace fsdp {
namespace composable {
namespace {

std::atomic<int64_t> g_next_state_id{0};

struct Registry {
  std::mutex mu;
  struct ModuleEntry {
    std::weak_ptr<torch::nn::Module> module;
    Api api;
    std::shared_ptr<ModuleState> state;  // owned while the module lives
  };
  struct StateEntry {
    Api api;
    std::weak_ptr<ModuleState> state;
    std::weak_ptr<torch::nn::Module> first_module;
  };
  struct ParamEntry {
    int64_t state_id;
    ParamRole role;
    int64_t slot;
  };
  std::unordered_map<const torch::nn::Module*, ModuleEntry> by_module;
  std::unordered_map<int64_t, StateEntry> by_id;
  std::unordered_map<const c10::TensorImpl*, ParamEntry> by_tensor;

  // Entries of modules that no longer exist, and of states and tensors that went with them.
  // Returns the states to release after the lock (their destructors may call back in here).
  std::vector<std::shared_ptr<ModuleState>> drop_expired() {
    std::vector<std::shared_ptr<ModuleState>> dead;
    for (auto it = by_module.begin(); it != by_module.end();) {
      if (it->second.module.expired()) {
        dead.push_back(std::move(it->second.state));
        it = by_module.erase(it);
      } else {
        ++it;
      }
    }
    // A state outlives its modules while a handle (FSDPModule, ReplicatedModule) holds it, and
    // its autograd nodes may still find it by id; its tensors answer no more.
    for (auto it = by_id.begin(); it != by_id.end();) it = it->second.state.expired() ? by_id.erase(it) : std::next(it);
    for (auto it = by_tensor.begin(); it != by_tensor.end();) {
      it = live_state(it->second.state_id, /*with_module=*/true) ? std::next(it) : by_tensor.erase(it);
    }
    return dead;
  }

  // The entry of `id` if its state lives (and, with_module, the first of its modules), or null.
  const StateEntry* live_state(int64_t id, bool with_module) const {
    auto it = by_id.find(id);
    if (it == by_id.end() || it->second.state.expired()) return nullptr;
    if (with_module && it->second.first_module.expired()) return nullptr;
    return &it->second;
  }
};

Registry& registry() {
  static Registry* r = new Registry();  // never destroyed: hooks may run during static teardown
  return *r;
}

}  // namespace

const char* api_name(Api api) {
  switch (api) {
    case Api::kFullyShard: return "fully_shard";
    case Api::kReplicate: return "replicate";
  }
  return "?";
}

ModuleState::ModuleState() : id_(g_next_state_id++) {}

void register_modules(Api api, const std::vector<std::shared_ptr<torch::nn::Module>>& modules,
                      const std::shared_ptr<ModuleState>& state) {
  TORCH_CHECK(!modules.empty() && state, "composable::register_modules: no modules or no state");
  std::vector<std::shared_ptr<ModuleState>> dead;  // released after the lock
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  dead = r.drop_expired();
  for (const auto& m : modules) {
    auto it = r.by_module.find(m.get());
    TORCH_CHECK(it == r.by_module.end(), "composable::register_modules: this ", m->name(), " is already managed by ",
                api_name(it->second.api), "; ", api_name(api), " must check before registering");
  }
  for (const auto& m : modules) r.by_module[m.get()] = Registry::ModuleEntry{m, api, state};
  r.by_id[state->id()] = Registry::StateEntry{api, state, modules.front()};
}

void register_parameters(const std::shared_ptr<ModuleState>& state, const std::vector<ParameterRecord>& params) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  TORCH_CHECK(r.by_id.count(state->id()), "composable::register_parameters: register the state's modules first");
  for (const auto& p : params) {
    if (!p.tensor.defined()) continue;
    r.by_tensor[p.tensor.unsafeGetTensorImpl()] = Registry::ParamEntry{state->id(), p.role, p.slot};
  }
}

std::optional<ManagedModule> managed_module(const torch::nn::Module& module) {
  std::shared_ptr<ModuleState> stale;  // released after the lock
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  auto it = r.by_module.find(&module);
  if (it == r.by_module.end()) return std::nullopt;
  if (it->second.module.lock().get() != &module) {  // a dead module's address, reused
    stale = std::move(it->second.state);
    r.by_module.erase(it);
    return std::nullopt;
  }
  return ManagedModule{it->second.api, it->second.state};
}

std::shared_ptr<ModuleState> state_of(const torch::nn::Module& module, Api api) {
  auto managed = managed_module(module);
  return managed && managed->api == api ? managed->state : nullptr;
}

std::optional<ManagedModule> find_state_by_id(int64_t id) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  const Registry::StateEntry* entry = r.live_state(id, /*with_module=*/false);
  if (entry == nullptr) return std::nullopt;
  auto state = entry->state.lock();
  if (!state) return std::nullopt;
  return ManagedModule{entry->api, std::move(state)};
}

std::optional<ManagedParameter> managed_parameter(const at::Tensor& tensor) {
  if (!tensor.defined()) return std::nullopt;
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  auto it = r.by_tensor.find(tensor.unsafeGetTensorImpl());
  if (it == r.by_tensor.end()) return std::nullopt;
  const Registry::StateEntry* entry = r.live_state(it->second.state_id, /*with_module=*/true);
  auto state = entry ? entry->state.lock() : nullptr;
  if (!state) return std::nullopt;
  return ManagedParameter{entry->api, it->second.role, std::move(state), it->second.slot};
}

}  // namespace composable
}  // namespace fsdp
