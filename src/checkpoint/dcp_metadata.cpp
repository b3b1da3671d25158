// The `.metadata` pickle of a DCP checkpoint: a strict unpickler that builds a tree of plain
// values and the few DCP classes (never importing or calling anything), the conversion of that
// tree into checked records, and the writer of the same pickle for Python to read.
#include "src/checkpoint/dcp_metadata.h"

#include "src/checkpoint/checkpoint_metadata.h"  // printable()

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <set>
#include <unordered_map>

namespace fsdp {
namespace detail {
namespace {

namespace fs = std::filesystem;

const std::string kMeta = "torch.distributed.checkpoint.metadata.";
const std::string kStorageInfo = "torch.distributed.checkpoint.filesystem._StorageInfo";

// The dtypes DCP metadata may name, by the name torch pickles them under.
const std::map<std::string, at::ScalarType>& dtype_table() {
  static const std::map<std::string, at::ScalarType> table = {{"float32", at::kFloat},
                                                              {"float64", at::kDouble},
                                                              {"float16", at::kHalf},
                                                              {"bfloat16", at::kBFloat16},
                                                              {"int64", at::kLong},
                                                              {"int32", at::kInt},
                                                              {"int16", at::kShort},
                                                              {"int8", at::kChar},
                                                              {"uint8", at::kByte},
                                                              {"bool", at::kBool},
                                                              {"complex64", at::kComplexFloat},
                                                              {"complex128", at::kComplexDouble}};
  return table;
}

// Every GLOBAL a DCP .metadata may name. The classes are only ever constructed as inert records
// here; anything else is refused when its GLOBAL is read.
bool allowed_global(const std::string& name) {
  static const std::set<std::string> allowed = {
      kMeta + "Metadata", kMeta + "TensorStorageMetadata", kMeta + "BytesStorageMetadata",
      kMeta + "ChunkStorageMetadata", kMeta + "TensorProperties", kMeta + "MetadataIndex", kMeta + "StorageMeta",
      kMeta + "_MEM_FORMAT_ENCODING", kStorageInfo, "torch.Size", "torch.serialization._get_layout",
      // StorageMeta.checkpoint_id is the pathlib path dcp.save was given (its module moved in Python 3.13).
      "pathlib.PosixPath", "pathlib._local.PosixPath"};
  if (allowed.count(name)) return true;
  return name.rfind("torch.", 0) == 0 && dtype_table().count(name.substr(6));
}

struct Val;
using Ref = std::shared_ptr<Val>;
struct Val {
  enum class K { kNone, kBool, kInt, kFloat, kStr, kTuple, kList, kDict, kGlobal, kObject };
  K k = K::kNone;
  int64_t i = 0;
  double f = 0;
  std::string s;           // kStr; kGlobal and kObject: the class, "module.name"
  std::vector<Ref> items;  // kTuple, kList; kDict: key, value, key, value, ...
  Ref state;               // kObject: what BUILD gave it (null: none)
  bool stored = false;     // inside another container: never changed again (no cycles)
  int depth = 0;
};
using K = Val::K;

constexpr int kMaxDepth = 64;

// The name of a kind of value, for a message that expects one.
std::string kind_name(K k) {
  switch (k) {
    case K::kNone: return "None";
    case K::kBool: return "bool";
    case K::kInt: return "int";
    case K::kFloat: return "float";
    case K::kStr: return "str";
    case K::kTuple: return "tuple";
    case K::kList: return "list";
    case K::kDict: return "dict";
    case K::kGlobal: return "reference";
    case K::kObject: return "object";
  }
  return "?";
}

// The name of a value's type: its class for a reference or an object.
std::string type_name(const Val& v) {
  if (v.k == K::kGlobal) return "reference to " + v.s;
  if (v.k == K::kObject) return v.s;
  return kind_name(v.k);
}

Ref make(K k) {
  auto v = std::make_shared<Val>();
  v->k = k;
  return v;
}

// The unpickler. Errors say where (the byte of the opcode) and what.
class Reader {
 public:
  Reader(const std::string& who, const std::string& path, const std::string& data)
      : who_(who), path_(path), data_(data) {}

  Ref run() {
    while (step()) {
    }
    if (stack_.size() != 1 || !marks_.empty())
      fail("the pickle ends with " + std::to_string(stack_.size()) + " values");
    return stack_.back();
  }

 private:
  [[noreturn]] void fail(const std::string& what) const {
    TORCH_CHECK(false, who_, "'", path_, "' is not a DCP .metadata this reader accepts: ", what, " (at byte ", at_,
                "); a checkpoint written by torch.distributed.checkpoint.save has none of this");
  }
  const char* take(uint64_t n) {
    if (n > data_.size() - pos_) fail("the pickle is truncated");
    const char* p = data_.data() + pos_;
    pos_ += n;
    return p;
  }
  uint64_t le(size_t n) {
    const auto* p = reinterpret_cast<const unsigned char*>(take(n));
    uint64_t v = 0;
    for (size_t i = n; i-- > 0;) v = (v << 8) | p[i];
    return v;
  }
  std::string text(uint64_t n) { return std::string(take(n), n); }
  std::string line() {
    const size_t nl = data_.find('\n', pos_);
    if (nl == std::string::npos) fail("a GLOBAL name is not terminated");
    std::string s = text(nl - pos_);
    take(1);
    return s;
  }

  size_t floor() const { return marks_.empty() ? 0 : marks_.back(); }
  void push(Ref v) { stack_.push_back(std::move(v)); }
  Ref& top() {
    if (stack_.size() <= floor()) fail("an opcode needs a value the stack does not hold");
    return stack_.back();
  }
  Ref pop() {
    Ref v = top();
    stack_.pop_back();
    return v;
  }
  std::vector<Ref> pop_n(size_t n) {
    if (stack_.size() < floor() + n) fail("an opcode needs values the stack does not hold");
    std::vector<Ref> out(stack_.end() - static_cast<std::ptrdiff_t>(n), stack_.end());
    stack_.resize(stack_.size() - n);
    return out;
  }
  std::vector<Ref> pop_mark() {
    if (marks_.empty()) fail("an opcode needs a MARK that was never set");
    const size_t m = marks_.back();
    marks_.pop_back();
    std::vector<Ref> out(stack_.begin() + static_cast<std::ptrdiff_t>(m), stack_.end());
    stack_.resize(m);
    return out;
  }
  void store(Val& container, Val& child) {
    if (&container == &child) fail("a container holds itself");
    child.stored = true;
    container.depth = std::max(container.depth, child.depth + 1);
    if (container.depth > kMaxDepth) fail("values nest deeper than " + std::to_string(kMaxDepth) + " levels");
  }
  Val& mutable_top(K k, const char* op) {
    Val& c = *top();
    if (c.k != k) fail(std::string(op) + " applied to a " + type_name(c));
    if (c.stored) fail(std::string(op) + " changes a container already stored in another");
    return c;
  }
  Ref sequence(K k, std::vector<Ref> items) {
    Ref v = make(k);
    for (const Ref& item : items) store(*v, *item);
    v->items = std::move(items);
    return v;
  }
  void append(std::vector<Ref> items, const char* op) {
    Val& list = mutable_top(K::kList, op);
    for (Ref& item : items) {
      store(list, *item);
      list.items.push_back(std::move(item));
    }
  }
  void set_items(std::vector<Ref> items, const char* op) {
    if (items.size() % 2 != 0) fail(std::string(op) + " with a key and no value");
    Val& dict = mutable_top(K::kDict, op);
    for (Ref& item : items) {
      store(dict, *item);
      dict.items.push_back(std::move(item));
    }
  }
  Ref global(const std::string& module, const std::string& name) {
    const std::string full = module + "." + name;
    if (!allowed_global(full)) {
      fail("GLOBAL '" + printable(full) + "' is not a class DCP metadata holds; it is refused, never imported");
    }
    Ref v = make(K::kGlobal);
    v->s = full;
    return v;
  }
  Ref memo_get(uint64_t index) {
    const auto it = memo_.find(index);
    if (it == memo_.end()) fail("a reference to memo entry " + std::to_string(index) + ", never stored");
    return it->second;
  }
  void memo_put(uint64_t index) {
    if (memo_.size() > data_.size()) fail("more memo entries than bytes");
    memo_[index] = top();
  }

  bool step() {
    at_ = pos_;
    const auto op = static_cast<unsigned char>(*take(1));
    switch (op) {
      case '.': return false;  // STOP
      case 0x80: {             // PROTO
        const uint64_t p = le(1);
        if (p < 2 || p > 5) fail("pickle protocol " + std::to_string(p));
        return true;
      }
      case 0x95: le(8); return true;  // FRAME: a length hint; every read is bounds-checked anyway
      case 'N': push(make(K::kNone)); return true;
      case 0x88:
      case 0x89: {  // NEWTRUE, NEWFALSE
        Ref v = make(K::kBool);
        v->i = op == 0x88;
        push(v);
        return true;
      }
      case 'K':
      case 'M':
      case 'J': {  // BININT1, BININT2, BININT
        Ref v = make(K::kInt);
        v->i = op == 'K'   ? static_cast<int64_t>(le(1))
               : op == 'M' ? static_cast<int64_t>(le(2))
                           : static_cast<int32_t>(le(4));
        push(v);
        return true;
      }
      case 0x8a: {  // LONG1
        const size_t n = static_cast<size_t>(le(1));
        if (n > 8) fail("an integer wider than 64 bits");
        Ref v = make(K::kInt);
        if (n > 0) {
          const uint64_t raw = le(n);
          const int shift = static_cast<int>(64 - 8 * n);
          v->i = shift == 0 ? static_cast<int64_t>(raw) : static_cast<int64_t>(raw << shift) >> shift;
        }
        push(v);
        return true;
      }
      case 'G': {  // BINFLOAT, big-endian
        uint64_t bits = 0;
        const auto* p = reinterpret_cast<const unsigned char*>(take(8));
        for (int i = 0; i < 8; ++i) bits = (bits << 8) | p[i];
        Ref v = make(K::kFloat);
        std::memcpy(&v->f, &bits, sizeof bits);
        push(v);
        return true;
      }
      case 0x8c:
      case 'X':
      case 0x8d: {  // SHORT_BINUNICODE, BINUNICODE, BINUNICODE8
        Ref v = make(K::kStr);
        v->s = text(le(op == 0x8c ? 1 : op == 'X' ? 4 : 8));
        push(v);
        return true;
      }
      case '(': marks_.push_back(stack_.size()); return true;
      case ')': push(make(K::kTuple)); return true;
      case 't': push(sequence(K::kTuple, pop_mark())); return true;
      case 0x85:
      case 0x86:
      case 0x87: push(sequence(K::kTuple, pop_n(op - 0x84))); return true;
      case ']': push(make(K::kList)); return true;
      case 'l': push(sequence(K::kList, pop_mark())); return true;
      case 'a': append(pop_n(1), "APPEND"); return true;
      case 'e': append(pop_mark(), "APPENDS"); return true;
      case '}': push(make(K::kDict)); return true;
      case 'd': {
        std::vector<Ref> items = pop_mark();
        push(make(K::kDict));
        set_items(std::move(items), "DICT");
        return true;
      }
      case 's': set_items(pop_n(2), "SETITEM"); return true;
      case 'u': set_items(pop_mark(), "SETITEMS"); return true;
      case 0x94: memo_put(memo_.size()); return true;  // MEMOIZE
      case 'q': memo_put(le(1)); return true;          // BINPUT
      case 'r': memo_put(le(4)); return true;          // LONG_BINPUT
      case 'h': push(memo_get(le(1))); return true;    // BINGET
      case 'j': push(memo_get(le(4))); return true;    // LONG_BINGET
      case 'c': {
        const std::string module = line();
        push(global(module, line()));
        return true;
      }
      case 0x93: {  // STACK_GLOBAL
        const std::vector<Ref> mn = pop_n(2);
        if (mn[0]->k != K::kStr || mn[1]->k != K::kStr) fail("STACK_GLOBAL of a non-string name");
        push(global(mn[0]->s, mn[1]->s));
        return true;
      }
      case 0x81: newobj(); return true;
      case 'b': build(); return true;
      case 'R': reduce(); return true;
      default: {
        char hex[8];
        std::snprintf(hex, sizeof hex, "0x%02x", op);
        fail(std::string("opcode ") + hex + " is not one DCP metadata uses");
      }
    }
  }

  // NEWOBJ: cls.__new__(cls) of a DCP record class: an empty record BUILD fills in.
  void newobj() {
    const std::vector<Ref> ca = pop_n(2);
    if (ca[0]->k != K::kGlobal || ca[1]->k != K::kTuple || !ca[1]->items.empty()) {
      fail("NEWOBJ of a " + type_name(*ca[0]) + " with arguments");
    }
    const std::string& cls = ca[0]->s;
    if (cls.rfind(kMeta, 0) != 0 && cls != kStorageInfo) fail("NEWOBJ of " + cls + ", which is no DCP record");
    if (cls == kMeta + "_MEM_FORMAT_ENCODING") fail("NEWOBJ of an enum");
    Ref v = make(K::kObject);
    v->s = cls;
    push(v);
  }
  void build() {
    Ref state = pop();
    Val& obj = *top();
    if (obj.k != K::kObject || obj.state || obj.stored) fail("BUILD applied to a " + type_name(obj));
    store(obj, *state);
    obj.state = state;
  }
  // The only calls DCP metadata makes, rebuilt here without calling anything.
  void reduce() {
    const std::vector<Ref> fa = pop_n(2);
    const Val& f = *fa[0];
    const Val& args = *fa[1];
    if (f.k != K::kGlobal || args.k != K::kTuple) fail("REDUCE of a " + type_name(f));
    const auto one = [&](K k) -> const Val& {
      if (args.items.size() != 1 || args.items[0]->k != k) fail(f.s + " called with other arguments than DCP's");
      return *args.items[0];
    };
    if (f.s == "torch.Size") {
      const Val& dims = one(K::kTuple);
      for (const Ref& d : dims.items) {
        if (d->k != K::kInt || d->i < 0) fail("a torch.Size holding a " + type_name(*d) + " or a negative size");
      }
      return push(sequence(K::kTuple, dims.items));
    }
    if (f.s == "torch.serialization._get_layout") {
      if (one(K::kStr).s != "torch.strided")
        fail("tensor layout '" + printable(one(K::kStr).s) + "' (only torch.strided is supported)");
      Ref v = make(K::kGlobal);
      v->s = "torch.strided";
      return push(v);
    }
    if (f.s == kMeta + "_MEM_FORMAT_ENCODING") {
      Ref v = make(K::kObject);
      v->s = f.s;
      v->i = one(K::kInt).i;
      return push(v);
    }
    if (f.s == "pathlib.PosixPath" || f.s == "pathlib._local.PosixPath") {
      Ref v = make(K::kStr);
      for (const Ref& part : args.items) {
        if (part->k != K::kStr) fail("a PosixPath of a " + type_name(*part));
        v->s += (v->s.empty() || v->s.back() == '/' ? "" : "/") + part->s;
      }
      return push(v);
    }
    fail("REDUCE calls " + f.s + ", which DCP metadata never calls");
  }

  const std::string& who_;
  const std::string& path_;
  const std::string& data_;
  size_t pos_ = 0, at_ = 0;
  std::vector<Ref> stack_;
  std::vector<size_t> marks_;
  std::unordered_map<uint64_t, Ref> memo_;
};

// ------------------------------------------------------------------ the tree -> records

class Converter {
 public:
  Converter(const std::string& who, const std::string& path) : who_(who), path_(path) {}

  DcpMetadata convert(const Val& root) {
    DcpMetadata meta;
    meta.path = path_;
    const Val& state = object_state(root, kMeta + "Metadata", "the top-level object");
    const Val* version = field(state, "version", "Metadata", false);
    if (version && version->k != K::kNone && !(version->k == K::kStr && version->s == "1.0.0")) {
      fail("Metadata.version is " + describe(*version) +
           "; this reader knows DCP version 1.0.0 (torch 2.15 writes it) and checkpoints without a version");
    }
    const Val& sdm = *field(state, "state_dict_metadata", "Metadata", true);
    expect(sdm, K::kDict, "Metadata.state_dict_metadata");
    for (size_t i = 0; i < sdm.items.size(); i += 2) {
      expect(*sdm.items[i], K::kStr, "a key of Metadata.state_dict_metadata");
      const std::string& key = sdm.items[i]->s;
      if (meta.entries.count(key)) fail("key '" + printable(key) + "' is listed twice");
      meta.entries[key] = entry(key, *sdm.items[i + 1]);
    }
    const Val& sd = *field(state, "storage_data", "Metadata", true);
    expect(sd, K::kDict, "Metadata.storage_data");
    std::map<std::pair<std::string, std::vector<int64_t>>, bool> seen;
    for (size_t i = 0; i < sd.items.size(); i += 2) place(meta, *sd.items[i], *sd.items[i + 1], &seen);
    for (auto& [key, e] : meta.entries) check_complete(key, e);
    return meta;
  }

 private:
  [[noreturn]] void fail(const std::string& what) const { TORCH_CHECK(false, who_, "'", path_, "': ", what); }
  static std::string describe(const Val& v) { return v.k == K::kStr ? "'" + printable(v.s) + "'" : type_name(v); }
  void expect(const Val& v, K k, const std::string& where) const {
    if (v.k != k) fail(where + " is a " + type_name(v) + ", not a " + kind_name(k));
  }
  const Val& object_state(const Val& v, const std::string& cls, const std::string& where) const {
    if (v.k != K::kObject || v.s != cls) fail(where + " is a " + type_name(v) + ", not a " + cls);
    if (!v.state) fail(where + " (" + cls + ") has no fields");
    return *v.state;
  }
  // Field `name` of a record's state dict; null when absent (an error when `required`).
  const Val* field(const Val& state, const std::string& name, const std::string& cls, bool required) const {
    expect(state, K::kDict, "the fields of a " + cls);
    for (size_t i = 0; i < state.items.size(); i += 2) {
      if (state.items[i]->k == K::kStr && state.items[i]->s == name) return state.items[i + 1].get();
    }
    if (required) fail(cls + " has no field '" + name + "'");
    return nullptr;
  }
  std::vector<int64_t> ints(const Val& v, const std::string& where) const {
    expect(v, K::kTuple, where);
    std::vector<int64_t> out;
    for (const Ref& d : v.items) {
      if (d->k != K::kInt || d->i < 0) fail(where + " holds a " + describe(*d) + ", not a size");
      out.push_back(d->i);
    }
    return out;
  }

  DcpEntry entry(const std::string& key, const Val& v) const {
    DcpEntry e;
    const std::string where = "key '" + printable(key) + "'";
    if (v.k == K::kObject && v.s == kMeta + "BytesStorageMetadata") {
      if (v.state && !(v.state->k == K::kDict && v.state->items.empty()) && v.state->k != K::kNone) {
        fail(where + ": a BytesStorageMetadata with fields");
      }
      e.is_bytes = true;
      return e;
    }
    const Val& st = object_state(v, kMeta + "TensorStorageMetadata", where);
    e.dtype = properties_dtype(*field(st, "properties", "TensorStorageMetadata", true), where);
    e.shape = ints(*field(st, "size", "TensorStorageMetadata", true), where + ": size");
    const Val& chunks = *field(st, "chunks", "TensorStorageMetadata", true);
    expect(chunks, K::kList, where + ": chunks");
    for (size_t i = 0; i < chunks.items.size(); ++i) {
      const std::string at = where + ": chunks[" + std::to_string(i) + "]";
      const Val& cs = object_state(*chunks.items[i], kMeta + "ChunkStorageMetadata", at);
      DcpChunk c;
      c.offsets = ints(*field(cs, "offsets", "ChunkStorageMetadata", true), at + ".offsets");
      c.sizes = ints(*field(cs, "sizes", "ChunkStorageMetadata", true), at + ".sizes");
      if (c.offsets.size() != e.shape.size() || c.sizes.size() != e.shape.size()) {
        fail(at + " has " + std::to_string(c.offsets.size()) + " offsets and " + std::to_string(c.sizes.size()) +
             " sizes for a shape of " + std::to_string(e.shape.size()) + " dims");
      }
      for (size_t d = 0; d < e.shape.size(); ++d) {
        if (c.offsets[d] > e.shape[d] || c.sizes[d] > e.shape[d] - c.offsets[d]) {
          fail(at + " reaches index " + std::to_string(c.offsets[d]) + "+" + std::to_string(c.sizes[d]) + " of dim " +
               std::to_string(d) + ", outside the shape's " + std::to_string(e.shape[d]));
        }
      }
      e.chunks.push_back(std::move(c));
    }
    check_tiling(where, e);
    return e;
  }

  at::ScalarType properties_dtype(const Val& v, const std::string& where) const {
    if (v.k != K::kObject || v.s != kMeta + "TensorProperties" || !v.state) {
      fail(where + ": properties is a " + type_name(v) + ", not a TensorProperties");
    }
    const Val& t = *v.state;  // TensorProperties.__getstate__: (dtype, layout, requires_grad, format, pin[, strides])
    if (t.k != K::kTuple || (t.items.size() != 5 && t.items.size() != 6)) {
      fail(where + ": the TensorProperties state is a " + type_name(t) + " of other fields than DCP writes");
    }
    const Val& dtype = *t.items[0];
    if (dtype.k != K::kGlobal || dtype.s.rfind("torch.", 0) != 0 || !dtype_table().count(dtype.s.substr(6))) {
      fail(where + ": dtype is a " + type_name(dtype));
    }
    if (t.items[1]->k != K::kGlobal || t.items[1]->s != "torch.strided")
      fail(where + ": a layout other than torch.strided");
    const Val& format = *t.items[3];
    if (format.k != K::kObject || format.s != kMeta + "_MEM_FORMAT_ENCODING" || format.i < 0 || format.i > 2) {
      fail(where + ": memory format is a " + type_name(format));
    }
    return dtype_table().at(dtype.s.substr(6));
  }

  // Chunks with elements must not overlap and must cover the shape; empty ones hold nothing.
  void check_tiling(const std::string& where, const DcpEntry& e) const {
    int64_t total = 1;
    for (int64_t s : e.shape) {
      if (__builtin_mul_overflow(total, s, &total)) fail(where + ": its shape holds more elements than fit in 64 bits");
    }
    if (int64_t bytes = 0; __builtin_mul_overflow(total, static_cast<int64_t>(c10::elementSize(e.dtype)), &bytes)) {
      fail(where + ": its shape holds more bytes than fit in 64 bits");
    }
    std::vector<const DcpChunk*> full;
    for (const DcpChunk& c : e.chunks) {
      bool empty = false;
      for (int64_t s : c.sizes) empty = empty || s == 0;
      if (!empty || e.shape.empty()) full.push_back(&c);
    }
    if (total == 0) return;
    if (e.shape.empty()) {
      if (full.size() != 1) fail(where + " is a scalar stored in " + std::to_string(full.size()) + " chunks, not one");
      return;
    }
    if (full.size() > 65536)
      fail(where + " has " + std::to_string(full.size()) + " chunks, more than this reader checks");
    int64_t covered = 0;
    for (size_t i = 0; i < full.size(); ++i) {
      int64_t n = 1;
      for (int64_t s : full[i]->sizes) n *= s;  // inside the shape (checked): no overflow
      covered += n;
      for (size_t j = i + 1; j < full.size(); ++j) {
        bool overlap = true;
        for (size_t d = 0; d < e.shape.size() && overlap; ++d) {
          const DcpChunk &a = *full[i], &b = *full[j];
          overlap = a.offsets[d] < b.offsets[d] + b.sizes[d] && b.offsets[d] < a.offsets[d] + a.sizes[d];
        }
        if (overlap) fail(where + " has overlapping chunks");
      }
      if (covered > total) fail(where + " has chunks holding more elements than its shape");
    }
    if (covered != total) {
      fail(where + " has gaps: its chunks hold " + std::to_string(covered) + " of its " + std::to_string(total) +
           " elements");
    }
  }

  // A storage record: its MetadataIndex names an entry (and, for a tensor, a chunk's offsets).
  void place(DcpMetadata& meta, const Val& index, const Val& info,
             std::map<std::pair<std::string, std::vector<int64_t>>, bool>* seen) const {
    const Val& is = object_state(index, kMeta + "MetadataIndex", "a key of Metadata.storage_data");
    const Val& fqn = *field(is, "fqn", "MetadataIndex", true);
    expect(fqn, K::kStr, "MetadataIndex.fqn");
    const std::string where = "the storage record of key '" + printable(fqn.s) + "'";
    const Val* offset = field(is, "offset", "MetadataIndex", false);
    const bool has_offset = offset && offset->k != K::kNone;
    const std::vector<int64_t> offsets = has_offset ? ints(*offset, where + ": offset") : std::vector<int64_t>{};
    if (!seen->emplace(std::make_pair(fqn.s, offsets), has_offset).second) fail(where + " is listed twice");
    const auto e = meta.entries.find(fqn.s);
    if (e == meta.entries.end()) fail(where + ": no such key in state_dict_metadata");
    const DcpStorage storage = storage_info(info, where);
    if (e->second.is_bytes) {
      if (has_offset) fail(where + " has a tensor offset, but the key is a BYTE_IO value");
      e->second.bytes = storage;
      return;
    }
    if (!has_offset) fail(where + " has no offset, but the key is a tensor");
    for (DcpChunk& c : e->second.chunks) {
      if (c.offsets == offsets) {
        c.storage = storage;
        return;
      }
    }
    fail(where + " is for a chunk at offsets the key's chunks do not list");
  }

  DcpStorage storage_info(const Val& v, const std::string& where) const {
    const Val& st = object_state(v, kStorageInfo, where);
    DcpStorage s;
    const Val& path = *field(st, "relative_path", "_StorageInfo", true);
    expect(path, K::kStr, where + ": relative_path");
    if (!plain_data_file(path.s)) {
      fail(where + ": relative_path '" + printable(path.s) +
           "' is not a data file __<rank>_<n>.distcp of the checkpoint");
    }
    s.file = path.s;
    const Val& off = *field(st, "offset", "_StorageInfo", true);
    const Val& len = *field(st, "length", "_StorageInfo", true);
    if (off.k != K::kInt || len.k != K::kInt || off.i < 0 || len.i < 0 || off.i > INT64_MAX - len.i) {
      fail(where + ": offset " + describe(off) + " or length " + describe(len) + " out of range");
    }
    s.offset = off.i;
    s.length = len.i;
    const Val* t = field(st, "transform_descriptors", "_StorageInfo", false);
    if (t && t->k != K::kNone && !((t->k == K::kList || t->k == K::kTuple) && t->items.empty())) {
      fail(where +
           " has transform descriptors (a DCP saved with _extensions, e.g. compression), which this reader "
           "does not support: save it without _extensions");
    }
    return s;
  }

  static bool plain_data_file(const std::string& name) {
    // __<digits>_<digits>.distcp, as FileSystemWriter names its files.
    const std::string suffix = ".distcp";
    if (name.size() < 2 + 1 + 1 + 1 + suffix.size() || name.size() > 64 || name.compare(0, 2, "__") != 0 ||
        name.compare(name.size() - suffix.size(), suffix.size(), suffix) != 0) {
      return false;
    }
    const std::string mid = name.substr(2, name.size() - 2 - suffix.size());
    const size_t us = mid.find('_');
    if (us == std::string::npos || us == 0 || us + 1 == mid.size()) return false;
    for (size_t i = 0; i < mid.size(); ++i) {
      if (i != us && (mid[i] < '0' || mid[i] > '9')) return false;
    }
    return true;
  }

  void check_complete(const std::string& key, const DcpEntry& e) const {
    if (e.is_bytes) {
      if (e.bytes.file.empty()) fail("key '" + printable(key) + "' (a BYTE_IO value) has no storage record");
      return;
    }
    for (const DcpChunk& c : e.chunks) {
      bool empty = false;
      for (int64_t s : c.sizes) empty = empty || s == 0;
      if (c.storage.file.empty() && (!empty || e.shape.empty())) {
        fail("key '" + printable(key) + "' has a chunk without a storage record");
      }
    }
  }

  const std::string& who_;
  const std::string& path_;
};

// ------------------------------------------------------------------ writing

void size_value(PickleWriter& w, const std::vector<int64_t>& dims) {
  w.global("torch", "Size");
  w.mark();
  w.mark();
  for (int64_t d : dims) w.integer(d);
  w.tuple();
  w.tuple();
  w.reduce();
}

// A dataclass instance: cls.__new__(cls), then BUILD with the dict `fields` writes between mark and dict.
template <typename Fields>
void record(PickleWriter& w, const std::string& module, const std::string& cls, Fields fields) {
  w.global(module, cls);
  w.empty_tuple();
  w.newobj();
  w.mark();
  fields();
  w.dict();
  w.build();
}

const char* kMetaModule = "torch.distributed.checkpoint.metadata";

void tensor_metadata(PickleWriter& w, const DcpEntry& e) {
  record(w, kMetaModule, "TensorStorageMetadata", [&] {
    w.str("properties");
    w.global(kMetaModule, "TensorProperties");
    w.empty_tuple();
    w.newobj();
    w.mark();  // TensorProperties.__setstate__'s tuple
    w.global("torch", dcp_dtype_name(e.dtype));
    w.global("torch.serialization", "_get_layout");
    w.mark();
    w.str("torch.strided");
    w.tuple();
    w.reduce();
    w.boolean(false);
    w.global(kMetaModule, "_MEM_FORMAT_ENCODING");
    w.mark();
    w.integer(0);  // TORCH_CONTIGUOUS_FORMAT
    w.tuple();
    w.reduce();
    w.boolean(false);
    w.mark();  // the contiguous strides of the global shape
    int64_t stride = 1;
    std::vector<int64_t> strides(e.shape.size());
    for (size_t d = e.shape.size(); d-- > 0;) {
      strides[d] = stride;
      stride *= std::max<int64_t>(e.shape[d], 1);
    }
    for (int64_t s : strides) w.integer(s);
    w.tuple();
    w.tuple();
    w.build();
    w.str("size");
    size_value(w, e.shape);
    w.str("chunks");
    w.mark();
    for (const DcpChunk& c : e.chunks) {
      record(w, kMetaModule, "ChunkStorageMetadata", [&] {
        w.str("offsets");
        size_value(w, c.offsets);
        w.str("sizes");
        size_value(w, c.sizes);
      });
    }
    w.list();
  });
}

void storage_record(PickleWriter& w, const std::string& key, const std::vector<int64_t>* offsets, int64_t index,
                    const DcpStorage& s) {
  record(w, kMetaModule, "MetadataIndex", [&] {
    w.str("fqn");
    w.str(key);
    w.str("offset");
    if (offsets) size_value(w, *offsets);
    else w.none();
    w.str("index");
    if (offsets) w.integer(index);
    else w.none();
  });
  record(w, "torch.distributed.checkpoint.filesystem", "_StorageInfo", [&] {
    w.str("relative_path");
    w.str(s.file);
    w.str("offset");
    w.integer(s.offset);
    w.str("length");
    w.integer(s.length);
  });
}

}  // namespace

void PickleWriter::integer(int64_t v) {
  if (v >= 0 && v < 256) {
    out += 'K';
    out += static_cast<char>(v);
  } else if (v >= 0 && v < 65536) {
    out += 'M';
    out += static_cast<char>(v & 0xff);
    out += static_cast<char>(v >> 8);
  } else if (v >= INT32_MIN && v <= INT32_MAX) {
    out += 'J';
    const auto u = static_cast<uint32_t>(static_cast<int32_t>(v));
    for (int i = 0; i < 4; ++i) out += static_cast<char>((u >> (8 * i)) & 0xff);
  } else {
    out += '\x8a';  // LONG1: 8 bytes, two's complement, little-endian
    out += '\x08';
    const auto u = static_cast<uint64_t>(v);
    for (int i = 0; i < 8; ++i) out += static_cast<char>((u >> (8 * i)) & 0xff);
  }
}

void PickleWriter::real(double v) {
  uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof bits);
  out += 'G';
  for (int i = 7; i >= 0; --i) out += static_cast<char>((bits >> (8 * i)) & 0xff);
}

void PickleWriter::str(const std::string& s) {
  out += 'X';
  const auto n = static_cast<uint32_t>(s.size());
  for (int i = 0; i < 4; ++i) out += static_cast<char>((n >> (8 * i)) & 0xff);
  out += s;
}

void PickleWriter::global(const std::string& module, const std::string& name) {
  out += 'c' + module + '\n' + name + '\n';
}

std::string dcp_dtype_name(at::ScalarType dtype) {
  for (const auto& [name, t] : dtype_table()) {
    if (t == dtype) return name;
  }
  TORCH_CHECK(false, "fsdp::save_dcp: dtype ", dtype,
              " has no DCP name this writer knows; convert the tensor to one "
              "of float32, float64, float16, bfloat16, int64, int32, int16, int8, uint8, bool, complex64, complex128");
}

DcpMetadata read_dcp_metadata(const std::string& dir, const std::string& who) {
  const std::string path = (fs::path(dir) / kDcpMetadataFile).string();
  std::error_code ec;
  TORCH_CHECK(fs::is_directory(dir, ec), who, "'", dir, "' is not a directory (a DCP checkpoint is one)");
  TORCH_CHECK(fs::is_regular_file(path, ec), who, "'", path, "' does not exist: '", dir,
              "' is not a complete DCP checkpoint (torch.distributed.checkpoint.save writes .metadata last)");
  std::ifstream in(path, std::ios::binary);
  TORCH_CHECK(in, who, "cannot open '", path, "'");
  const std::string data((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  try {
    const Ref root = Reader(who, path, data).run();
    return Converter(who, path).convert(*root);
  } catch (const c10::Error&) {
    throw;
  } catch (const std::exception& e) {  // std::bad_alloc for an absurd size
    TORCH_CHECK(false, who, "'", path, "' cannot be read: ", e.what());
  }
}

std::string write_dcp_metadata(const DcpMetadata& meta, const std::string& checkpoint_id, const std::string& save_id) {
  PickleWriter w;
  record(w, kMetaModule, "Metadata", [&] {
    w.str("state_dict_metadata");
    w.mark();
    for (const auto& [key, e] : meta.entries) {
      w.str(key);
      if (e.is_bytes) {
        w.global(kMetaModule, "BytesStorageMetadata");
        w.empty_tuple();
        w.newobj();
      } else {
        tensor_metadata(w, e);
      }
    }
    w.dict();
    w.str("planner_data");
    w.mark();
    for (const auto& [key, path] : meta.planner_paths) {
      w.str(key);
      w.mark();
      for (const DcpMetadata::PathPart& part : path) {
        if (part.index >= 0) w.integer(part.index);
        else w.str(part.name);
      }
      w.tuple();
    }
    w.dict();
    w.str("storage_data");
    w.mark();
    for (const auto& [key, e] : meta.entries) {
      if (e.is_bytes) {
        storage_record(w, key, nullptr, 0, e.bytes);
        continue;
      }
      for (size_t i = 0; i < e.chunks.size(); ++i) {
        storage_record(w, key, &e.chunks[i].offsets, static_cast<int64_t>(i), e.chunks[i].storage);
      }
    }
    w.dict();
    w.str("storage_meta");
    record(w, kMetaModule, "StorageMeta", [&] {
      w.str("checkpoint_id");
      w.str(checkpoint_id);
      w.str("save_id");
      w.str(save_id);
      w.str("load_id");
      w.none();
      w.str("modules");
      w.mark();
      w.list();
    });
    w.str("version");
    w.str("1.0.0");
  });
  w.stop();
  return w.out;
}

}  // namespace detail
}  // namespace fsdp
