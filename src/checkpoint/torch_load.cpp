// Reading torch.save files: what data.pkl's GLOBALs, calls and persistent ids mean (the subset
// of protocol 2 that torch.save writes; see torch_load.h), run on the pickle machine of
// pickle.h, and the zip archive around it. Every tensor is checked against the storage it views:
// a damaged or hostile file gives a c10::Error naming it.
#include "src/checkpoint/torch_load.h"

#include "src/checkpoint/checkpoint_metadata.h"  // printable()

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <caffe2/serialize/inline_container.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <optional>
#include <sstream>
#include <unordered_map>

namespace fsdp {
namespace detail {
namespace {

using Kind = PyValue::Kind;

// The dtype of a storage class as torch.save names it ("torch.FloatStorage").
std::optional<at::ScalarType> storage_dtype(const std::string& name) {
  static const std::map<std::string, at::ScalarType> table = {{"torch.DoubleStorage", at::kDouble},
                                                              {"torch.FloatStorage", at::kFloat},
                                                              {"torch.HalfStorage", at::kHalf},
                                                              {"torch.BFloat16Storage", at::kBFloat16},
                                                              {"torch.LongStorage", at::kLong},
                                                              {"torch.IntStorage", at::kInt},
                                                              {"torch.ShortStorage", at::kShort},
                                                              {"torch.CharStorage", at::kChar},
                                                              {"torch.ByteStorage", at::kByte},
                                                              {"torch.BoolStorage", at::kBool},
                                                              {"torch.ComplexFloatStorage", at::kComplexFloat},
                                                              {"torch.ComplexDoubleStorage", at::kComplexDouble}};
  const auto it = table.find(name);
  if (it == table.end()) return std::nullopt;
  return it->second;
}

// Loads the storage with persistent key `key`: `numel` elements of `dtype`.
using StorageLoader = std::function<at::Tensor(const std::string& key, at::ScalarType dtype, int64_t numel)>;

PickleMachine::Options data_pkl_options() {
  PickleMachine::Options o;
  o.min_protocol = 0;
  o.max_protocol = 2;
  o.protocol_note = "torch.save writes protocol 2";
  o.max_depth = 100;  // a state dict nests a few levels; this bounds any recursion
  o.unknown_opcode = "is not one torch.save writes";
  return o;
}

// Runs data.pkl on the pickle machine (pickle.h). Executes no Python: the callables it knows
// (OrderedDict, the tensor rebuild functions, LibTorch's type tag) are rebuilt; any other
// becomes an opaque value.
class Unpickler : public PickleMachine {
 public:
  Unpickler(std::string path, const char* data, size_t size, StorageLoader load_storage,
            const TorchLoadOptions& options)
      : PickleMachine(data, size, data_pkl_options()),
        path_(std::move(path)),
        load_storage_(std::move(load_storage)),
        options_(options) {}

 private:
  std::string error_message(const std::string& what) const override {
    return c10::str(options_.who, path_, " is not a torch.save file this reader can read: ", what,
                    " (data.pkl, at byte ", op_at(), ")");
  }

  PyRef global(const std::string& module, const std::string& qualname) override {
    std::string name = module + "." + qualname;
    if (options_.only_tensor_globals && !tensor_global(name)) {
      fail("GLOBAL '" + printable(name) +
           "' is not one a tensor or a plain value needs; it is refused, never imported");
    }
    return make_named(Kind::kGlobal, std::move(name));
  }
  static bool tensor_global(const std::string& name) {
    return name == "torch._utils._rebuild_tensor_v2" || name == "collections.OrderedDict" ||
           storage_dtype(name).has_value();
  }

  // NEWOBJ: an instance of a class; nothing a state dict is made of.
  PyRef new_object(const PyValue& cls, const PyValue&) override {
    return make_named(Kind::kOpaque, cls.text.empty() ? "object" : cls.text);
  }

  // BUILD sets an object's attributes from a state. An OrderedDict's attributes (a state dict's
  // _metadata: per-module versions that only Python's load_state_dict hooks read) and those of
  // an opaque object are not part of any tensor: dropped. Anything else is not torch.save's.
  void build(PyValue& target, const PyRef&) override {
    if (target.kind != Kind::kDict && target.kind != Kind::kOpaque) fail("BUILD applied to a " + py_type_name(target));
  }

  PyRef reduce(const PyValue& f, const PyValue& args) override {
    if (f.kind != Kind::kGlobal && f.kind != Kind::kOpaque) fail("REDUCE calls a " + py_type_name(f));
    if (args.kind != Kind::kTuple) fail("REDUCE passes a " + py_type_name(args) + " as the arguments");
    if (f.kind == Kind::kGlobal && f.text == "collections.OrderedDict") {
      if (!args.items.empty()) fail("OrderedDict is called with arguments");
      return make(Kind::kDict);
    }
    if (f.kind == Kind::kGlobal && f.text == "torch._utils._rebuild_tensor_v2") return rebuild_tensor(args.items);
    if (f.kind == Kind::kGlobal && f.text == "torch._utils._rebuild_parameter") return rebuild_parameter(args.items);
    if (f.kind == Kind::kGlobal && f.text == "torch.jit._pickle.restore_type_tag") {  // LibTorch's pickler
      if (args.items.size() != 2) fail("restore_type_tag takes 2 arguments");
      return args.items[0];
    }
    return make_named(Kind::kOpaque, f.text);  // e.g. a numpy array or an argparse.Namespace
  }

  // ---------------------------------------------------------------- tensors
  PyRef persistent_load(const PyValue& pid) override {
    const auto& t = pid.items;
    if (pid.kind != Kind::kTuple || t.size() != 5 || t[0]->kind != Kind::kStr || t[0]->text != "storage" ||
        t[1]->kind != Kind::kGlobal || t[2]->kind != Kind::kStr || t[3]->kind != Kind::kStr ||
        t[4]->kind != Kind::kInt) {
      fail("a persistent id that is not ('storage', storage type, key, location, numel)");
    }
    const std::optional<at::ScalarType> dtype = storage_dtype(t[1]->text);
    if (!dtype) fail("a storage of type " + t[1]->text + ", which this reader does not support");
    const auto cached = storages_.find(t[2]->text);
    if (cached != storages_.end()) {
      const at::Tensor& s = cached->second->tensor;
      if (s.scalar_type() != *dtype || s.numel() != t[4]->integer) {
        fail("storage '" + t[2]->text + "' is used with two types or sizes");
      }
      return cached->second;
    }
    if (t[4]->integer < 0) fail("a storage of " + std::to_string(t[4]->integer) + " elements");
    PyRef storage = make(Kind::kStorage);
    storage->tensor = load_storage_(t[2]->text, *dtype, t[4]->integer);
    storages_[t[2]->text] = storage;
    return storage;
  }

  std::vector<int64_t> ints(const PyValue& v, const char* what) {
    std::vector<int64_t> out;
    if (v.kind != Kind::kTuple) fail(std::string("a tensor's ") + what + " is a " + py_type_name(v) + ", not a tuple");
    for (const PyRef& i : v.items) {
      if (i->kind != Kind::kInt || i->integer < 0) {
        fail(std::string("a tensor's ") + what + " holds a negative or non-integer value");
      }
      out.push_back(i->integer);
    }
    return out;
  }

  // _rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad, backward_hooks[, metadata])
  PyRef rebuild_tensor(const std::vector<PyRef>& a) {
    if (a.size() != 6 && a.size() != 7) fail("_rebuild_tensor_v2 takes 6 or 7 arguments");
    if (a[0]->kind != Kind::kStorage || a[1]->kind != Kind::kInt || a[1]->integer < 0 || a[4]->kind != Kind::kBool) {
      fail("_rebuild_tensor_v2 is given a bad storage, offset or requires_grad");
    }
    // torch.save never saves hooks (it writes an empty OrderedDict) nor, for a plain tensor, metadata.
    if (a[5]->kind != Kind::kDict || !a[5]->items.empty() || (a.size() == 7 && a[6]->kind != Kind::kNone)) {
      fail("a tensor with backward hooks or Python metadata");
    }
    const std::vector<int64_t> size = ints(*a[2], "size"), stride = ints(*a[3], "stride");
    if (size.size() != stride.size()) fail("a tensor's size and stride have different lengths");
    check_within_storage(a[0]->tensor.numel(), a[1]->integer, size, stride);
    PyRef t = make(Kind::kTensor);
    t->tensor = at::empty({0}, a[0]->tensor.options()).set_(a[0]->tensor.storage(), a[1]->integer, size, stride);
    if (a[4]->integer) set_requires_grad(t->tensor);
    return t;
  }
  // _rebuild_parameter(data, requires_grad, backward_hooks): an nn.Parameter saved as such.
  PyRef rebuild_parameter(const std::vector<PyRef>& a) {
    if (a.size() != 3 || a[0]->kind != Kind::kTensor || a[1]->kind != Kind::kBool || a[2]->kind != Kind::kDict ||
        !a[2]->items.empty()) {
      fail("_rebuild_parameter is not given (tensor, requires_grad, no hooks)");
    }
    PyRef t = make(Kind::kTensor);
    t->tensor = a[0]->tensor.detach();
    if (a[1]->integer) set_requires_grad(t->tensor);
    return t;
  }
  void set_requires_grad(at::Tensor& t) {
    if (!at::isFloatingType(t.scalar_type()) && !at::isComplexType(t.scalar_type())) {
      fail("a tensor of dtype " + std::string(c10::toString(t.scalar_type())) + " that requires grad");
    }
    t.set_requires_grad(true);
  }

  // Every element the sizes and strides reach lies inside the storage's `numel` elements.
  void check_within_storage(int64_t numel, int64_t offset, const std::vector<int64_t>& size,
                            const std::vector<int64_t>& stride) {
    int64_t last = offset;  // the element furthest in
    bool empty = false;
    for (size_t d = 0; d < size.size(); ++d) {
      int64_t reach = 0;
      empty = empty || size[d] == 0;
      if (size[d] > 0 &&
          (__builtin_mul_overflow(size[d] - 1, stride[d], &reach) || __builtin_add_overflow(last, reach, &last))) {
        fail("a tensor's sizes and strides overflow 64 bits");
      }
    }
    if (empty ? offset > numel : last >= numel) {
      fail("a tensor reaches element " + std::to_string(last) + " of a storage of " + std::to_string(numel));
    }
  }

  std::string path_;
  StorageLoader load_storage_;
  const TorchLoadOptions& options_;
  std::unordered_map<std::string, PyRef> storages_;
};

// ------------------------------------------------------------------ the zip archive

using Archive = caffe2::serialize::PyTorchStreamReader;

// What messages name: the caller's prefix and the archive ("'model.pt'", or an item of a file).
struct Source {
  const std::string& who;
  std::string name;
};

[[noreturn]] void archive_error(const Source& src, const std::exception& e) {
  const auto* c10_error = dynamic_cast<const c10::Error*>(&e);
  TORCH_CHECK(false, src.who, src.name, " is not a readable torch.save archive (truncated or damaged?): ",
              c10_error ? c10_error->what_without_backtrace() : e.what());
}

bool has_record(Archive& zip, const std::string& name, const Source& src) {
  try {
    return zip.hasRecord(name);
  } catch (const std::exception& e) {
    archive_error(src, e);
  }
}

std::tuple<at::DataPtr, size_t> record(Archive& zip, const std::string& name, const Source& src) {
  TORCH_CHECK(has_record(zip, name, src), src.who, src.name, " has no record '", name, "'",
              name == "data.pkl" ? " (it is not a torch.save file)" : " (a tensor's storage is missing)");
  try {
    return zip.getRecord(name);
  } catch (const std::exception& e) {
    archive_error(src, e);
  }
}

at::Tensor load_storage(Archive& zip, const Source& src, const std::string& key, at::ScalarType dtype, int64_t numel) {
  int64_t bytes = 0;
  TORCH_CHECK(!__builtin_mul_overflow(numel, static_cast<int64_t>(c10::elementSize(dtype)), &bytes), src.who, src.name,
              ": storage '", key, "' claims ", numel, " elements, more bytes than fit in 64 bits");
  auto [data, size] = record(zip, "data/" + key, src);
  TORCH_CHECK(static_cast<int64_t>(size) == bytes, src.who, src.name, ": storage '", key, "' has ", size,
              " bytes; its ", numel, " elements of ", dtype, " take ", bytes);
  at::Tensor t = at::empty({numel}, at::TensorOptions().dtype(dtype));
  if (bytes > 0) std::memcpy(t.data_ptr(), data.get(), static_cast<size_t>(bytes));
  return t;
}

// A zip archive begins with a local file header; torch.save's legacy format with a pickle.
void check_is_zip(std::istream& in, const Source& src) {
  char magic[4] = {0, 0, 0, 0};
  in.read(magic, 4);
  TORCH_CHECK(static_cast<unsigned char>(magic[0]) != 0x80, src.who, src.name,
              " is in torch.save's legacy format "
              "(_use_new_zipfile_serialization=False), which is not supported: save it again with the default format");
  TORCH_CHECK(in.gcount() == 4 && std::memcmp(magic, "PK\x03\x04", 4) == 0, src.who, src.name,
              " is not a torch.save file (not a zip archive)");
  in.clear();
  in.seekg(0);
}

std::shared_ptr<PyValue> read_archive(std::istream& in, const Source& src, const TorchLoadOptions& options) {
  check_is_zip(in, src);
  std::unique_ptr<Archive> zip;
  try {
    zip = std::make_unique<Archive>(&in);
  } catch (const std::exception& e) {
    archive_error(src, e);
  }
  if (has_record(*zip, "byteorder", src)) {
    auto [order, n] = record(*zip, "byteorder", src);
    TORCH_CHECK(std::string(static_cast<const char*>(order.get()), n) == "little", src.who, src.name,
                " was saved on a big-endian machine; this reader reads little-endian files only");
  }
  auto [pickle, size] = record(*zip, "data.pkl", src);
  return Unpickler(
             src.name, static_cast<const char*>(pickle.get()), size,
             [&](const std::string& key, at::ScalarType dtype, int64_t numel) {
               return load_storage(*zip, src, key, dtype, numel);
             },
             options)
      .run();
}

std::shared_ptr<PyValue> read_file(const std::string& path, const TorchLoadOptions& options) {
  const Source src{options.who, "'" + path + "'"};
  std::error_code ec;
  TORCH_CHECK(std::filesystem::exists(path, ec), src.who, src.name, " does not exist");
  TORCH_CHECK(std::filesystem::is_regular_file(path, ec), src.who, src.name, " is not a regular file");
  std::ifstream in(path, std::ios::binary);
  TORCH_CHECK(in, src.who, "cannot open ", src.name);
  return read_archive(in, src, options);
}

// Turns what escapes the archive reader besides c10::Error (std::bad_alloc for an absurd
// size, ...) into one naming the archive.
template <typename F>
std::shared_ptr<PyValue> guarded(const std::string& who, const std::string& name, F read) {
  try {
    return read();
  } catch (const c10::Error&) {
    throw;
  } catch (const std::exception& e) {
    TORCH_CHECK(false, who, name, " cannot be read: ", e.what());
  }
}

}  // namespace

std::shared_ptr<PyValue> torch_load(const std::string& path) {
  const TorchLoadOptions options;
  return guarded(options.who, "'" + path + "'", [&] { return read_file(path, options); });
}

std::shared_ptr<PyValue> torch_load_bytes(const std::string& name, const char* data, size_t size,
                                          const TorchLoadOptions& options) {
  return guarded(options.who, name, [&] {
    std::istringstream in(std::string(data, size), std::ios::binary);
    return read_archive(in, Source{options.who, name}, options);
  });
}

}  // namespace detail
}  // namespace fsdp
