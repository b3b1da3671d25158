// Reading torch.save files: the pickle machine for data.pkl (the subset of protocol 2 that
// torch.save writes; see torch_load.h) and the zip archive around it. Every read is checked
// against the bounds of the data, every opcode against the stack it needs, and every tensor
// against the storage it views: a damaged or hostile file gives a c10::Error naming it.
#include "src/checkpoint/torch_load.h"

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

using PyRef = std::shared_ptr<PyValue>;
using Kind = PyValue::Kind;

constexpr int kMaxDepth = 100;  // a state dict nests a few levels; this bounds any recursion

PyRef make(Kind kind) {
  auto v = std::make_shared<PyValue>();
  v->kind = kind;
  return v;
}
PyRef make_number(Kind kind, int64_t i) {
  PyRef v = make(kind);
  v->integer = i;
  return v;
}
PyRef make_named(Kind kind, std::string text) {
  PyRef v = make(kind);
  v->text = std::move(text);
  return v;
}

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

// Runs data.pkl. Executes no Python: the callables it knows (OrderedDict, the tensor rebuild
// functions, LibTorch's type tag) are rebuilt; any other becomes an opaque value.
class Unpickler {
 public:
  Unpickler(std::string path, const char* data, size_t size, StorageLoader load_storage,
            const TorchLoadOptions& options)
      : path_(std::move(path)), data_(data), size_(size), load_storage_(std::move(load_storage)), options_(options) {}

  PyRef run() {
    while (step()) {
    }
    if (stack_.size() != 1 || !marks_.empty()) {
      fail("the pickle stops with " + std::to_string(stack_.size()) + " values and " + std::to_string(marks_.size()) +
           " marks left (one value expected)");
    }
    return stack_.back();
  }

 private:
  [[noreturn]] void fail(const std::string& what) const {
    TORCH_CHECK(false, options_.who, path_, " is not a torch.save file this reader can read: ", what,
                " (data.pkl, at byte ", op_at_, ")");
  }

  // ---------------------------------------------------------------- bytes
  const char* take(size_t n) {
    if (n > size_ - pos_) fail("the pickle is truncated");
    const char* p = data_ + pos_;
    pos_ += n;
    return p;
  }
  uint64_t little_endian(size_t n) {
    const auto* p = reinterpret_cast<const unsigned char*>(take(n));
    uint64_t v = 0;
    for (size_t i = n; i-- > 0;) v = (v << 8) | p[i];
    return v;
  }
  std::string line() {
    const void* nl = std::memchr(data_ + pos_, '\n', size_ - pos_);
    if (!nl) fail("a GLOBAL name is not terminated");
    const size_t n = static_cast<const char*>(nl) - (data_ + pos_);
    std::string s(take(n), n);
    take(1);
    return s;
  }

  // ---------------------------------------------------------------- the stack
  // Values below the innermost MARK belong to an outer construct: opcodes may not take them.
  size_t floor() const { return marks_.empty() ? 0 : marks_.back(); }
  void push(PyRef v) { stack_.push_back(std::move(v)); }
  PyRef& top() {
    if (stack_.size() <= floor()) fail("an opcode needs a value the stack does not hold");
    return stack_.back();
  }
  PyRef pop() {
    PyRef v = top();
    stack_.pop_back();
    return v;
  }
  std::vector<PyRef> pop_n(size_t n) {
    if (stack_.size() < floor() + n) fail("an opcode needs values the stack does not hold");
    std::vector<PyRef> out(stack_.end() - static_cast<std::ptrdiff_t>(n), stack_.end());
    stack_.resize(stack_.size() - n);
    return out;
  }
  std::vector<PyRef> pop_mark() {
    if (marks_.empty()) fail("an opcode needs a MARK that was never set");
    const size_t mark = marks_.back();
    marks_.pop_back();
    std::vector<PyRef> out(stack_.begin() + static_cast<std::ptrdiff_t>(mark), stack_.end());
    stack_.resize(mark);
    return out;
  }

  // ---------------------------------------------------------------- containers
  // Records that `child` is stored in `container`: it never changes again, and nesting is bounded.
  void store(PyValue& container, PyValue& child) {
    if (&container == &child) fail("a container holds itself");
    child.stored = true;
    container.depth = std::max(container.depth, child.depth + 1);
    if (container.depth > kMaxDepth) fail("values nest deeper than " + std::to_string(kMaxDepth) + " levels");
  }
  PyValue& mutable_container(Kind kind, const char* opcode) {
    PyValue& c = *top();
    if (c.kind != kind) fail(std::string(opcode) + " applied to a " + py_type_name(c));
    if (c.stored) fail(std::string(opcode) + " changes a container already stored in another");
    return c;
  }
  PyRef sequence(Kind kind, std::vector<PyRef> items) {
    PyRef v = make(kind);
    for (const PyRef& item : items) store(*v, *item);
    v->items = std::move(items);
    return v;
  }
  void append(std::vector<PyRef> items, const char* opcode) {
    PyValue& list = mutable_container(Kind::kList, opcode);
    for (PyRef& item : items) {
      store(list, *item);
      list.items.push_back(std::move(item));
    }
  }
  void set_items(std::vector<PyRef> items, const char* opcode) {
    if (items.size() % 2 != 0) fail(std::string(opcode) + " with a key and no value");
    PyValue& dict = mutable_container(Kind::kDict, opcode);
    for (size_t i = 0; i < items.size(); i += 2) {
      store(dict, *items[i]);
      store(dict, *items[i + 1]);
      const bool str_key = items[i]->kind == Kind::kStr;
      const auto seen = str_key ? dict.str_keys.find(items[i]->text) : dict.str_keys.end();
      if (seen != dict.str_keys.end()) {
        dict.items[seen->second + 1] = items[i + 1];  // a repeated key keeps its place, as in Python
        continue;
      }
      if (str_key) dict.str_keys[items[i]->text] = dict.items.size();
      dict.items.push_back(items[i]);
      dict.items.push_back(items[i + 1]);
    }
  }

  // ---------------------------------------------------------------- opcodes
  bool step() {
    op_at_ = pos_;
    const auto op = static_cast<unsigned char>(*take(1));
    if (op == '.') return false;  // STOP
    if (!scalar_op(op) && !container_op(op) && !object_op(op)) {
      char hex[8];
      std::snprintf(hex, sizeof hex, "0x%02x", op);
      fail(std::string("opcode ") + hex + " is not one torch.save writes");
    }
    return true;
  }

  bool scalar_op(unsigned char op) {
    switch (op) {
      case 0x80: {  // PROTO
        const uint64_t protocol = little_endian(1);
        if (protocol > 2) fail("pickle protocol " + std::to_string(protocol) + " (torch.save writes protocol 2)");
        return true;
      }
      case 'N': push(make(Kind::kNone)); return true;
      case 0x88: push(make_number(Kind::kBool, 1)); return true;  // NEWTRUE
      case 0x89: push(make_number(Kind::kBool, 0)); return true;  // NEWFALSE
      case 'K': push(make_number(Kind::kInt, static_cast<int64_t>(little_endian(1)))); return true;
      case 'M': push(make_number(Kind::kInt, static_cast<int64_t>(little_endian(2)))); return true;
      case 'J': push(make_number(Kind::kInt, static_cast<int32_t>(little_endian(4)))); return true;
      case 0x8a: push(make_number(Kind::kInt, long1())); return true;  // LONG1
      case 'G': push(binfloat()); return true;
      case 'X': push(make_named(Kind::kStr, binunicode())); return true;
      default: return false;
    }
  }
  std::string binunicode() {
    const size_t n = static_cast<size_t>(little_endian(4));
    return std::string(take(n), n);
  }
  int64_t long1() {
    const size_t n = static_cast<size_t>(little_endian(1));
    if (n > 8) fail("an integer wider than 64 bits");
    if (n == 0) return 0;
    const uint64_t raw = little_endian(n);
    const int shift = static_cast<int>(64 - 8 * n);  // sign-extend from n bytes
    return shift == 0 ? static_cast<int64_t>(raw) : static_cast<int64_t>(raw << shift) >> shift;
  }
  PyRef binfloat() {
    const uint64_t big_endian = little_endian(8);
    uint64_t bits = 0;
    for (int i = 0; i < 8; ++i) bits = (bits << 8) | ((big_endian >> (8 * i)) & 0xff);
    PyRef v = make(Kind::kFloat);
    std::memcpy(&v->real, &bits, sizeof bits);
    return v;
  }

  bool container_op(unsigned char op) {
    switch (op) {
      case '(': marks_.push_back(stack_.size()); return true;  // MARK
      case '0': pop(); return true;                            // POP
      case '1': pop_mark(); return true;                       // POP_MARK
      case '2': push(top()); return true;                      // DUP
      case ')': push(make(Kind::kTuple)); return true;         // EMPTY_TUPLE
      case 't': push(sequence(Kind::kTuple, pop_mark())); return true;
      case 0x85:
      case 0x86:
      case 0x87: push(sequence(Kind::kTuple, pop_n(op - 0x84))); return true;  // TUPLE1-3
      case ']': push(make(Kind::kList)); return true;                          // EMPTY_LIST
      case 'l': push(sequence(Kind::kList, pop_mark())); return true;
      case 'a': append(pop_n(1), "APPEND"); return true;
      case 'e': append(pop_mark(), "APPENDS"); return true;
      case '}': push(make(Kind::kDict)); return true;  // EMPTY_DICT
      case 'd': {  // DICT: the items above the mark become a new dict in the mark's place
        std::vector<PyRef> items = pop_mark();
        push(make(Kind::kDict));
        set_items(std::move(items), "DICT");
        return true;
      }
      case 's': set_items(pop_n(2), "SETITEM"); return true;
      case 'u': set_items(pop_mark(), "SETITEMS"); return true;
      default: return false;
    }
  }
  bool object_op(unsigned char op) {
    switch (op) {
      case 'q': memo_[static_cast<uint32_t>(little_endian(1))] = top(); return true;   // BINPUT
      case 'r': memo_[static_cast<uint32_t>(little_endian(4))] = top(); return true;   // LONG_BINPUT
      case 'h': push(memo_get(static_cast<uint32_t>(little_endian(1)))); return true;  // BINGET
      case 'j': push(memo_get(static_cast<uint32_t>(little_endian(4)))); return true;  // LONG_BINGET
      case 'c': {                                                                      // GLOBAL
        std::string module = line();
        std::string name = module + "." + line();
        if (options_.only_tensor_globals && !tensor_global(name)) {
          fail("GLOBAL '" + name + "' is not one a tensor or a plain value needs; it is refused, never imported");
        }
        push(make_named(Kind::kGlobal, std::move(name)));
        return true;
      }
      case 'R': reduce(); return true;
      case 0x81: {  // NEWOBJ: an instance of a class; nothing a state dict is made of
        const std::vector<PyRef> cls_args = pop_n(2);
        push(make_named(Kind::kOpaque, cls_args[0]->text.empty() ? "object" : cls_args[0]->text));
        return true;
      }
      case 'b': build(); return true;
      case 'Q': push(persistent_load(*pop())); return true;  // BINPERSID
      default: return false;
    }
  }
  static bool tensor_global(const std::string& name) {
    return name == "torch._utils._rebuild_tensor_v2" || name == "collections.OrderedDict" ||
           storage_dtype(name).has_value();
  }
  PyRef memo_get(uint32_t index) {
    const auto it = memo_.find(index);
    if (it == memo_.end()) fail("a reference to memo entry " + std::to_string(index) + ", which was never stored");
    return it->second;
  }

  // BUILD sets an object's attributes from a state. An OrderedDict's attributes (a state dict's
  // _metadata: per-module versions that only Python's load_state_dict hooks read) and those of
  // an opaque object are not part of any tensor: dropped. Anything else is not torch.save's.
  void build() {
    pop();  // the state
    const PyValue& target = *top();
    if (target.kind != Kind::kDict && target.kind != Kind::kOpaque) {
      fail("BUILD applied to a " + py_type_name(target));
    }
  }

  void reduce() {
    const std::vector<PyRef> f_args = pop_n(2);
    const PyValue& f = *f_args[0];
    const PyValue& args = *f_args[1];
    if (f.kind != Kind::kGlobal && f.kind != Kind::kOpaque) fail("REDUCE calls a " + py_type_name(f));
    if (args.kind != Kind::kTuple) fail("REDUCE passes a " + py_type_name(args) + " as the arguments");
    if (f.kind == Kind::kGlobal && f.text == "collections.OrderedDict") {
      if (!args.items.empty()) fail("OrderedDict is called with arguments");
      return push(make(Kind::kDict));
    }
    if (f.kind == Kind::kGlobal && f.text == "torch._utils._rebuild_tensor_v2") return push(rebuild_tensor(args.items));
    if (f.kind == Kind::kGlobal && f.text == "torch._utils._rebuild_parameter") {
      return push(rebuild_parameter(args.items));
    }
    if (f.kind == Kind::kGlobal && f.text == "torch.jit._pickle.restore_type_tag") {  // LibTorch's pickler
      if (args.items.size() != 2) fail("restore_type_tag takes 2 arguments");
      return push(args.items[0]);
    }
    push(make_named(Kind::kOpaque, f.text));  // e.g. a numpy array or an argparse.Namespace
  }

  // ---------------------------------------------------------------- tensors
  PyRef persistent_load(const PyValue& pid) {
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
  const char* data_;
  size_t size_;
  size_t pos_ = 0, op_at_ = 0;
  StorageLoader load_storage_;
  const TorchLoadOptions& options_;
  std::vector<PyRef> stack_;
  std::vector<size_t> marks_;
  std::unordered_map<uint32_t, PyRef> memo_;
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

std::string py_type_name(const PyValue& v) {
  switch (v.kind) {
    case Kind::kNone: return "None";
    case Kind::kBool: return "bool";
    case Kind::kInt: return "int";
    case Kind::kFloat: return "float";
    case Kind::kStr: return "str";
    case Kind::kTuple: return "tuple";
    case Kind::kList: return "list";
    case Kind::kDict: return "dict";
    case Kind::kTensor: return "Tensor";
    case Kind::kStorage: return "storage";
    case Kind::kGlobal: return "reference to " + v.text;
    case Kind::kOpaque: return v.text;
  }
  return "?";
}

const PyValue* dict_find(const PyValue& d, const std::string& key) {
  const auto it = d.str_keys.find(key);
  return it == d.str_keys.end() ? nullptr : d.items[it->second + 1].get();
}

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
