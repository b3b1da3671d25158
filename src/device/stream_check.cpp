// The CPU device's checking mode (stream_check.h): a model of streams and events with vector
// clocks, the wrapped CPU allocator, the dispatcher's fallback that checks every operator, and
// the CPU DeviceOps that run everything at once on the host while telling the model.
//
// The model: each logical stream (the host is stream 0, the default "compute" stream 1, side
// streams and collective streams after) has a vector clock. Work queued on a stream first takes
// in the host's clock (the host queued it after everything it did before), then ticks. An event
// is a copy of its stream's clock; a wait joins it into the waiter's, a synchronize into the
// host's. Each block of memory keeps its last write and the reads since: an access by stream S
// is ordered after a stamp (T, t) when S == T or S's clock has seen tick t of T.
#include "src/device/stream_check.h"

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/native/Resize.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/StorageImpl.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <vector>

namespace fsdp {
namespace device {
namespace stream_check {
namespace {

constexpr int kHost = 0;
constexpr int kCompute = 1;
constexpr c10::DispatchKey kCheckKey = c10::DispatchKey::TESTING_ONLY_GenericMode;

using Clock = std::vector<uint64_t>;

uint64_t at_slot(const Clock& c, int slot) { return static_cast<size_t>(slot) < c.size() ? c[slot] : 0; }

void join(Clock& into, const Clock& from) {
  if (into.size() < from.size()) into.resize(from.size(), 0);
  for (size_t i = 0; i < from.size(); ++i) into[i] = std::max(into[i], from[i]);
}

// One access: by which stream, at which of its ticks, by which operation.
struct Stamp {
  int slot = -1;  // -1: none
  uint64_t tick = 0;
  std::string op;
};

// One allocation of the wrapped CPU allocator.
struct Block {
  size_t size = 0;
  int alloc_slot = -1;  // -1: allocated off the checked threads, never checked when freed
  bool host = false;    // host memory (CPU offload); otherwise the "device"'s
  bool pinned = false;
  std::string label;
  std::string alloc_op;
  Stamp write;
  std::vector<Stamp> reads;  // since the last write
};

// The calling thread's place in the model.
thread_local int t_slot = kCompute;   // its current stream
thread_local bool t_checked = false;  // the dispatcher's fallback runs on this thread
thread_local int t_domain = 0;        // allocations: 0 as the operation goes, 1 host, 2 device
thread_local bool t_pinned = false;   // with t_domain 1: pinned host memory
thread_local const char* t_op = "";   // the operator running, for the names of new blocks

bool read_enabled() {
  const char* v = std::getenv("FSDP_DEVICE_CHECK");
  return v != nullptr && std::string(v) == "1";
}

const bool g_enabled = read_enabled();

class Model {
 public:
  int new_stream(const std::string& name, bool collective) {
    std::lock_guard<std::mutex> lock(mu_);
    return add_stream(name, collective);
  }
  void name_stream(int slot, const std::string& name) {
    std::lock_guard<std::mutex> lock(mu_);
    if (slot >= 0 && static_cast<size_t>(slot) < names_.size()) names_[slot] = name;
  }
  int group_stream(const std::string& group) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = group_slots_.find(group);
    if (it != group_slots_.end()) return it->second;
    const int slot = add_stream("the collective stream of group '" + group + "'", true);
    group_slots_[group] = slot;
    return slot;
  }

  std::shared_ptr<Clock> record(int slot) {
    std::lock_guard<std::mutex> lock(mu_);
    queue_on(slot);
    return std::make_shared<Clock>(clocks_[slot]);
  }
  void wait(int slot, const Clock& event) {
    std::lock_guard<std::mutex> lock(mu_);
    join(clocks_[slot], event);
  }
  void host_waits_for(int slot) {
    std::lock_guard<std::mutex> lock(mu_);
    join(clocks_[kHost], clocks_[slot]);
  }

  void on_alloc(void* data, size_t size) {
    std::lock_guard<std::mutex> lock(mu_);
    Block b;
    b.size = size;
    b.host = t_domain == 1;
    b.pinned = t_domain == 1 && t_pinned;
    b.alloc_op = t_op;
    if (t_checked) {
      b.alloc_slot = b.host ? kHost : t_slot;
      check_reuse(b.alloc_slot, t_op);
      queue_on(b.alloc_slot);
      b.write = Stamp{b.alloc_slot, clocks_[b.alloc_slot][b.alloc_slot], std::string("the allocation (") + t_op + ")"};
    }
    blocks_[reinterpret_cast<uintptr_t>(data)] = std::move(b);
  }
  void on_free(void* data) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = blocks_.find(reinterpret_cast<uintptr_t>(data));
    if (it == blocks_.end()) return;
    check_free(it->second);
    blocks_.erase(it);
  }

  void label(const void* data, const std::string& role) {
    std::lock_guard<std::mutex> lock(mu_);
    Block* b = find(data);
    if (b != nullptr) b->label = role;
  }
  std::string describe(const void* data) {
    std::lock_guard<std::mutex> lock(mu_);
    Block* b = find(data);
    return b == nullptr ? std::string("untracked memory") : describe(*b);
  }
  std::optional<bool> is_host(const void* data) {
    std::lock_guard<std::mutex> lock(mu_);
    Block* b = find(data);
    return b == nullptr ? std::nullopt : std::optional<bool>(b->host);
  }
  bool is_pageable_host(const void* data) {
    std::lock_guard<std::mutex> lock(mu_);
    Block* b = find(data);
    return b != nullptr && b->host && !b->pinned;
  }

  // One operation on `slot`: ticks it, then checks and stamps each access.
  struct Access {
    const void* data;
    bool write;
  };
  void operation(int slot, const std::string& op, const std::vector<Access>& accesses) {
    std::lock_guard<std::mutex> lock(mu_);
    queue_on(slot);
    for (const Access& a : accesses) {
      Block* b = find(a.data);
      if (b != nullptr) access(*b, slot, op, a.write);
    }
  }

  void report(const std::string& message) {
    std::lock_guard<std::mutex> lock(mu_);
    add_report(message);
  }
  std::vector<std::string> reports() {
    std::lock_guard<std::mutex> lock(mu_);
    return reports_;
  }
  void clear_reports() {
    std::lock_guard<std::mutex> lock(mu_);
    reports_.clear();
    seen_.clear();
  }
  std::string stream_name(int slot) {
    std::lock_guard<std::mutex> lock(mu_);
    return name_of(slot);
  }

 private:
  int add_stream(const std::string& name, bool collective) {
    clocks_.emplace_back();
    names_.push_back(name);
    collective_.push_back(collective);
    return static_cast<int>(clocks_.size()) - 1;
  }
  void queue_on(int slot) {
    Clock& c = clocks_[slot];
    if (slot != kHost) join(c, clocks_[kHost]);
    if (c.size() <= static_cast<size_t>(slot)) c.resize(slot + 1, 0);
    ++c[slot];
  }
  bool ordered(int slot, const Stamp& s) const {
    return s.slot < 0 || s.slot == slot || at_slot(clocks_[slot], s.slot) >= s.tick;
  }
  Block* find(const void* data) {
    const auto p = reinterpret_cast<uintptr_t>(data);
    auto it = blocks_.upper_bound(p);
    if (it == blocks_.begin()) return nullptr;
    --it;
    return p < it->first + std::max<size_t>(it->second.size, 1) ? &it->second : nullptr;
  }

  void access(Block& b, int slot, const std::string& op, bool write) {
    if (!ordered(slot, b.write)) add_report(unordered(b, slot, op, write ? "writes" : "reads", b.write, "wrote"));
    if (!write) {
      b.reads.push_back(Stamp{slot, clocks_[slot][slot], op});
      return;
    }
    for (const Stamp& r : b.reads) {
      if (!ordered(slot, r)) add_report(unordered(b, slot, op, "writes", r, "may still be reading"));
    }
    b.reads.clear();
    b.write = Stamp{slot, clocks_[slot][slot], op};
  }

  // The caching allocator hands a freed block to the next allocation on the stream it was
  // allocated on: before that allocation, the stream must have waited for every other stream's
  // work on the block. A free keeps the uses not yet ordered so, and the stream's next
  // allocation checks them. Collectives are exempt (c10d keeps their tensors until their stream
  // is done), and so is host memory (its allocator records events for the copies that use it).
  struct PendingFree {
    std::string what;
    std::vector<Stamp> uses;
  };
  void check_free(const Block& b) {
    if (b.alloc_slot < 0 || b.host) return;
    std::vector<Stamp> uses = b.reads;
    uses.push_back(b.write);
    PendingFree pending{describe(b), {}};
    for (const Stamp& u : uses) {
      if (u.slot < 0 || u.slot == b.alloc_slot || collective_[u.slot] || ordered(b.alloc_slot, u)) continue;
      pending.uses.push_back(u);
    }
    if (pending.uses.empty()) return;
    if (pending_frees_.size() <= static_cast<size_t>(b.alloc_slot)) pending_frees_.resize(b.alloc_slot + 1);
    pending_frees_[b.alloc_slot].push_back(std::move(pending));
  }
  void check_reuse(int slot, const char* allocation) {
    if (static_cast<size_t>(slot) >= pending_frees_.size()) return;
    for (const PendingFree& f : pending_frees_[slot]) {
      for (const Stamp& u : f.uses) {
        if (ordered(slot, u)) continue;
        add_report(f.what + " was freed while " + u.op + " on " + name_of(u.slot) + " may still use it, and " +
                   name_of(slot) + ", where it was allocated, allocated again (" + allocation +
                   ") before waiting for an event recorded on " + name_of(u.slot) + " after " + u.op +
                   ": a GPU's caching allocator may hand it that block while " + u.op +
                   " still uses it. Keep the tensor referenced until " + name_of(slot) + " waited for such an event.");
      }
    }
    pending_frees_[slot].clear();
  }

  std::string unordered(const Block& b, int slot, const std::string& op, const char* verb, const Stamp& before,
                        const char* before_verb) {
    if (slot == kHost) {
      return "the host " + std::string(verb) + " " + describe(b) + " (" + op + ") which " + before.op + " on " +
             name_of(before.slot) + " " + before_verb +
             ", without synchronizing with it: on a GPU the host would get there before that work ran. "
             "Synchronize an event recorded on " +
             name_of(before.slot) + " after " + before.op + " first.";
    }
    return op + " on " + name_of(slot) + " " + verb + " " + describe(b) + " which " + before.op + " on " +
           name_of(before.slot) + " " + before_verb + ", and " + name_of(slot) +
           " did not wait for it: record an event on " + name_of(before.slot) + " after " + before.op + " and make " +
           name_of(slot) + " wait for it first.";
  }

  std::string describe(const Block& b) const {
    const std::string memory = b.host ? (b.pinned ? "pinned host memory" : "host memory") : "";
    if (!b.label.empty()) return (b.host ? memory + " " : std::string()) + "'" + b.label + "'";
    return "an unnamed block of " + std::to_string(b.size) + " bytes" + (b.host ? " of " + memory : std::string()) +
           " allocated by " + b.alloc_op + (b.alloc_slot >= 0 ? " on " + name_of(b.alloc_slot) : std::string());
  }
  std::string name_of(int slot) const {
    if (slot < 0 || static_cast<size_t>(slot) >= names_.size()) return "an unknown stream";
    return names_[slot];
  }

  void add_report(const std::string& message) {
    if (!seen_.insert(message).second) return;
    reports_.push_back(message);
    std::fprintf(stderr, "fsdp stream check: %s\n", message.c_str());
  }

  std::mutex mu_;
  std::vector<Clock> clocks_ = {Clock(1, 0), Clock(2, 0)};
  std::vector<std::string> names_ = {"the host", "the compute stream"};
  std::vector<bool> collective_ = {false, false};
  std::map<std::string, int> group_slots_;
  std::map<uintptr_t, Block> blocks_;
  std::vector<std::vector<PendingFree>> pending_frees_;  // per stream, until its next allocation
  std::vector<std::string> reports_;
  std::set<std::string> seen_;
};

Model& model() {
  static Model* m = new Model();  // never destroyed: frees come until the process ends
  return *m;
}

// Allocations made under it are host memory (pinned or not), or the device's.
class DomainScope {
 public:
  DomainScope(int domain, bool pinned) : domain_(t_domain), pinned_(t_pinned) {
    t_domain = domain;
    t_pinned = pinned;
  }
  ~DomainScope() {
    t_domain = domain_;
    t_pinned = pinned_;
  }
  DomainScope(const DomainScope&) = delete;
  DomainScope& operator=(const DomainScope&) = delete;

 private:
  int domain_;
  bool pinned_;
};

// ------------------------------------------------------------------------------ the allocator

// Its pointers are their own contexts (raw_allocate, which some kernels use for scratch space,
// needs that); the wrapped allocator's own pointers are held aside until their free.
class CheckingAllocator final : public c10::Allocator {
 public:
  explicit CheckingAllocator(c10::Allocator* base) : base_(base) {}

  c10::DataPtr allocate(size_t n) override {
    c10::DataPtr inner = base_->allocate(n);
    void* data = inner.get();
    if (data == nullptr) return inner;
    {
      std::lock_guard<std::mutex> lock(held_mu());
      held().emplace(data, std::move(inner));
    }
    model().on_alloc(data, n);
    return c10::DataPtr(data, data, &release, c10::Device(c10::DeviceType::CPU));
  }
  c10::DeleterFnPtr raw_deleter() const override { return &release; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    if (count > 0) std::memcpy(dest, src, count);
  }

 private:
  static std::mutex& held_mu() {
    static auto* mu = new std::mutex();
    return *mu;
  }
  static std::map<void*, c10::DataPtr>& held() {
    static auto* blocks = new std::map<void*, c10::DataPtr>();
    return *blocks;
  }
  static void release(void* data) {
    model().on_free(data);
    c10::DataPtr inner;
    {
      std::lock_guard<std::mutex> lock(held_mu());
      auto it = held().find(data);
      if (it == held().end()) return;
      inner = std::move(it->second);
      held().erase(it);
    }
  }
  c10::Allocator* base_;
};

// ------------------------------------------------------------------------------ the fallback

const void* data_of(const at::Tensor& t) {
  if (!t.defined() || !t.has_storage()) return nullptr;
  return t.storage().data();
}

struct TensorUse {
  at::Tensor tensor;
  bool write;
  bool touches_data = true;  // false: only its metadata is used (empty_like's input)
};

bool writes(const c10::AliasInfo* alias) {
  if (alias == nullptr) return false;
  if (alias->isWrite()) return true;
  for (const c10::AliasInfo& inner : alias->containedTypes()) {
    if (inner.isWrite()) return true;
  }
  return false;
}

void add_tensors(const c10::IValue& v, bool write, std::vector<TensorUse>& out) {
  if (v.isTensor()) {
    out.push_back({v.toTensor(), write});
  } else if (v.isTensorList()) {
    for (const at::Tensor& t : v.toTensorList()) out.push_back({t, write});
  } else if (v.isList()) {
    for (const c10::IValue& e : v.toListRef()) {
      if (e.isTensor()) out.push_back({e.toTensor(), write});
    }
  }
}

// The tensors an operator reads and writes: an argument annotated as written is written; one
// annotated as aliased only (a view's input) is neither; the rest are read.
std::vector<TensorUse> uses_of(const c10::FunctionSchema& schema, const torch::jit::Stack& stack) {
  std::vector<TensorUse> uses;
  const auto& args = schema.arguments();
  const size_t first = stack.size() - args.size();
  for (size_t i = 0; i < args.size(); ++i) {
    const c10::AliasInfo* alias = args[i].alias_info();
    const bool write = writes(alias);
    if (alias != nullptr && !write) continue;
    add_tensors(stack[first + i], write, uses);
  }
  return uses;
}

// Factories shaped like a tensor: they read its metadata, not its data.
bool reads_metadata_only(const std::string& name) {
  static const std::set<std::string> ops = {"aten::empty_like",   "aten::zeros_like", "aten::ones_like",
                                            "aten::full_like",    "aten::rand_like",  "aten::randn_like",
                                            "aten::randint_like", "aten::new_empty",  "aten::new_zeros",
                                            "aten::new_ones",     "aten::new_full",   "aten::new_empty_strided"};
  return ops.count(name) > 0;
}

// Operators that change a tensor's metadata only.
bool metadata_only(const std::string& name) {
  static const std::set<std::string> ops = {
      "aten::set_",        "aten::resize_",         "aten::resize_as_",    "aten::detach_",    "aten::requires_grad_",
      "aten::as_strided_", "aten::_resize_output_", "aten::record_stream", "aten::retain_grad"};
  return ops.count(name) > 0;
}

// Copies between host and device memory, which a stream runs (the others mixing them cannot).
bool is_copy(const std::string& name) {
  static const std::set<std::string> ops = {"aten::copy_", "aten::_copy_from", "aten::_copy_from_and_resize",
                                            "aten::_to_copy"};
  return ops.count(name) > 0;
}

// Operators whose result reaches the host from device memory: the host waits for the stream.
bool syncs_host(const std::string& name) {
  static const std::set<std::string> ops = {
      "aten::_local_scalar_dense", "aten::equal",    "aten::is_nonzero",         "aten::nonzero",
      "aten::masked_select",       "aten::_unique2", "aten::unique_consecutive", "aten::unique_dim"};
  return ops.count(name) > 0;
}

bool blocking_copy(const c10::FunctionSchema& schema, const torch::jit::Stack& stack) {
  const auto index = schema.argumentIndexWithName("non_blocking");
  if (!index) return true;
  const c10::IValue& v = stack[stack.size() - schema.arguments().size() + *index];
  return !(v.isBool() && v.toBool());
}

// Where an operator runs: on the host (all its memory is host memory) or on the current stream.
struct Placement {
  int slot = kCompute;
  bool host_op = false;
  bool host_waits = false;  // a blocking copy between host and device, or a result read back
};

Placement place(const std::string& name, const c10::FunctionSchema& schema, const torch::jit::Stack& stack,
                const std::vector<TensorUse>& uses) {
  bool any_host = false, any_device = false, any_pageable = false;
  const void* a_host = nullptr;
  const void* a_device = nullptr;
  for (const TensorUse& u : uses) {
    const void* data = data_of(u.tensor);
    if (data == nullptr) continue;
    const std::optional<bool> host = model().is_host(data);
    if (!host) continue;
    // A 0-dim host tensor is a scalar argument, which a CUDA kernel takes too.
    if (*host && u.tensor.dim() == 0 && !is_copy(name)) continue;
    (*host ? any_host : any_device) = true;
    (*host ? a_host : a_device) = data;
    any_pageable = any_pageable || model().is_pageable_host(data);
  }
  Placement p;
  p.slot = t_slot;
  // Inside to_host or to_device, the allocation's memory says where it is made.
  if (t_domain != 0) {
    p.host_op = t_domain == 1;
    if (p.host_op) p.slot = kHost;
    return p;
  }
  if (any_host && !any_device) {
    p.slot = kHost;
    p.host_op = true;
    return p;
  }
  if (any_host && any_device && !is_copy(name)) {
    model().report(name + " on " + model().stream_name(t_slot) + " mixes host memory (" + model().describe(a_host) +
                   ") with device memory (" + model().describe(a_device) +
                   "): on a GPU that is a device mismatch (a kernel cannot read host memory). Copy the host tensor "
                   "to the device first (CPU offload's shards are copied into a device buffer before they are "
                   "used).");
  }
  p.host_waits =
      (any_host && is_copy(name) && (blocking_copy(schema, stack) || any_pageable)) || (any_device && syncs_host(name));
  return p;
}

std::vector<TensorUse> fresh_results(const c10::FunctionSchema& schema, const torch::jit::Stack& stack) {
  std::vector<TensorUse> out;
  const auto& rets = schema.returns();
  const size_t first = stack.size() - rets.size();
  for (size_t i = 0; i < rets.size(); ++i) {
    if (rets[i].alias_info() == nullptr) add_tensors(stack[first + i], true, out);
  }
  return out;
}

std::vector<Model::Access> accesses_of(const std::vector<TensorUse>& uses) {
  std::vector<Model::Access> out;
  for (const TensorUse& u : uses) {
    const void* data = data_of(u.tensor);
    if (data != nullptr && u.touches_data) out.push_back({data, u.write});
  }
  return out;
}

void check_operator(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  const c10::DispatchKeySet below = keys & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, kCheckKey);
  const c10::FunctionSchema& schema = op.schema();
  const std::string& name = schema.name();
  // A composite operator is checked as the operators it is made of.
  if (!t_checked || metadata_only(name) || op.hasKernelForDispatchKey(c10::DispatchKey::CompositeImplicitAutograd)) {
    op.redispatchBoxed(below, stack);
    return;
  }
  std::vector<TensorUse> uses = uses_of(schema, *stack);
  if (reads_metadata_only(name)) {
    for (TensorUse& u : uses) u.touches_data = false;
  }
  const Placement p = place(name, schema, *stack, uses);
  model().operation(p.slot, name, accesses_of(uses));
  {
    const char* outer = t_op;
    t_op = name.c_str();
    std::optional<DomainScope> scope;
    if (p.host_op && t_domain == 0) scope.emplace(1, false);
    op.redispatchBoxed(below, stack);
    t_op = outer;
  }
  model().operation(p.slot, name, accesses_of(fresh_results(schema, *stack)));
  if (p.host_waits) model().host_waits_for(p.slot);
}

TORCH_LIBRARY_IMPL(_, TESTING_ONLY_GenericMode, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&check_operator>());
}

// ------------------------------------------------------------------------------ the DeviceOps

c10::Stream stream_of(int slot) {
  return c10::Stream(c10::Stream::UNSAFE, c10::Device(c10::DeviceType::CPU), static_cast<c10::StreamId>(slot));
}

int slot_of(c10::Stream s) { return static_cast<int>(s.id()); }

// The CPU's operations, run at once on the host, told to the model as a GPU would order them.
class CheckedCpuOps final : public DeviceOps {
 public:
  c10::DeviceType type() const override { return c10::DeviceType::CPU; }
  c10::Device current_device() override { return c10::Device(c10::DeviceType::CPU); }
  void set_current_device(c10::Device) override {}
  c10::Stream current_stream(c10::Device) override { return stream_of(t_slot); }
  c10::Stream side_stream(c10::Device, bool high_priority) override {
    static int made = 0;
    return stream_of(model().new_stream(
        "side stream #" + std::to_string(++made) + (high_priority ? " (high priority)" : ""), false));
  }
  c10::Stream exchange_stream(c10::Stream stream) override {
    const int previous = t_slot;
    t_slot = slot_of(stream);
    return stream_of(previous);
  }
  Event record(c10::Stream stream) override { return Event(model().record(slot_of(stream))); }
  void wait(c10::Stream waiter, const Event& event) override {
    if (!event.empty()) model().wait(slot_of(waiter), *static_cast<const Clock*>(event.impl()));
  }
  void synchronize(const Event& event) override {
    if (!event.empty()) model().wait(kHost, *static_cast<const Clock*>(event.impl()));
  }
  void copy_bytes(void* dst, const void* src, size_t nbytes) override {
    if (nbytes == 0) return;
    model().operation(t_slot, "a byte copy (DeviceOps::copy_bytes)", {{src, false}, {dst, true}});
    std::memcpy(dst, src, nbytes);
  }
  void zero_bytes(void* dst, size_t nbytes) override {
    if (nbytes == 0) return;
    model().operation(t_slot, "a zero fill (DeviceOps::zero_bytes)", {{dst, true}});
    std::memset(dst, 0, nbytes);
  }
  void resize_storage(c10::StorageImpl& storage, size_t nbytes) override {
    const char* outer = t_op;
    t_op = "DeviceOps::resize_storage";
    at::native::resize_bytes_cpu(&storage, nbytes);
    t_op = outer;
  }
  bool can_pin_host_memory() const override { return true; }
  bool has_streams() const override { return true; }
  bool shares_host_memory() const override { return false; }
  at::Tensor to_host(const at::Tensor& t, at::ScalarType dtype, bool pinned, bool non_blocking) override {
    at::Tensor out;
    {
      DomainScope scope(1, pinned);
      out = at::empty_like(t, t.options().dtype(dtype), at::MemoryFormat::Contiguous);
    }
    out.copy_(t, non_blocking);
    return out;
  }
  at::Tensor to_device(const at::Tensor& t, c10::Device, at::ScalarType dtype, bool non_blocking) override {
    const std::optional<bool> host = model().is_host(data_of(t));
    if (!host || !*host) return t.to(dtype);
    at::Tensor out;
    {
      DomainScope scope(2, false);
      out = at::empty_like(t, t.options().dtype(dtype), at::MemoryFormat::Contiguous);
    }
    out.copy_(t, non_blocking);
    return out;
  }
  at::Tensor empty_like_on(const at::Tensor& like, c10::Device) override {
    DomainScope scope(2, false);
    return at::empty_like(like);
  }
  int device_count() const override { return 1; }
  DeviceMemoryStats memory_stats(c10::Device) override { return DeviceMemoryStats{}; }
  void reset_peak_memory(c10::Device) override {}
};

void exit_with_reports() {
  const size_t n = model().reports().size();
  if (n == 0) return;
  std::fprintf(stderr, "fsdp stream check: %zu report(s) above; exiting with status %d\n", n, kReportsExitCode);
  std::fflush(stderr);
  std::_Exit(kReportsExitCode);
}

// At libfsdp's load: the allocator, the CPU's checked operations, and the fallback on this
// (the main) thread.
const bool installed = [] {
  if (!g_enabled) return false;
  static CheckingAllocator allocator(c10::GetCPUAllocator());
  c10::SetCPUAllocator(&allocator, /*priority=*/100);
  register_ops(std::make_unique<CheckedCpuOps>());
  c10::impl::tls_set_dispatch_key_included(kCheckKey, true);
  t_checked = true;
  std::atexit(exit_with_reports);
  std::fprintf(stderr,
               "fsdp stream check: on in this process (FSDP_DEVICE_CHECK=1): the CPU models a GPU's streams and "
               "every operator is checked for their order (slow; for tests)\n");
  return true;
}();

}  // namespace

bool enabled() { return g_enabled; }

void label(const at::Tensor& t, const std::string& role) {
  if (!g_enabled) return;
  const void* data = data_of(t);
  if (data != nullptr) model().label(data, role);
}

void label_stream(c10::Stream stream, const std::string& name) {
  if (g_enabled && stream.device_type() == c10::DeviceType::CPU) model().name_stream(slot_of(stream), name);
}

Event collective(const std::string& group, const char* op, const std::vector<at::Tensor>& reads,
                 const std::vector<at::Tensor>& writes) {
  if (!g_enabled) return Event();
  const int slot = model().group_stream(group);
  model().wait(slot, *model().record(t_slot));
  std::vector<Model::Access> accesses;
  for (const at::Tensor& t : reads) {
    if (data_of(t) != nullptr) accesses.push_back({data_of(t), false});
  }
  for (const at::Tensor& t : writes) {
    if (data_of(t) != nullptr) accesses.push_back({data_of(t), true});
  }
  model().operation(slot, std::string("the ") + op + " on group '" + group + "'", accesses);
  return Event(model().record(slot));
}

void wait_on_current_stream(const Event& event) {
  if (g_enabled && !event.empty()) model().wait(t_slot, *static_cast<const Clock*>(event.impl()));
}

std::vector<std::string> reports() { return g_enabled ? model().reports() : std::vector<std::string>(); }

void clear_reports() {
  if (g_enabled) model().clear_reports();
}

}  // namespace stream_check
}  // namespace device
}  // namespace fsdp
