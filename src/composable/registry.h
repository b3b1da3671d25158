// registry.h — which composable API manages a module and a parameter, and the state it keeps
// for them: the one place fully_shard, replicate and tensor parallelism meet, so that none of
// them includes another (PyTorch's _composable/contract.py keeps the same record on each module).
//
// A state is kept alive by the registry while any module it was registered for lives; entries
// of dead modules are dropped when the next API call registers, or when a lookup meets one
// (a dead module's address may be reused by a new module, so a lookup checks the module's
// identity, not only its address). Thread-safe; every call takes one mutex for a map lookup.
// Nothing here communicates or throws, except register_modules on a module that an API already
// manages (a programming error of the caller, which checks first to give its own message).
#pragma once

#include <fsdp/detail/call.h>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

namespace fsdp {
namespace composable {

// The APIs that manage modules. A module is managed by at most one of them.
enum class Api : uint8_t {
  kFullyShard,  // fsdp::fully_shard: FSDPState
  kReplicate,   // fsdp::replicate: the DDP reducer
};
const char* api_name(Api api);

// The role a registered tensor plays for its API.
enum class ParamRole : uint8_t {
  kSharded,     // fully_shard: the shard the module registers as its parameter
  kUnsharded,   // fully_shard: the full-size tensor its members compute with while unsharded
  kReplicated,  // replicate: a parameter whose gradient the reducer all-reduces
};

// What an API keeps for the modules of one call. The API's own state class derives from it.
class ModuleState {
 public:
  ModuleState();
  virtual ~ModuleState() = default;
  ModuleState(const ModuleState&) = delete;
  ModuleState& operator=(const ModuleState&) = delete;

  // Unique per process, never reused: autograd nodes hold it instead of the state, so that a
  // graph kept after its module is gone keeps nothing alive (find_state_by_id).
  int64_t id() const { return id_; }
  // The hooks fsdp::call runs around a forward of this state's modules, or null for none.
  virtual detail::ForwardHooks* forward_hooks() { return nullptr; }

 private:
  const int64_t id_;
};

struct ManagedModule {
  Api api;
  std::shared_ptr<ModuleState> state;
};

struct ManagedParameter {
  Api api;
  ParamRole role;
  std::shared_ptr<ModuleState> state;
  int64_t slot;  // the API's own index of the parameter in its state
};

struct ParameterRecord {
  at::Tensor tensor;
  ParamRole role;
  int64_t slot;
};

// Records `state` as `api`'s for each of `modules`. Entries of modules that no longer exist go
// now; their states are released after the registry's lock is dropped.
void register_modules(Api api, const std::vector<std::shared_ptr<torch::nn::Module>>& modules,
                      const std::shared_ptr<ModuleState>& state);
// Records the tensors of `state` (registered first with register_modules). An entry answers
// only while its state and the first of its modules live.
void register_parameters(const std::shared_ptr<ModuleState>& state, const std::vector<ParameterRecord>& params);

// The API managing `module` and its state, or nullopt.
std::optional<ManagedModule> managed_module(const torch::nn::Module& module);
// `api`'s state of `module`, or null when `module` is unmanaged or managed by another API.
std::shared_ptr<ModuleState> state_of(const torch::nn::Module& module, Api api);
// The state with this id if it still exists, with the API that registered it.
std::optional<ManagedModule> find_state_by_id(int64_t id);
// The record of a registered tensor (by identity), or nullopt.
std::optional<ManagedParameter> managed_parameter(const at::Tensor& tensor);

}  // namespace composable
}  // namespace fsdp
