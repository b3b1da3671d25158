// The `.metadata` pickle of a DCP checkpoint: a strict reader on the pickle machine of pickle.h
// that builds a tree of plain values and the few DCP classes (never importing or calling
// anything), the conversion of that tree into checked records, and the writer of the same
// pickle for Python to read.
#include "src/checkpoint/dcp_metadata.h"

#include "src/checkpoint/checkpoint_metadata.h"  // printable()
#include "src/checkpoint/pickle.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <set>

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

using Val = PyValue;
using Ref = PyRef;
using K = PyValue::Kind;

PickleMachine::Options metadata_options() {
  PickleMachine::Options o;
  o.min_protocol = 2;
  o.max_protocol = 5;
  o.max_depth = 64;
  o.unknown_opcode = "is not one DCP metadata uses";
  o.replace_repeated_keys = false;  // the converter refuses a key listed twice, naming it
  return o;
}

// The .metadata pickle on the pickle machine (pickle.h): the DCP record classes are built as
// inert objects, the few calls DCP makes are rebuilt, and every other GLOBAL is refused.
class Reader : public PickleMachine {
 public:
  Reader(const std::string& who, const std::string& path, const std::string& data)
      : PickleMachine(data.data(), data.size(), metadata_options()), who_(who), path_(path) {}

 private:
  std::string error_message(const std::string& what) const override {
    return c10::str(who_, "'", path_, "' is not a DCP .metadata this reader accepts: ", what, " (at byte ", op_at(),
                    "); a checkpoint written by torch.distributed.checkpoint.save has none of this");
  }

  Ref global(const std::string& module, const std::string& name) override {
    const std::string full = module + "." + name;
    if (!allowed_global(full)) {
      fail("GLOBAL '" + printable(full) + "' is not a class DCP metadata holds; it is refused, never imported");
    }
    return make_named(K::kGlobal, full);
  }

  // NEWOBJ: cls.__new__(cls) of a DCP record class: an empty record BUILD fills in.
  Ref new_object(const Val& cls, const Val& args) override {
    if (cls.kind != K::kGlobal || args.kind != K::kTuple || !args.items.empty()) {
      fail("NEWOBJ of a " + py_type_name(cls) + " with arguments");
    }
    if (cls.text.rfind(kMeta, 0) != 0 && cls.text != kStorageInfo)
      fail("NEWOBJ of " + cls.text + ", which is no DCP record");
    if (cls.text == kMeta + "_MEM_FORMAT_ENCODING") fail("NEWOBJ of an enum");
    return make_named(K::kObject, cls.text);
  }

  void build(Val& obj, const Ref& state) override {
    if (obj.kind != K::kObject || obj.state || obj.stored) fail("BUILD applied to a " + py_type_name(obj));
    store(obj, *state);
    obj.state = state;
  }

  // The only calls DCP metadata makes, rebuilt here without calling anything.
  Ref reduce(const Val& f, const Val& args) override {
    if (f.kind != K::kGlobal || args.kind != K::kTuple) fail("REDUCE of a " + py_type_name(f));
    const auto one = [&](K k) -> const Val& {
      if (args.items.size() != 1 || args.items[0]->kind != k) fail(f.text + " called with other arguments than DCP's");
      return *args.items[0];
    };
    if (f.text == "torch.Size") {
      const Val& dims = one(K::kTuple);
      for (const Ref& d : dims.items) {
        if (d->kind != K::kInt || d->integer < 0)
          fail("a torch.Size holding a " + py_type_name(*d) + " or a negative size");
      }
      return sequence(K::kTuple, dims.items);
    }
    if (f.text == "torch.serialization._get_layout") {
      if (one(K::kStr).text != "torch.strided")
        fail("tensor layout '" + printable(one(K::kStr).text) + "' (only torch.strided is supported)");
      return make_named(K::kGlobal, "torch.strided");
    }
    if (f.text == kMeta + "_MEM_FORMAT_ENCODING") {
      Ref v = make_named(K::kObject, f.text);
      v->integer = one(K::kInt).integer;
      return v;
    }
    if (f.text == "pathlib.PosixPath" || f.text == "pathlib._local.PosixPath") {
      Ref v = make(K::kStr);
      for (const Ref& part : args.items) {
        if (part->kind != K::kStr) fail("a PosixPath of a " + py_type_name(*part));
        v->text += (v->text.empty() || v->text.back() == '/' ? "" : "/") + part->text;
      }
      return v;
    }
    fail("REDUCE calls " + f.text + ", which DCP metadata never calls");
  }

  const std::string& who_;
  const std::string& path_;
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
    if (version && version->kind != K::kNone && !(version->kind == K::kStr && version->text == "1.0.0")) {
      fail("Metadata.version is " + describe(*version) +
           "; this reader knows DCP version 1.0.0 (torch 2.15 writes it) and checkpoints without a version");
    }
    const Val& sdm = *field(state, "state_dict_metadata", "Metadata", true);
    expect(sdm, K::kDict, "Metadata.state_dict_metadata");
    for (size_t i = 0; i < sdm.items.size(); i += 2) {
      expect(*sdm.items[i], K::kStr, "a key of Metadata.state_dict_metadata");
      const std::string& key = sdm.items[i]->text;
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
  static std::string describe(const Val& v) {
    return v.kind == K::kStr ? "'" + printable(v.text) + "'" : py_type_name(v);
  }
  void expect(const Val& v, K k, const std::string& where) const {
    if (v.kind != k) fail(where + " is a " + py_type_name(v) + ", not a " + kind_name(k));
  }
  const Val& object_state(const Val& v, const std::string& cls, const std::string& where) const {
    if (v.kind != K::kObject || v.text != cls) fail(where + " is a " + py_type_name(v) + ", not a " + cls);
    if (!v.state) fail(where + " (" + cls + ") has no fields");
    return *v.state;
  }
  // Field `name` of a record's state dict; null when absent (an error when `required`).
  const Val* field(const Val& state, const std::string& name, const std::string& cls, bool required) const {
    expect(state, K::kDict, "the fields of a " + cls);
    for (size_t i = 0; i < state.items.size(); i += 2) {
      if (state.items[i]->kind == K::kStr && state.items[i]->text == name) return state.items[i + 1].get();
    }
    if (required) fail(cls + " has no field '" + name + "'");
    return nullptr;
  }
  std::vector<int64_t> ints(const Val& v, const std::string& where) const {
    expect(v, K::kTuple, where);
    std::vector<int64_t> out;
    for (const Ref& d : v.items) {
      if (d->kind != K::kInt || d->integer < 0) fail(where + " holds a " + describe(*d) + ", not a size");
      out.push_back(d->integer);
    }
    return out;
  }

  DcpEntry entry(const std::string& key, const Val& v) const {
    DcpEntry e;
    const std::string where = "key '" + printable(key) + "'";
    if (v.kind == K::kObject && v.text == kMeta + "BytesStorageMetadata") {
      if (v.state && !(v.state->kind == K::kDict && v.state->items.empty()) && v.state->kind != K::kNone) {
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
    if (v.kind != K::kObject || v.text != kMeta + "TensorProperties" || !v.state) {
      fail(where + ": properties is a " + py_type_name(v) + ", not a TensorProperties");
    }
    const Val& t = *v.state;  // TensorProperties.__getstate__: (dtype, layout, requires_grad, format, pin[, strides])
    if (t.kind != K::kTuple || (t.items.size() != 5 && t.items.size() != 6)) {
      fail(where + ": the TensorProperties state is a " + py_type_name(t) + " of other fields than DCP writes");
    }
    const Val& dtype = *t.items[0];
    if (dtype.kind != K::kGlobal || dtype.text.rfind("torch.", 0) != 0 || !dtype_table().count(dtype.text.substr(6))) {
      fail(where + ": dtype is a " + py_type_name(dtype));
    }
    if (t.items[1]->kind != K::kGlobal || t.items[1]->text != "torch.strided")
      fail(where + ": a layout other than torch.strided");
    const Val& format = *t.items[3];
    if (format.kind != K::kObject || format.text != kMeta + "_MEM_FORMAT_ENCODING" || format.integer < 0 ||
        format.integer > 2) {
      fail(where + ": memory format is a " + py_type_name(format));
    }
    return dtype_table().at(dtype.text.substr(6));
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
    const std::string where = "the storage record of key '" + printable(fqn.text) + "'";
    const Val* offset = field(is, "offset", "MetadataIndex", false);
    const bool has_offset = offset && offset->kind != K::kNone;
    const std::vector<int64_t> offsets = has_offset ? ints(*offset, where + ": offset") : std::vector<int64_t>{};
    if (!seen->emplace(std::make_pair(fqn.text, offsets), has_offset).second) fail(where + " is listed twice");
    const auto e = meta.entries.find(fqn.text);
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
    if (!plain_data_file(path.text)) {
      fail(where + ": relative_path '" + printable(path.text) +
           "' is not a data file __<rank>_<n>.distcp of the checkpoint");
    }
    s.file = path.text;
    const Val& off = *field(st, "offset", "_StorageInfo", true);
    const Val& len = *field(st, "length", "_StorageInfo", true);
    if (off.kind != K::kInt || len.kind != K::kInt || off.integer < 0 || len.integer < 0 ||
        off.integer > INT64_MAX - len.integer) {
      fail(where + ": offset " + describe(off) + " or length " + describe(len) + " out of range");
    }
    s.offset = off.integer;
    s.length = len.integer;
    const Val* t = field(st, "transform_descriptors", "_StorageInfo", false);
    if (t && t->kind != K::kNone && !((t->kind == K::kList || t->kind == K::kTuple) && t->items.empty())) {
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
