// Model state dicts: which tensor each key refers to, the checks made before any write, and
// PyTorch's file format (written by LibTorch's pickler, read by torch_load.h).
#include <fsdp/state_dict.h>

#include "src/checkpoint/checkpoint_metadata.h"
#include "src/checkpoint/checkpoint_write.h"
#include "src/checkpoint/state_dict_pieces.h"
#include "src/checkpoint/torch_load.h"

#include <fsdp/distributed.h>
#include <fsdp/dtensor_parameter.h>
#include <fsdp/fully_shard.h>
#include <fsdp/replicate.h>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <caffe2/serialize/inline_container.h>
#include <torch/csrc/jit/serialization/export.h>
#include <torch/csrc/jit/serialization/pickler.h>

#include <set>
#include <sstream>

namespace fsdp {
namespace {

// One key of the model: the live tensor a load writes into (a shard or a whole tensor).
struct Target {
  std::string key;
  at::Tensor live;
  bool sharded = false;
  std::vector<int64_t> global_shape;
  DeviceMesh mesh;
  std::vector<Placement> placements;  // of `live` over `mesh`: all Replicate() unless sharded
};

Target whole_target(const std::string& key, const at::Tensor& live, const DeviceMesh& mesh) {
  return Target{key, live, false, live.sizes().vec(), mesh, std::vector<Placement>(mesh.ndim(), Replicate())};
}

std::vector<Target> targets_of(torch::nn::Module& model) {
  const DeviceMesh mesh = detail::model_mesh(model);
  std::vector<Target> out;
  for (const auto& item : model.named_parameters()) {
    const std::optional<DTensor> d = detail::parameter_layout(item.value());
    if (!d) {
      out.push_back(whole_target(item.key(), item.value(), mesh));
      continue;
    }
    out.push_back(Target{item.key(), item.value(), true, d->sizes(), d->device_mesh(), d->placements()});
  }
  for (const auto& item : model.named_buffers()) out.push_back(whole_target(item.key(), item.value(), mesh));
  return out;
}

std::string shape_str(const std::vector<int64_t>& s) {
  std::ostringstream o;
  o << c10::IntArrayRef(s);
  return o.str();
}

// Checks keys, shapes and dtypes of every entry before anything is written.
template <typename Dict, typename ShapeOf, typename DtypeOf>
void check_entries(const std::vector<Target>& targets, const Dict& dict, bool strict, const char* what,
                   ShapeOf shape_of, DtypeOf dtype_of) {
  std::set<std::string> known;
  for (const auto& t : targets) {
    known.insert(t.key);
    const auto* value = dict.find(t.key);
    TORCH_CHECK(value || !strict, what, ": missing key '", t.key, "' (the model has it, the state dict does not)");
    if (!value) continue;
    TORCH_CHECK(shape_of(*value) == t.global_shape, what, ": key '", t.key, "' has shape ", shape_str(shape_of(*value)),
                " in the state dict but ", shape_str(t.global_shape), " in the model");
    TORCH_CHECK(dtype_of(*value) == t.live.scalar_type(), what, ": key '", t.key, "' has dtype ", dtype_of(*value),
                " in the state dict but ", t.live.scalar_type(), " in the model");
  }
  if (!strict) return;
  for (const auto& item : dict) {
    TORCH_CHECK(known.count(item.key()), what, ": unexpected key '", item.key(),
                "' (the model has no such parameter "
                "or buffer)");
  }
}

at::Tensor piece_of(const Target& t, const at::Tensor& full) {
  return detail::local_piece_of_full(full, t.mesh, t.placements);
}

void write_all(const std::vector<Target>& targets, const std::vector<at::Tensor>& pieces) {
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < targets.size(); ++i) {
    if (pieces[i].defined()) targets[i].live.copy_(pieces[i]);
  }
}

// ------------------------------------------------------------------ reading torch.save files

// The entries under which a bundle ({"model": ..., "optimizer": ..., "epoch": 3}) keeps the
// model's state dict.
constexpr const char* kBundleKeys[] = {"state_dict", "model_state_dict", "model"};

std::string keys_of(const detail::PyValue& dict) {
  std::string out;
  for (size_t i = 0; i < dict.items.size(); i += 2) {
    const detail::PyValue& k = *dict.items[i];
    const bool str = k.kind == detail::PyValue::Kind::kStr;
    out += (out.empty() ? "" : ", ") + (str ? "'" + k.text + "'" : detail::py_type_name(k));
    if (i >= 40) return out + ", ...";
  }
  return out.empty() ? "none" : out;
}

size_t tensor_values(const detail::PyValue& dict) {
  size_t n = 0;
  for (size_t i = 1; i < dict.items.size(); i += 2) n += dict.items[i]->kind == detail::PyValue::Kind::kTensor;
  return n;
}

// The model state dict in a file's top-level object: the object itself when it is a dict whose
// values are all tensors (or that holds a tensor at all: then a non-tensor value is an error
// naming its key); otherwise the one dict under "state_dict", "model_state_dict" or "model".
// `where` says which entry was taken, for messages.
const detail::PyValue& model_state_dict(const detail::PyValue& top, const std::string& path, std::string* where) {
  TORCH_CHECK(top.kind == detail::PyValue::Kind::kDict, "fsdp::load_pytorch_state_dict: '", path,
              "' holds a value of type ", detail::py_type_name(top), ", not a dict of name -> tensor");
  const size_t tensors = tensor_values(top);
  if (tensors == top.items.size() / 2) return top;
  std::vector<std::string> found;
  for (const char* key : kBundleKeys) {
    const detail::PyValue* v = detail::dict_find(top, key);
    if (v && v->kind == detail::PyValue::Kind::kDict) found.push_back(key);
  }
  if (found.size() > 1) {
    TORCH_CHECK(false, "fsdp::load_pytorch_state_dict: '", path, "' is ambiguous: it holds a dict under both '",
                found[0], "' and '", found[1], "'; its top-level keys are ", keys_of(top),
                ". Save the model's state dict alone, or under one of 'state_dict', 'model_state_dict', 'model'");
  }
  if (found.empty()) {
    TORCH_CHECK(tensors > 0, "fsdp::load_pytorch_state_dict: '", path,
                "' holds no model "
                "state dict: its top-level keys are ",
                keys_of(top),
                "; expected a dict of name -> tensor, or a "
                "bundle with it under 'state_dict', 'model_state_dict' or 'model'");
    return top;
  }
  *where = "entry '" + found[0] + "': ";
  return *detail::dict_find(top, found[0]);
}

// `dict` as name -> tensor. Every key must be a str and every value a tensor.
TensorStateDict tensors_of(const detail::PyValue& dict, const std::string& path, const std::string& where) {
  TensorStateDict out;
  for (size_t i = 0; i < dict.items.size(); i += 2) {
    const detail::PyValue& k = *dict.items[i];
    const detail::PyValue& v = *dict.items[i + 1];
    TORCH_CHECK(k.kind == detail::PyValue::Kind::kStr, "fsdp::load_pytorch_state_dict: '", path, "': ", where,
                "a key is of type ", detail::py_type_name(k), "; a state dict maps names (str) to tensors");
    TORCH_CHECK(v.kind == detail::PyValue::Kind::kTensor, "fsdp::load_pytorch_state_dict: '", path, "': ", where,
                "key '", k.text, "' holds a value of type ", detail::py_type_name(v), ", not a tensor");
    out.insert(k.text, v.tensor);
  }
  return out;
}

}  // namespace

namespace detail {

bool all_replicate(const std::vector<Placement>& placements) {
  for (const auto& p : placements) {
    if (!p.is_replicate()) return false;
  }
  return true;
}

DeviceMesh model_mesh(torch::nn::Module& model) {
  for (const auto& p : model.parameters()) {
    if (is_sharded_parameter(p)) return as_dtensor(p).device_mesh();
  }
  // A replicated model (or one with a replicated part): its entries are Replicate() over that mesh.
  if (is_replicated(model)) return get_replicated_module(model).mesh();
  for (const auto& m : model.modules(/*include_self=*/false)) {
    if (is_replicated(*m)) return get_replicated_module(*m).mesh();
  }
  // Tensor parallelism alone: the mesh its layers split the parameters over. Every other entry
  // is then whole on every rank of it, as the tp layers' inputs are.
  for (const auto& p : model.parameters()) {
    if (std::optional<DTensor> d = dtensor_parameter(p)) return d->device_mesh();
  }
  TORCH_CHECK(false,
              "fsdp state dict: the model has no parameter sharded by fully_shard or split by tensor "
              "parallelism and no module replicated by replicate; apply fsdp::fully_shard, fsdp::models::parallelize "
              "or fsdp::replicate first, or use the module's own named_parameters()/named_buffers()");
}

std::optional<DTensor> parameter_layout(const at::Tensor& param) {
  if (is_sharded_parameter(param)) return as_dtensor(param);
  return dtensor_parameter(param);
}

at::Tensor local_piece_of_full(const at::Tensor& full, const DeviceMesh& mesh,
                               const std::vector<Placement>& placements) {
  if (all_replicate(placements)) return full;
  const auto bounds = shard_bounds(full.sizes().vec(), mesh.shape(), mesh.coordinate(), placements);
  at::Tensor piece = full;
  for (int64_t d = 0; d < full.dim(); ++d) piece = piece.narrow(d, bounds[d].offset, bounds[d].length);
  return piece;
}

at::Tensor local_piece(const DTensor& value, const DeviceMesh& mesh, const std::vector<Placement>& placements) {
  const std::vector<Placement> stored = value.placements();
  if (value.device_mesh() == mesh && stored == placements) return value.to_local();
  if (all_replicate(stored)) return local_piece_of_full(value.to_local(), mesh, placements);
  return local_piece_of_full(value.full_tensor(), mesh, placements);
}

}  // namespace detail

ShardedStateDict sharded_state_dict(torch::nn::Module& model) {
  ShardedStateDict out;
  for (const auto& t : targets_of(model)) {
    out.insert(t.key,
               t.sharded ? *detail::parameter_layout(t.live) : DTensor::from_local(t.live, t.mesh, t.placements));
  }
  return out;
}

void load_sharded_state_dict(torch::nn::Module& model, const ShardedStateDict& state_dict, bool strict) {
  const std::vector<Target> targets = targets_of(model);
  check_entries(
      targets, state_dict, strict, "fsdp::load_sharded_state_dict", [](const DTensor& d) { return d.sizes(); },
      [](const DTensor& d) { return d.scalar_type(); });
  // Pieces first (gathering where layouts differ, in the same order on every rank), then writes.
  std::vector<at::Tensor> pieces;
  for (const auto& t : targets) {
    const DTensor* d = state_dict.find(t.key);
    if (!d) {
      pieces.emplace_back();
      continue;
    }
    pieces.push_back(detail::local_piece(*d, t.mesh, t.placements));
    TORCH_CHECK(pieces.back().sizes() == t.live.sizes(), "fsdp::load_sharded_state_dict: key '", t.key,
                "': this rank's piece has shape ", pieces.back().sizes(), " but its shard has ", t.live.sizes(),
                " (the DTensor's local tensor does not match its placements)");
  }
  write_all(targets, pieces);
}

void load_full_state_dict(torch::nn::Module& model, const TensorStateDict& state_dict, bool strict) {
  const std::vector<Target> targets = targets_of(model);
  check_entries(
      targets, state_dict, strict, "fsdp::load_full_state_dict", [](const at::Tensor& t) { return t.sizes().vec(); },
      [](const at::Tensor& t) { return t.scalar_type(); });
  std::vector<at::Tensor> pieces;
  for (const auto& t : targets) {
    const at::Tensor* v = state_dict.find(t.key);
    pieces.push_back(v ? piece_of(t, *v) : at::Tensor());
  }
  write_all(targets, pieces);
}

TensorStateDict full_state_dict(torch::nn::Module& model, const FullStateDictOptions& options) {
  const bool keep = !options.rank0_only() || get_rank() == 0;
  TensorStateDict out;
  for (const auto& item : sharded_state_dict(model)) {
    const DTensor& d = item.value();
    at::Tensor full = detail::all_replicate(d.placements()) ? d.to_local().detach().clone() : d.full_tensor().detach();
    if (options.cpu_offload()) full = full.cpu();
    if (keep) out.insert(item.key(), std::move(full));
  }
  return out;
}

namespace {

// What torch::jit::pickle_save writes (a zip archive: data.pkl and one data/<i> record per
// storage), except that the dict is pickled as a plain dict. pickle_save wraps every typed
// container in torch.jit._pickle.restore_type_tag, a global that torch.load refuses under
// weights_only=True, its default since PyTorch 2.6.
std::vector<char> torch_save_bytes(const c10::IValue& value) {
  std::vector<char> pickled;
  torch::jit::Pickler pickler([&](const char* p, size_t n) { pickled.insert(pickled.end(), p, p + n); },
                              /*tensor_table=*/nullptr, /*type_renamer=*/nullptr, /*memoized_class_types=*/nullptr,
                              /*get_tensor_id=*/nullptr, /*tag_aggregates=*/false);
  pickler.protocol();
  pickler.pushIValue(value);
  pickler.stop();
  std::vector<char> archive;
  caffe2::serialize::PyTorchStreamWriter writer([&](const void* p, size_t n) {
    const char* bytes = static_cast<const char*>(p);
    archive.insert(archive.end(), bytes, bytes + n);
    return n;
  });
  torch::jit::writeArchiveAndTensors("data", pickled.data(), pickled.size(), pickler.tensorData(), writer);
  writer.writeEndOfFile();
  return archive;
}

}  // namespace

void save_pytorch_state_dict(const TensorStateDict& state_dict, const std::string& path) {
  c10::Dict<std::string, at::Tensor> dict;
  for (const auto& item : state_dict) {
    // Host tensors: the file is the same whichever device trained, and loads anywhere.
    at::Tensor t = item.value().detach().cpu();
    // The pickler writes a tensor's whole storage: give views a storage of their own.
    if (!t.is_contiguous() || t.storage_offset() != 0 ||
        t.storage().nbytes() != static_cast<size_t>(t.numel()) * t.element_size()) {
      t = t.clone(at::MemoryFormat::Contiguous);
    }
    dict.insert(item.key(), t);
  }
  const std::vector<char> bytes = torch_save_bytes(c10::IValue(dict));
  // Under a temporary name, then renamed: a failed write leaves an earlier file at `path` whole.
  try {
    detail::write_file_durably(path, bytes.data(), bytes.size());
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, "fsdp::save_pytorch_state_dict: ", e.what_without_backtrace());
  }
}

namespace {

// The top-level entries of a bundle other than the state dict taken from it, as "'key' (type)".
std::vector<std::string> other_entries(const detail::PyValue& top, const detail::PyValue& taken) {
  std::vector<std::string> out;
  for (size_t i = 0; i + 1 < top.items.size(); i += 2) {
    if (top.items[i + 1].get() == &taken) continue;
    const detail::PyValue& k = *top.items[i];
    const std::string name = k.kind == detail::PyValue::Kind::kStr ? "'" + detail::printable(k.text) + "'"
                                                                   : "a key of type " + detail::py_type_name(k);
    out.push_back(name + " (" + detail::printable(detail::py_type_name(*top.items[i + 1])) + ")");
  }
  return out;
}

}  // namespace

TensorStateDict load_pytorch_state_dict(const std::string& path, std::vector<std::string>* ignored) {
  const std::shared_ptr<detail::PyValue> top = detail::torch_load(path);
  std::string where;
  const detail::PyValue& state_dict = model_state_dict(*top, path, &where);
  TensorStateDict out = tensors_of(state_dict, path, where);
  if (ignored && &state_dict != top.get()) *ignored = other_entries(*top, state_dict);
  return out;
}

}  // namespace fsdp
