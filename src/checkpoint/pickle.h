// pickle.h — the one pickle machine under the two pickles this layer reads: torch.save's
// data.pkl (torch_load.cpp) and a DCP checkpoint's .metadata (dcp_metadata.cpp). It owns what
// the two have in common: the bounded reads, the stack and its MARKs, the memo, the plain values
// (None, bools, ints, floats, strings) and the containers (tuples, lists, dicts), each opcode
// checked against the stack it needs, every container frozen once stored in another (no cycles)
// and nesting bounded (no deep recursion anywhere).
//
// What a GLOBAL, a REDUCE, a NEWOBJ, a BUILD or a persistent id means is the reader's: a subclass
// says which names it accepts and what each call builds. The machine itself never imports,
// calls or executes anything a pickle names.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

namespace fsdp {
namespace detail {

// One Python object of a pickle.
struct PyValue {
  enum class Kind {
    kNone,
    kBool,
    kInt,
    kFloat,
    kStr,
    kTuple,
    kList,
    kDict,
    kTensor,
    kStorage,
    kGlobal,
    kOpaque,
    kObject
  };
  Kind kind = Kind::kNone;
  int64_t integer = 0;  // kBool, kInt; kObject: an enum member's value
  double real = 0;      // kFloat
  std::string text;     // kStr; kGlobal, kOpaque and kObject: the Python name, "module.qualname"
  // kTuple, kList: the elements; kDict: key, value, key, value, ... in insertion order.
  std::vector<std::shared_ptr<PyValue>> items;
  at::Tensor tensor;               // kTensor; kStorage: a 1-D tensor of the storage's dtype over all of it
  std::shared_ptr<PyValue> state;  // kObject: what BUILD gave it (null: none)
  // Bookkeeping of the machine: a container stored inside another is never changed again (no
  // cycles can form), and nesting is bounded.
  bool stored = false;
  int depth = 0;
  std::unordered_map<std::string, size_t> str_keys;  // kDict: string key -> index of its (first) key in items
};
using PyRef = std::shared_ptr<PyValue>;

// The name of a kind, for messages: "int", "str", "dict", "Tensor", "reference", "object".
std::string kind_name(PyValue::Kind kind);
// Python's name of the value's type, for messages: kind_name, "reference to module.name" for a
// GLOBAL, the class's name for an opaque value or an object.
std::string py_type_name(const PyValue& v);

// The value of string key `key` of dict `d`; null when it has none.
const PyValue* dict_find(const PyValue& d, const std::string& key);

// Runs a pickle held in memory, opcode by opcode. Not thread-safe; one run per machine.
class PickleMachine {
 public:
  struct Options {
    int min_protocol = 2, max_protocol = 5;  // a PROTO outside is refused, with protocol_note
    std::string protocol_note;               // e.g. "torch.save writes protocol 2"
    int max_depth = 100;                     // containers nested deeper are refused
    // How the refusal of an unknown opcode ends: "0x.. " + this.
    std::string unknown_opcode = "is not an opcode this reader knows";
    // A repeated string key in one dict: replaced in its place (Python's dict), or kept as a
    // second entry (for a reader that refuses repeated keys itself, naming them).
    bool replace_repeated_keys = true;
  };

  PickleMachine(const char* data, size_t size, Options options);
  virtual ~PickleMachine() = default;
  PickleMachine(const PickleMachine&) = delete;
  PickleMachine& operator=(const PickleMachine&) = delete;

  // Runs to STOP; the one value left. Throws c10::Error (error_message) on anything malformed: a read
  // past the end, an opcode without the values or MARK it needs, a memo reference never stored,
  // a container changed after it was stored or holding itself, nesting past max_depth, more or
  // fewer than one value left; and what the reader's hooks throw.
  PyRef run();

 protected:
  // The whole message of an error saying `what` is wrong, in the reader's words (naming the
  // file); op_at() is the byte of the opcode at fault.
  virtual std::string error_message(const std::string& what) const = 0;
  // Throws c10::Error with error_message(what).
  [[noreturn]] void fail(const std::string& what) const;
  size_t op_at() const { return op_at_; }

  // The opcodes whose meaning is the reader's. Each returns the value pushed in the call's place.
  // GLOBAL and STACK_GLOBAL: a reference to module.name (or a refusal, naming it).
  virtual PyRef global(const std::string& module, const std::string& name) = 0;
  // REDUCE: callable(*args), rebuilt without calling anything.
  virtual PyRef reduce(const PyValue& callable, const PyValue& args) = 0;
  // NEWOBJ: cls.__new__(cls, *args).
  virtual PyRef new_object(const PyValue& cls, const PyValue& args) = 0;
  // BUILD: `state` set on `target`, which stays where it is on the stack.
  virtual void build(PyValue& target, const PyRef& state) = 0;
  // BINPERSID: the object a persistent id names. By default the opcode is refused.
  virtual PyRef persistent_load(const PyValue& pid);

  static PyRef make(PyValue::Kind kind);
  static PyRef make_number(PyValue::Kind kind, int64_t i);
  static PyRef make_named(PyValue::Kind kind, std::string text);
  // Records that `child` is stored in `container`: it never changes again, nesting is bounded.
  void store(PyValue& container, PyValue& child) const;
  // A tuple or list of `items`, each stored in it.
  PyRef sequence(PyValue::Kind kind, std::vector<PyRef> items) const;

 private:
  bool step();
  bool value_op(unsigned char op);
  bool container_op(unsigned char op);
  bool object_op(unsigned char op);
  [[noreturn]] void unknown(unsigned char op) const;

  const char* take(size_t n);
  uint64_t little_endian(size_t n);
  int64_t long1();
  double binfloat();
  std::string text(size_t n) { return std::string(take(n), n); }
  std::string line();

  size_t floor() const { return marks_.empty() ? 0 : marks_.back(); }
  void push(PyRef v) { stack_.push_back(std::move(v)); }
  PyRef& top();
  PyRef pop();
  std::vector<PyRef> pop_n(size_t n);
  std::vector<PyRef> pop_mark();
  PyValue& mutable_container(PyValue::Kind kind, const char* opcode);
  void append(std::vector<PyRef> items, const char* opcode);
  void set_items(std::vector<PyRef> items, const char* opcode);
  void memo_put(uint64_t index);
  PyRef memo_get(uint64_t index);

  const char* data_;
  size_t size_;
  Options options_;
  size_t pos_ = 0, op_at_ = 0;
  std::vector<PyRef> stack_;
  std::vector<size_t> marks_;
  std::unordered_map<uint64_t, PyRef> memo_;
};

}  // namespace detail
}  // namespace fsdp
