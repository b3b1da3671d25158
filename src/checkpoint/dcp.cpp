// DCP checkpoints (fsdp/dcp.h): the mapping between fsdp-cpp's state dict layouts and DCP's
// flattened keys, the data files (a torch.save archive per tensor chunk or BYTE_IO value), and
// reading back only the chunks that overlap this rank's pieces. The .metadata pickle itself is
// dcp_metadata.cpp's.
#include <fsdp/dcp.h>

#include "src/checkpoint/checkpoint_write.h"
#include "src/checkpoint/dcp_metadata.h"
#include "src/checkpoint/torch_load.h"

#include <fsdp/distributed.h>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <caffe2/serialize/inline_container.h>
#include <nlohmann/json.hpp>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <set>

namespace fsdp {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using detail::DcpEntry;
using detail::DcpMetadata;
using detail::DcpStorage;
using detail::PickleWriter;
using detail::PyValue;

constexpr const char* kSave = "fsdp::save_dcp";
const std::string kLoad = "fsdp::load_dcp: ";

// The options of an Adam/AdamW param group in optim_state_dict.h's layout.
const std::vector<std::string> kAdamOptions = {"lr", "beta1", "beta2", "eps", "weight_decay", "amsgrad"};
const std::set<std::string> kAdamState = {"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"};

// "state.<fqn>.<name>" -> {fqn, name}; false when `key` does not start with `prefix`.
bool split_key(const std::string& key, const std::string& prefix, std::string* fqn, std::string* name) {
  if (key.rfind(prefix, 0) != 0) return false;
  const size_t dot = key.rfind('.');
  if (dot == std::string::npos || dot < prefix.size() + 1) return false;
  *fqn = key.substr(prefix.size(), dot - prefix.size());
  *name = key.substr(dot + 1);
  return true;
}

std::string data_file(int rank) { return "__" + std::to_string(rank) + "_0.distcp"; }

// ------------------------------------------------------------------ torch.save archives

// The archive's bytes go to `out` as the writer makes them.
void write_archive(const std::string& data_pkl, const at::Tensor* storage, const detail::AppendBytes& out) {
  caffe2::serialize::PyTorchStreamWriter writer([&](const void* p, size_t n) {
    out(static_cast<const char*>(p), n);
    return n;
  });
  writer.writeRecord("data.pkl", data_pkl.data(), data_pkl.size());
  writer.writeRecord("byteorder", "little", 6);
  if (storage) {
    writer.writeRecord("data/0", storage->data_ptr(), static_cast<size_t>(storage->numel() * storage->element_size()));
  }
  writer.writeEndOfFile();
}

std::string archive(const std::string& data_pkl, const at::Tensor* storage) {
  std::string out;
  write_archive(data_pkl, storage, [&](const char* p, size_t n) { out.append(p, n); });
  return out;
}

// Python's storage class of `dtype`, or nullptr when DCP cannot write it.
const char* storage_name_of(at::ScalarType dtype) {
  static const std::map<at::ScalarType, const char*> storage_names = {{at::kFloat, "FloatStorage"},
                                                                      {at::kDouble, "DoubleStorage"},
                                                                      {at::kHalf, "HalfStorage"},
                                                                      {at::kBFloat16, "BFloat16Storage"},
                                                                      {at::kLong, "LongStorage"},
                                                                      {at::kInt, "IntStorage"},
                                                                      {at::kShort, "ShortStorage"},
                                                                      {at::kChar, "CharStorage"},
                                                                      {at::kByte, "ByteStorage"},
                                                                      {at::kBool, "BoolStorage"},
                                                                      {at::kComplexFloat, "ComplexFloatStorage"},
                                                                      {at::kComplexDouble, "ComplexDoubleStorage"}};
  const auto name = storage_names.find(dtype);
  return name == storage_names.end() ? nullptr : name->second;
}

// The data.pkl of torch.save(t), t a contiguous CPU tensor: _rebuild_tensor_v2 over one storage,
// as Python writes.
std::string tensor_pickle(const at::Tensor& t) {
  const char* storage = storage_name_of(t.scalar_type());
  TORCH_CHECK(storage != nullptr, kSave, ": dtype ", t.scalar_type(), " cannot be written to a DCP checkpoint");
  PickleWriter w;
  w.global("torch._utils", "_rebuild_tensor_v2");
  w.mark();
  w.mark();  // the persistent id: ('storage', type, key, location, numel)
  w.str("storage");
  w.global("torch", storage);
  w.str("0");
  w.str("cpu");
  w.integer(t.numel());
  w.tuple();
  w.binpersid();
  w.integer(0);
  w.mark();
  for (int64_t s : t.sizes()) w.integer(s);
  w.tuple();
  w.mark();
  for (int64_t s : t.strides()) w.integer(s);
  w.tuple();
  w.boolean(false);
  w.global("collections", "OrderedDict");
  w.empty_tuple();
  w.reduce();
  w.tuple();
  w.reduce();
  w.stop();
  return w.out;
}

// torch.save of a plain value written by `fill`.
template <typename F>
std::string value_archive(F fill) {
  PickleWriter w;
  fill(w);
  w.stop();
  return archive(w.out, nullptr);
}

// ------------------------------------------------------------------ saving

// One param group: options and the parameters sharing them, in order.
struct Group {
  std::map<std::string, double> options;
  std::vector<std::string> fqns;
};

// The optimizer's groups and per-parameter state keys, checked to be Adam/AdamW's.
std::vector<Group> adam_groups(const ShardedStateDict& optimizer) {
  std::map<std::string, std::map<std::string, double>> options_of;
  std::vector<std::string> order;
  for (const auto& item : optimizer) {
    std::string fqn, name;
    if (split_key(item.key(), "param_groups.", &fqn, &name)) {
      TORCH_CHECK(std::find(kAdamOptions.begin(), kAdamOptions.end(), name) != kAdamOptions.end(), kSave,
                  ": optimizer key '", item.key(),
                  "' is no Adam/AdamW option: DCP checkpoints are written for "
                  "torch::optim::Adam and AdamW (and fsdp::optim::FusedAdamW) only");
      if (!options_of.count(fqn)) order.push_back(fqn);
      options_of[fqn][name] = item.value().to_local().item<double>();
    } else if (split_key(item.key(), "state.", &fqn, &name)) {
      TORCH_CHECK(kAdamState.count(name), kSave, ": optimizer key '", item.key(),
                  "' is no Adam/AdamW state: DCP "
                  "checkpoints are written for torch::optim::Adam and AdamW (and fsdp::optim::FusedAdamW) only");
    } else {
      TORCH_CHECK(false, kSave, ": optimizer key '", item.key(),
                  "' is neither state.<fqn>.<name> nor "
                  "param_groups.<fqn>.<option>: pass sharded_optimizer_state_dict()'s dict");
    }
  }
  std::vector<Group> groups;
  for (const std::string& fqn : order) {
    const auto& o = options_of[fqn];
    for (const std::string& name : kAdamOptions) {
      TORCH_CHECK(o.count(name), kSave, ": optimizer key 'param_groups.", fqn, ".", name, "' is missing");
    }
    auto same = std::find_if(groups.begin(), groups.end(), [&](const Group& g) { return g.options == o; });
    if (same == groups.end()) same = groups.insert(groups.end(), Group{o, {}});
    same->fqns.push_back(fqn);
  }
  for (const auto& item : optimizer) {
    std::string fqn, name;
    if (split_key(item.key(), "state.", &fqn, &name)) {
      TORCH_CHECK(options_of.count(fqn), kSave, ": optimizer key '", item.key(), "' has state but no param_groups.",
                  fqn, ".* options");
    }
  }
  return groups;
}

// What a rank writes and what rank 0 records of it. Items are planned first and written to the
// file one at a time (write()), each from the live tensor (a device's piece through its host
// copy, made as it is written): the data file is never assembled in memory, which at a real size
// would hold a second copy of the rank's parameters and optimizer state beside the live ones.
class DataFile {
 public:
  explicit DataFile(int rank) : name_(data_file(rank)) {}

  void tensor(const std::string& key, const DTensor& d, const at::Tensor& local) {
    if (!detail::writes_piece(d)) return;
    const bool empty_tensor = d.to_local().numel() == 0;
    int64_t global = 1;
    for (int64_t s : d.sizes()) global *= s;
    // An empty piece holds nothing, except when the whole tensor is empty: then rank 0 records it.
    if (empty_tensor && !(global == 0 && fsdp::world()->rank() == 0)) return;
    json c = {{"key", key}, {"offsets", json::array()}, {"sizes", json::array()}};
    for (const auto& b : d.local_bounds()) {
      c["offsets"].push_back(b.offset);
      c["sizes"].push_back(b.length);
    }
    add(c, local);
  }
  // A whole 0-dim tensor (rank 0 writes it).
  void scalar(const std::string& key, const at::Tensor& t) {
    add(json{{"key", key}, {"offsets", json::array()}, {"sizes", json::array()}}, t);
  }
  void value(const std::string& key, const std::string& bytes) {
    pending_.push_back({json{{"key", key}}, at::Tensor(), bytes});
  }
  // Writes every item to `path` (durably), recording where each one lies.
  void write(const fs::path& path) {
    items_ = json::array();
    detail::write_file_durably(path, [&](const detail::AppendBytes& append) {
      int64_t written = 0;
      const detail::AppendBytes counted = [&](const char* p, size_t n) {
        append(p, n);
        written += static_cast<int64_t>(n);
      };
      for (Pending& item : pending_) {
        const int64_t offset = written;
        if (item.tensor.defined()) {
          const at::Tensor host = item.tensor.to(at::kCPU).contiguous();  // a device's piece: its host copy
          write_archive(tensor_pickle(host), &host, counted);
        } else {
          counted(item.bytes.data(), item.bytes.size());
        }
        item.record["file"] = name_;
        item.record["offset"] = offset;
        item.record["length"] = written - offset;
        items_.push_back(std::move(item.record));
      }
    });
    pending_.clear();
  }
  json report() const { return items_; }

 private:
  struct Pending {
    json record;
    at::Tensor tensor;  // a tensor's item, or
    std::string bytes;  // a value's archive
  };
  void add(json item, const at::Tensor& t) {
    TORCH_CHECK(storage_name_of(t.scalar_type()) != nullptr, kSave, ": dtype ", t.scalar_type(),
                " cannot be written to a DCP checkpoint");
    pending_.push_back({std::move(item), t, std::string()});
  }
  std::string name_;
  std::vector<Pending> pending_;
  json items_ = json::array();
};

std::vector<DcpMetadata::PathPart> path_of(std::initializer_list<std::string> names) {
  std::vector<DcpMetadata::PathPart> out;
  for (const auto& n : names) out.push_back({n, -1});
  return out;
}

// Everything this rank writes; `meta` (rank 0's) gets every key's entry without its chunks.
void plan_save(const ShardedStateDict& model, const ShardedStateDict& optimizer, int64_t step,
               const DcpOptions& options, DataFile* file, DcpMetadata* meta) {
  const bool rank0 = fsdp::world()->rank() == 0;
  auto tensor_entry = [&](const std::string& key, std::vector<int64_t> shape, at::ScalarType dtype,
                          std::vector<DcpMetadata::PathPart> path) {
    DcpEntry e;
    e.dtype = dtype;
    detail::dcp_dtype_name(dtype);  // throws for a dtype DCP cannot name
    e.shape = std::move(shape);
    meta->entries[key] = e;
    meta->planner_paths[key] = std::move(path);
  };
  for (const auto& item : model) {
    const std::string key = "model." + item.key();
    tensor_entry(key, item.value().sizes(), item.value().scalar_type(), path_of({"model", item.key()}));
    file->tensor(key, item.value(), item.value().to_local());
  }
  const std::vector<Group> groups = adam_groups(optimizer);
  for (const auto& item : optimizer) {
    std::string fqn, name;
    if (!split_key(item.key(), "state.", &fqn, &name)) continue;
    const std::string key = "optimizer." + item.key();
    const DTensor& d = item.value();
    // Python's Adam/AdamW keep step as a float32 tensor; dcp.load needs that dtype's entry.
    const at::ScalarType dtype = name == "step" ? at::kFloat : d.scalar_type();
    tensor_entry(key, d.sizes(), dtype, path_of({"optimizer", "state", fqn, name}));
    file->tensor(key, d, d.to_local().to(dtype));
  }
  tensor_entry("train_state.step", {}, at::kLong, path_of({"train_state", "step"}));
  if (rank0) file->scalar("train_state.step", at::scalar_tensor(step, at::kLong));
  // The param groups: Python AdamW's keys, all of them (dcp.load requires every key its target has).
  for (size_t g = 0; g < groups.size(); ++g) {
    const auto& o = groups[g].options;
    auto value = [&](const std::string& option, const std::function<void(PickleWriter&)>& fill) {
      const std::string key = "optimizer.param_groups." + std::to_string(g) + "." + option;
      DcpEntry e;
      e.is_bytes = true;
      meta->entries[key] = e;
      meta->planner_paths[key] = {{"optimizer", -1}, {"param_groups", -1}, {"", static_cast<int64_t>(g)}, {option, -1}};
      if (rank0) file->value(key, value_archive(fill));
    };
    auto real = [&](double v) { return [v](PickleWriter& w) { w.real(v); }; };
    auto flag = [&](bool b) { return [b](PickleWriter& w) { w.boolean(b); }; };
    auto none = [](PickleWriter& w) { w.none(); };
    value("lr", real(o.at("lr")));
    value("betas", [&](PickleWriter& w) {
      w.mark();
      w.real(o.at("beta1"));
      w.real(o.at("beta2"));
      w.tuple();
    });
    value("eps", real(o.at("eps")));
    value("weight_decay", real(o.at("weight_decay")));
    value("amsgrad", flag(o.at("amsgrad") != 0.0));
    value("maximize", flag(false));
    value("foreach", none);
    value("capturable", flag(false));
    value("differentiable", flag(false));
    value("fused", none);
    value("decoupled_weight_decay", flag(options.adamw()));
    if (options.initial_lr()) value("initial_lr", real(*options.initial_lr()));
    value("params", [&](PickleWriter& w) {
      w.mark();
      for (const std::string& fqn : groups[g].fqns) w.str(fqn);
      w.list();
    });
  }
}

// The chunks and storage records every rank reported, into rank 0's metadata.
void add_reports(const std::vector<std::string>& reports, DcpMetadata* meta) {
  for (const std::string& r : reports) {
    const json items = json::parse(r);
    for (const json& item : items) {
      DcpEntry& e = meta->entries.at(item.at("key").get<std::string>());
      const DcpStorage s{item.at("file").get<std::string>(), item.at("offset").get<int64_t>(),
                         item.at("length").get<int64_t>()};
      if (e.is_bytes) {
        e.bytes = s;
        continue;
      }
      e.chunks.push_back(
          {item.at("offsets").get<std::vector<int64_t>>(), item.at("sizes").get<std::vector<int64_t>>(), s});
    }
  }
}

// An id for StorageMeta.save_id (DCP writes a uuid4; any unique text serves).
std::string save_id() {
  std::random_device rd;
  std::mt19937_64 gen(rd() ^ static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count()));
  char buf[40];
  std::snprintf(buf, sizeof buf, "%016llx%016llx", static_cast<unsigned long long>(gen()),
                static_cast<unsigned long long>(gen()));
  return buf;
}

// Our names in `dir`: .metadata, __<r>_<n>.distcp and their .tmp.
bool ours(const std::string& name) {
  std::string base = name;
  if (base.size() > 4 && base.compare(base.size() - 4, 4, ".tmp") == 0) base.resize(base.size() - 4);
  if (base == detail::kDcpMetadataFile) return true;
  return base.rfind("__", 0) == 0 && base.size() > 7 && base.compare(base.size() - 7, 7, ".distcp") == 0;
}

// ------------------------------------------------------------------ loading

class Reader {
 public:
  explicit Reader(const std::string& dir) : dir_(dir), meta_(detail::read_dcp_metadata(dir, kLoad)) { check_files(); }
  const DcpMetadata& meta() const { return meta_; }

  const DcpEntry& entry(const std::string& key, bool tensor) const {
    const auto e = meta_.entries.find(key);
    TORCH_CHECK(e != meta_.entries.end(), kLoad, "'", meta_.path, "' has no key '", key, "'",
                key.rfind("optimizer.", 0) == 0 ? " (was it saved by another optimizer, or before any step?)" : "",
                key == "train_state.step" ? " (save it with the layout of fsdp/dcp.h: {\"model\", \"optimizer\", "
                                            "\"train_state\": {\"step\": ...}})"
                                          : "");
    TORCH_CHECK(e->second.is_bytes != tensor, kLoad, "key '", key, "' in '", meta_.path, "' is ",
                e->second.is_bytes ? "a BYTE_IO value" : "a tensor", ", not ", tensor ? "a tensor" : "a value");
    return e->second;
  }

  // This rank's piece of `key`, laid out like `like`, cast to its dtype.
  DTensor piece(const std::string& key, const DTensor& like) {
    const DcpEntry& e = entry(key, true);
    TORCH_CHECK(e.shape == like.sizes(), kLoad, "key '", key, "' has shape ", c10::IntArrayRef(e.shape), " in '",
                meta_.path, "' but ", c10::IntArrayRef(like.sizes()), " here");
    const auto want = like.local_bounds();
    // Read into host memory, then moved to the device of `like`.
    at::Tensor local = at::empty(like.to_local().sizes(), like.to_local().options().device(at::kCPU));
    if (local.numel() > 0) {
      for (const auto& c : e.chunks) copy_overlap(key, e, c, want, local);
    }
    return DTensor::from_local(local.to(like.to_local().device()), like.device_mesh(), like.placements(), like.sizes());
  }

  // A 0-dim tensor's value, or a BYTE_IO value that is a number or bool. Read once per key:
  // every parameter of a param group asks for the group's options.
  double number(const std::string& key) {
    const auto cached = numbers_.find(key);
    if (cached != numbers_.end()) return cached->second;
    const auto e = meta_.entries.find(key);
    TORCH_CHECK(e != meta_.entries.end(), kLoad, "'", meta_.path, "' has no key '", key, "'",
                key.rfind("optimizer.", 0) == 0 ? " (was it saved by another optimizer than Adam/AdamW?)" : "");
    double v = 0;
    if (!e->second.is_bytes) {
      TORCH_CHECK(e->second.shape.empty(), kLoad, "key '", key, "' in '", meta_.path, "' is a tensor of shape ",
                  c10::IntArrayRef(e->second.shape), ", not a number");
      v = chunk(key, e->second, e->second.chunks.at(0)).to(at::kDouble).item<double>();
    } else {
      v = as_number("key '" + key + "'", *value(key));
    }
    numbers_[key] = v;
    return v;
  }
  std::shared_ptr<PyValue> value(const std::string& key) {
    auto& v = values_[key];
    if (!v) v = load_item(key, entry(key, false).bytes);
    return v;
  }
  double as_number(const std::string& what, const PyValue& v) const {
    using Kind = PyValue::Kind;
    if (v.kind == Kind::kFloat) return v.real;
    if (v.kind == Kind::kInt || v.kind == Kind::kBool) return static_cast<double>(v.integer);
    if (v.kind == Kind::kTensor && v.tensor.numel() == 1) return v.tensor.to(at::kDouble).item<double>();
    TORCH_CHECK(false, kLoad, what, " in '", meta_.path, "' is a ", detail::py_type_name(v), ", not a number");
  }

 private:
  void check_files() {
    std::map<std::string, int64_t> sizes;
    auto check = [&](const std::string& key, const DcpStorage& s) {
      auto it = sizes.find(s.file);
      if (it == sizes.end()) {
        std::error_code ec;
        const fs::path p = fs::path(dir_) / s.file;
        const bool regular = fs::is_regular_file(fs::symlink_status(p, ec));
        const auto n = regular ? static_cast<int64_t>(fs::file_size(p, ec)) : -1;
        it = sizes.emplace(s.file, ec ? -1 : n).first;
      }
      TORCH_CHECK(it->second >= 0, kLoad, "data file '", (fs::path(dir_) / s.file).string(), "' listed in '",
                  meta_.path, "' is missing or not a regular file (key '", key, "')");
      TORCH_CHECK(s.offset <= it->second && s.length <= it->second - s.offset, kLoad, "data file '",
                  (fs::path(dir_) / s.file).string(), "' is ", it->second, " bytes, but key '", key,
                  "' is stored at bytes [", s.offset, ", ", s.offset + s.length, ") of it: truncated?");
    };
    for (const auto& [key, e] : meta_.entries) {
      if (e.is_bytes) check(key, e.bytes);
      for (const auto& c : e.chunks) {
        if (!c.storage.file.empty()) check(key, c.storage);
      }
    }
  }

  std::string read_bytes(const std::string& key, const DcpStorage& s) const {
    const fs::path p = fs::path(dir_) / s.file;
    std::ifstream in(p, std::ios::binary);
    TORCH_CHECK(in, kLoad, "cannot open data file '", p.string(), "' (key '", key, "')");
    std::string bytes(static_cast<size_t>(s.length), '\0');
    in.seekg(s.offset);
    in.read(&bytes[0], s.length);
    TORCH_CHECK(in.gcount() == s.length, kLoad, "data file '", p.string(), "' is truncated (key '", key, "')");
    return bytes;
  }

  std::shared_ptr<PyValue> load_item(const std::string& key, const DcpStorage& s) const {
    const std::string bytes = read_bytes(key, s);
    const std::string name = "key '" + key + "' in '" + (fs::path(dir_) / s.file).string() + "' (bytes " +
                             std::to_string(s.offset) + " to " + std::to_string(s.offset + s.length) + ")";
    TORCH_CHECK(bytes.size() >= 4 && std::memcmp(bytes.data(), "PK\x03\x04", 4) == 0, kLoad, name,
                " is not a torch.save archive: this reader supports DCP's default serialization (torch_save) "
                "only, not serialization_format=SAFETENSORS; save with the default");
    detail::TorchLoadOptions options;
    options.who = kLoad;
    options.only_tensor_globals = true;
    return detail::torch_load_bytes(name, bytes.data(), bytes.size(), options);
  }

  at::Tensor chunk(const std::string& key, const DcpEntry& e, const detail::DcpChunk& c) const {
    const std::shared_ptr<PyValue> v = load_item(key, c.storage);
    TORCH_CHECK(v->kind == PyValue::Kind::kTensor, kLoad, "key '", key, "' in '",
                (fs::path(dir_) / c.storage.file).string(), "' holds a ", detail::py_type_name(*v),
                " where its metadata records a tensor chunk");
    TORCH_CHECK(v->tensor.sizes() == c10::IntArrayRef(c.sizes) && v->tensor.scalar_type() == e.dtype, kLoad, "key '",
                key, "' in '", (fs::path(dir_) / c.storage.file).string(), "' holds a ", v->tensor.scalar_type(),
                " tensor of shape ", v->tensor.sizes(), " where '", meta_.path, "' records ", e.dtype, " ",
                c10::IntArrayRef(c.sizes));
    return v->tensor;
  }

  // Copies the overlap of chunk `c` with this rank's piece `local` (at bounds `want`).
  void copy_overlap(const std::string& key, const DcpEntry& e, const detail::DcpChunk& c,
                    const std::vector<ChunkBounds>& want, at::Tensor& local) const {
    std::vector<int64_t> lo(want.size()), hi(want.size());
    for (size_t d = 0; d < want.size(); ++d) {
      lo[d] = std::max(c.offsets[d], want[d].offset);
      hi[d] = std::min(c.offsets[d] + c.sizes[d], want[d].offset + want[d].length);
      if (lo[d] >= hi[d]) return;
    }
    if (c.storage.file.empty()) return;  // an empty chunk (checked: it holds no element)
    at::Tensor src = chunk(key, e, c);
    at::Tensor dst = local;
    for (size_t d = 0; d < want.size(); ++d) {
      src = src.narrow(static_cast<int64_t>(d), lo[d] - c.offsets[d], hi[d] - lo[d]);
      dst = dst.narrow(static_cast<int64_t>(d), lo[d] - want[d].offset, hi[d] - lo[d]);
    }
    dst.copy_(src);
  }

  std::string dir_;
  DcpMetadata meta_;
  std::map<std::string, double> numbers_;
  std::map<std::string, std::shared_ptr<PyValue>> values_;
};

// fqn -> the index of the param group whose `params` lists it.
std::map<std::string, int64_t> groups_by_fqn(Reader& r) {
  std::map<std::string, int64_t> out;
  const std::string prefix = "optimizer.param_groups.";
  for (const auto& [key, e] : r.meta().entries) {
    std::string group, name;
    if (!split_key(key, prefix, &group, &name) || name != "params") continue;
    int64_t g = -1;
    try {
      g = std::stoll(group);
    } catch (const std::exception&) {
    }
    TORCH_CHECK(g >= 0 && std::to_string(g) == group, kLoad, "key '", key, "' in '", r.meta().path,
                "' is not optimizer.param_groups.<index>.params");
    const std::shared_ptr<PyValue> params = r.value(key);
    TORCH_CHECK(params->kind == PyValue::Kind::kList, kLoad, "key '", key, "' in '", r.meta().path, "' is a ",
                detail::py_type_name(*params), ", not the list of parameter FQNs");
    for (const auto& p : params->items) {
      TORCH_CHECK(p->kind == PyValue::Kind::kStr, kLoad, "key '", key, "' in '", r.meta().path, "' lists a ",
                  detail::py_type_name(*p), ", not a parameter FQN (save with get_state_dict's optimizer dict)");
      TORCH_CHECK(out.emplace(p->text, g).second, kLoad, "parameter '", p->text, "' is in two param groups of '",
                  r.meta().path, "'");
    }
  }
  return out;
}

// Checks, once per group, that the checkpoint's optimizer is the one we load into.
void check_group_kind(Reader& r, int64_t g, const DcpOptions& options) {
  const std::string prefix = "optimizer.param_groups." + std::to_string(g) + ".";
  if (r.meta().entries.count(prefix + "maximize")) {
    TORCH_CHECK(r.number(prefix + "maximize") == 0.0, kLoad, "'", r.meta().path, "' key '", prefix,
                "maximize' is true: maximizing Adam/AdamW is not supported by torch::optim; train with maximize=False");
  }
  if (r.meta().entries.count(prefix + "decoupled_weight_decay")) {
    const bool adamw = r.number(prefix + "decoupled_weight_decay") != 0.0;
    TORCH_CHECK(adamw == options.adamw(), kLoad, "'", r.meta().path, "' holds the state of ", adamw ? "AdamW" : "Adam",
                " (key '", prefix, "decoupled_weight_decay'), but it is loaded into ",
                options.adamw() ? "AdamW" : "Adam", ": load it into the same optimizer (DcpOptions().adamw(",
                adamw ? "true" : "false", "))");
  }
}

double option_value(Reader& r, int64_t g, const std::string& option) {
  const std::string prefix = "optimizer.param_groups." + std::to_string(g) + ".";
  if (option != "beta1" && option != "beta2") return r.number(prefix + option);
  const std::shared_ptr<PyValue> betas = r.value(prefix + "betas");
  TORCH_CHECK((betas->kind == PyValue::Kind::kTuple || betas->kind == PyValue::Kind::kList) && betas->items.size() == 2,
              kLoad, "key '", prefix, "betas' in '", r.meta().path, "' is a ", detail::py_type_name(*betas),
              ", not a pair of numbers");
  return r.as_number("key '" + prefix + "betas'", *betas->items[option == "beta1" ? 0 : 1]);
}

ShardedStateDict load_optimizer(Reader& r, const ShardedStateDict& like, const DcpOptions& options) {
  ShardedStateDict out;
  std::map<std::string, int64_t> group_of;
  std::set<int64_t> checked;
  bool groups_read = false;
  for (const auto& item : like) {
    std::string fqn, name;
    const DTensor& l = item.value();
    auto scalar = [&](double v) {
      return DTensor::from_local(at::scalar_tensor(v, l.to_local().options()), l.device_mesh(), l.placements(),
                                 l.sizes());
    };
    if (split_key(item.key(), "state.", &fqn, &name)) {
      const std::string key = "optimizer." + item.key();
      if (name != "step") {
        out.insert(item.key(), r.piece(key, l));
        continue;
      }
      const double step = r.number(key);
      TORCH_CHECK(step >= 0 && step == std::floor(step) && step < 9.0e15, kLoad, "key '", key, "' in '", r.meta().path,
                  "' is ", step, ", not a step count");
      out.insert(item.key(), scalar(step));
      continue;
    }
    TORCH_CHECK(
        split_key(item.key(), "param_groups.", &fqn, &name), kLoad, "optimizer key '", item.key(),
        "' is neither state.<fqn>.<name> nor param_groups.<fqn>.<option>: pass sharded_optimizer_state_dict()'s dict");
    TORCH_CHECK(std::find(kAdamOptions.begin(), kAdamOptions.end(), name) != kAdamOptions.end(), kLoad,
                "optimizer key '", item.key(),
                "' is no Adam/AdamW option: DCP checkpoints are read for "
                "torch::optim::Adam and AdamW only");
    if (!groups_read) group_of = groups_by_fqn(r), groups_read = true;
    const auto g = group_of.find(fqn);
    TORCH_CHECK(g != group_of.end(), kLoad, "no param group of '", r.meta().path, "' lists parameter '", fqn,
                "' (optimizer.param_groups.<g>.params)");
    if (checked.insert(g->second).second) check_group_kind(r, g->second, options);
    out.insert(item.key(), scalar(option_value(r, g->second, name)));
  }
  return out;
}

// train_state.step: a 0-dim tensor as the layout says (a plain int, saved as a BYTE_IO value,
// is read too).
int64_t train_step(Reader& r) {
  TORCH_CHECK(r.meta().entries.count("train_state.step"), kLoad, "'", r.meta().path,
              "' has no key 'train_state.step' "
              "(save it with the layout of fsdp/dcp.h: {\"model\", \"optimizer\", \"train_state\": {\"step\": ...}})");
  const double step = r.number("train_state.step");
  TORCH_CHECK(step >= 0 && step == std::floor(step) && step < 9.0e15, kLoad, "key 'train_state.step' in '",
              r.meta().path, "' is ", step, ", not a step count");
  return static_cast<int64_t>(step);
}

}  // namespace

void save_dcp(const std::string& dir_name, const ShardedStateDict& model, const ShardedStateDict& optimizer,
              int64_t step, const DcpOptions& options) {
  TORCH_CHECK(step >= 0, kSave, ": step is ", step, "; it counts optimizer steps taken (0 or more)");
  const auto world = fsdp::world();
  const int rank = world->rank();
  const fs::path dir(dir_name);
  // Planned before anything is touched: a wrong optimizer fails every rank the same way.
  DataFile file(rank);
  DcpMetadata meta;
  detail::on_all_ranks(*world, kSave, "preparing the items", [&] {
    plan_save(model, optimizer, step, options, &file, &meta);
    return std::string();
  });
  detail::on_all_ranks(*world, kSave, "preparing the directory", [&] {
    if (rank == 0) {
      fs::create_directories(dir);
      fs::remove(dir / detail::kDcpMetadataFile);  // the old checkpoint stops being loadable first
      std::error_code ec;
      for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
        std::error_code remove_ec;
        if (ours(it->path().filename().string())) fs::remove(it->path(), remove_ec);
      }
    }
    return std::string();
  });
  const std::vector<std::string> reports = detail::on_all_ranks(*world, kSave, "writing the data files", [&] {
    file.write(dir / data_file(rank));
    return file.report().dump();
  });
  // Rank 0 writes .metadata last: only now is the checkpoint complete.
  detail::on_all_ranks(*world, kSave, "writing .metadata", [&] {
    if (rank == 0) {
      add_reports(reports, &meta);
      const std::string pickle = detail::write_dcp_metadata(meta, fs::absolute(dir).string(), save_id());
      detail::write_file_durably(dir / detail::kDcpMetadataFile, pickle.data(), pickle.size());
      detail::fsync_dir(dir);
    }
    return std::string();
  });
}

DcpState load_dcp(const std::string& dir, const ShardedStateDict& model_like, const ShardedStateDict& optimizer_like,
                  const DcpOptions& options) {
  try {
    Reader r(dir);
    DcpState s;
    for (const auto& item : model_like) s.model.insert(item.key(), r.piece("model." + item.key(), item.value()));
    s.optimizer = load_optimizer(r, optimizer_like, options);
    s.step = train_step(r);
    return s;
  } catch (const c10::Error&) {
    throw;
  } catch (const std::exception& e) {  // std::bad_alloc, a filesystem error
    TORCH_CHECK(false, kLoad, "reading '", dir, "' failed: ", e.what());
  }
}

int64_t dcp_step(const std::string& dir) {
  try {
    Reader r(dir);
    return train_step(r);
  } catch (const c10::Error&) {
    throw;
  } catch (const std::exception& e) {
    TORCH_CHECK(false, kLoad, "reading '", dir, "' failed: ", e.what());
  }
}

bool is_complete_dcp(const std::string& dir, std::string* why) {
  try {
    Reader r(dir);
    return true;
  } catch (const c10::Error& e) {
    if (why) *why = e.what_without_backtrace();
  } catch (const std::exception& e) {
    if (why) *why = dir + " cannot be read: " + e.what();
  }
  return false;
}

}  // namespace fsdp
