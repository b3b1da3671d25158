// The pickle machine of pickle.h: bounded reads, the stack, MARKs, the memo, plain values and
// containers. Every read is checked against the end of the data and every opcode against the
// values (and MARK) it needs, before anything is built.
#include "src/checkpoint/pickle.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdio>
#include <cstring>

namespace fsdp {
namespace detail {

using Kind = PyValue::Kind;

std::string kind_name(Kind kind) {
  switch (kind) {
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
    case Kind::kGlobal: return "reference";
    case Kind::kOpaque: return "object";
    case Kind::kObject: return "object";
  }
  return "?";
}

std::string py_type_name(const PyValue& v) {
  if (v.kind == Kind::kGlobal) return "reference to " + v.text;
  if (v.kind == Kind::kOpaque || v.kind == Kind::kObject) return v.text;
  return kind_name(v.kind);
}

const PyValue* dict_find(const PyValue& d, const std::string& key) {
  const auto it = d.str_keys.find(key);
  return it == d.str_keys.end() ? nullptr : d.items[it->second + 1].get();
}

PickleMachine::PickleMachine(const char* data, size_t size, Options options)
    : data_(data), size_(size), options_(std::move(options)) {}

PyRef PickleMachine::run() {
  while (step()) {
  }
  if (stack_.size() != 1 || !marks_.empty()) {
    fail("the pickle stops with " + std::to_string(stack_.size()) + " values and " + std::to_string(marks_.size()) +
         " marks left (one value expected)");
  }
  return stack_.back();
}

PyRef PickleMachine::persistent_load(const PyValue&) { unknown('Q'); }

void PickleMachine::fail(const std::string& what) const { TORCH_CHECK(false, error_message(what)); }

PyRef PickleMachine::make(Kind kind) {
  auto v = std::make_shared<PyValue>();
  v->kind = kind;
  return v;
}
PyRef PickleMachine::make_number(Kind kind, int64_t i) {
  PyRef v = make(kind);
  v->integer = i;
  return v;
}
PyRef PickleMachine::make_named(Kind kind, std::string text) {
  PyRef v = make(kind);
  v->text = std::move(text);
  return v;
}

// ------------------------------------------------------------------ bytes

const char* PickleMachine::take(size_t n) {
  if (n > size_ - pos_) fail("the pickle is truncated");
  const char* p = data_ + pos_;
  pos_ += n;
  return p;
}

uint64_t PickleMachine::little_endian(size_t n) {
  const auto* p = reinterpret_cast<const unsigned char*>(take(n));
  uint64_t v = 0;
  for (size_t i = n; i-- > 0;) v = (v << 8) | p[i];
  return v;
}

// LONG1: up to 8 bytes of two's complement, sign-extended.
int64_t PickleMachine::long1() {
  const size_t n = static_cast<size_t>(little_endian(1));
  if (n > 8) fail("an integer wider than 64 bits");
  if (n == 0) return 0;
  const uint64_t raw = little_endian(n);
  const int shift = static_cast<int>(64 - 8 * n);
  return shift == 0 ? static_cast<int64_t>(raw) : static_cast<int64_t>(raw << shift) >> shift;
}

// BINFLOAT: big-endian IEEE 754.
double PickleMachine::binfloat() {
  const auto* p = reinterpret_cast<const unsigned char*>(take(8));
  uint64_t bits = 0;
  for (int i = 0; i < 8; ++i) bits = (bits << 8) | p[i];
  double v = 0;
  std::memcpy(&v, &bits, sizeof bits);
  return v;
}

std::string PickleMachine::line() {
  const void* nl = std::memchr(data_ + pos_, '\n', size_ - pos_);
  if (!nl) fail("a GLOBAL name is not terminated");
  const size_t n = static_cast<size_t>(static_cast<const char*>(nl) - (data_ + pos_));
  std::string s = text(n);
  take(1);
  return s;
}

// ------------------------------------------------------------------ the stack

// Values below the innermost MARK belong to an outer construct: opcodes may not take them.
PyRef& PickleMachine::top() {
  if (stack_.size() <= floor()) fail("an opcode needs a value the stack does not hold");
  return stack_.back();
}

PyRef PickleMachine::pop() {
  PyRef v = top();
  stack_.pop_back();
  return v;
}

std::vector<PyRef> PickleMachine::pop_n(size_t n) {
  if (stack_.size() < floor() + n) fail("an opcode needs values the stack does not hold");
  std::vector<PyRef> out(stack_.end() - static_cast<std::ptrdiff_t>(n), stack_.end());
  stack_.resize(stack_.size() - n);
  return out;
}

std::vector<PyRef> PickleMachine::pop_mark() {
  if (marks_.empty()) fail("an opcode needs a MARK that was never set");
  const size_t mark = marks_.back();
  marks_.pop_back();
  std::vector<PyRef> out(stack_.begin() + static_cast<std::ptrdiff_t>(mark), stack_.end());
  stack_.resize(mark);
  return out;
}

// The memo holds at most one entry per byte of the pickle, whatever indices it names.
void PickleMachine::memo_put(uint64_t index) {
  if (memo_.size() > size_) fail("more memo entries than bytes");
  memo_[index] = top();
}

PyRef PickleMachine::memo_get(uint64_t index) {
  const auto it = memo_.find(index);
  if (it == memo_.end()) fail("a reference to memo entry " + std::to_string(index) + ", which was never stored");
  return it->second;
}

// ------------------------------------------------------------------ containers

void PickleMachine::store(PyValue& container, PyValue& child) const {
  if (&container == &child) fail("a container holds itself");
  child.stored = true;
  container.depth = std::max(container.depth, child.depth + 1);
  if (container.depth > options_.max_depth)
    fail("values nest deeper than " + std::to_string(options_.max_depth) + " levels");
}

PyValue& PickleMachine::mutable_container(Kind kind, const char* opcode) {
  PyValue& c = *top();
  if (c.kind != kind) fail(std::string(opcode) + " applied to a " + py_type_name(c));
  if (c.stored) fail(std::string(opcode) + " changes a container already stored in another");
  return c;
}

PyRef PickleMachine::sequence(Kind kind, std::vector<PyRef> items) const {
  PyRef v = make(kind);
  for (const PyRef& item : items) store(*v, *item);
  v->items = std::move(items);
  return v;
}

void PickleMachine::append(std::vector<PyRef> items, const char* opcode) {
  PyValue& list = mutable_container(Kind::kList, opcode);
  for (PyRef& item : items) {
    store(list, *item);
    list.items.push_back(std::move(item));
  }
}

void PickleMachine::set_items(std::vector<PyRef> items, const char* opcode) {
  if (items.size() % 2 != 0) fail(std::string(opcode) + " with a key and no value");
  PyValue& dict = mutable_container(Kind::kDict, opcode);
  for (size_t i = 0; i < items.size(); i += 2) {
    store(dict, *items[i]);
    store(dict, *items[i + 1]);
    const bool str_key = items[i]->kind == Kind::kStr;
    const auto seen = str_key ? dict.str_keys.find(items[i]->text) : dict.str_keys.end();
    if (seen != dict.str_keys.end() && options_.replace_repeated_keys) {
      dict.items[seen->second + 1] = items[i + 1];  // a repeated key keeps its place, as in Python
      continue;
    }
    if (str_key && seen == dict.str_keys.end()) dict.str_keys[items[i]->text] = dict.items.size();
    dict.items.push_back(items[i]);
    dict.items.push_back(items[i + 1]);
  }
}

// ------------------------------------------------------------------ opcodes

void PickleMachine::unknown(unsigned char op) const {
  char hex[8];
  std::snprintf(hex, sizeof hex, "0x%02x", op);
  fail(std::string("opcode ") + hex + " " + options_.unknown_opcode);
}

bool PickleMachine::step() {
  op_at_ = pos_;
  const auto op = static_cast<unsigned char>(*take(1));
  if (op == '.') return false;  // STOP
  if (!value_op(op) && !container_op(op) && !object_op(op)) unknown(op);
  return true;
}

bool PickleMachine::value_op(unsigned char op) {
  switch (op) {
    case 0x80: {  // PROTO
      const uint64_t protocol = little_endian(1);
      if (protocol < static_cast<uint64_t>(options_.min_protocol) ||
          protocol > static_cast<uint64_t>(options_.max_protocol))
        fail("pickle protocol " + std::to_string(protocol) +
             (options_.protocol_note.empty() ? "" : " (" + options_.protocol_note + ")"));
      return true;
    }
    case 0x95: little_endian(8); return true;  // FRAME: a length hint; every read is bounds-checked anyway
    case 'N': push(make(Kind::kNone)); return true;
    case 0x88: push(make_number(Kind::kBool, 1)); return true;                                     // NEWTRUE
    case 0x89: push(make_number(Kind::kBool, 0)); return true;                                     // NEWFALSE
    case 'K': push(make_number(Kind::kInt, static_cast<int64_t>(little_endian(1)))); return true;  // BININT1
    case 'M': push(make_number(Kind::kInt, static_cast<int64_t>(little_endian(2)))); return true;  // BININT2
    case 'J': push(make_number(Kind::kInt, static_cast<int32_t>(little_endian(4)))); return true;  // BININT
    case 0x8a: push(make_number(Kind::kInt, long1())); return true;                                // LONG1
    case 'G': {                                                                                    // BINFLOAT
      PyRef v = make(Kind::kFloat);
      v->real = binfloat();
      push(v);
      return true;
    }
    case 0x8c: push(make_named(Kind::kStr, text(little_endian(1)))); return true;  // SHORT_BINUNICODE
    case 'X': push(make_named(Kind::kStr, text(little_endian(4)))); return true;   // BINUNICODE
    case 0x8d: push(make_named(Kind::kStr, text(little_endian(8)))); return true;  // BINUNICODE8
    default: return false;
  }
}

bool PickleMachine::container_op(unsigned char op) {
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
    case 0x94: memo_put(memo_.size()); return true;           // MEMOIZE
    case 'q': memo_put(little_endian(1)); return true;        // BINPUT
    case 'r': memo_put(little_endian(4)); return true;        // LONG_BINPUT
    case 'h': push(memo_get(little_endian(1))); return true;  // BINGET
    case 'j': push(memo_get(little_endian(4))); return true;  // LONG_BINGET
    default: return false;
  }
}

bool PickleMachine::object_op(unsigned char op) {
  switch (op) {
    case 'c': {  // GLOBAL
      const std::string module = line();
      push(global(module, line()));
      return true;
    }
    case 0x93: {  // STACK_GLOBAL
      const std::vector<PyRef> names = pop_n(2);
      if (names[0]->kind != Kind::kStr || names[1]->kind != Kind::kStr) fail("STACK_GLOBAL of a non-string name");
      push(global(names[0]->text, names[1]->text));
      return true;
    }
    case 'R': {  // REDUCE
      const std::vector<PyRef> f_args = pop_n(2);
      push(reduce(*f_args[0], *f_args[1]));
      return true;
    }
    case 0x81: {  // NEWOBJ
      const std::vector<PyRef> cls_args = pop_n(2);
      push(new_object(*cls_args[0], *cls_args[1]));
      return true;
    }
    case 'b': {  // BUILD
      PyRef state = pop();
      build(*top(), state);
      return true;
    }
    case 'Q': push(persistent_load(*pop())); return true;  // BINPERSID
    default: return false;
  }
}

}  // namespace detail
}  // namespace fsdp
