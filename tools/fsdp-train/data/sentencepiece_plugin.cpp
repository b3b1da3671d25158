// sentencepiece_plugin.cpp — libfsdp_sentencepiece, a plugin that tokenizer.cpp loads with
// dlopen(RTLD_LOCAL | RTLD_DEEPBIND) and calls through this C interface. Debian's
// libsentencepiece carries its own copy of protobuf (3.14) and exports its symbols; linked into
// fsdp-train beside the system's libprotobuf (3.21, the TensorBoard writer's), one copy's
// symbols would be bound to the other's code and the program crashes before main. Loaded
// locally with deep binding, SentencePiece keeps to its own copy and nothing else sees it.
#include <sentencepiece_processor.h>

#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {

char* copy_of(const std::string& s) {
  char* out = static_cast<char*>(std::malloc(s.size() + 1));
  if (out) std::memcpy(out, s.c_str(), s.size() + 1);
  return out;
}

}  // namespace

extern "C" {

// A processor loaded from a model's bytes, or null with *error set (free it with
// fsdp_spm_free): the library's status text, or "" when it parsed with no pieces.
void* fsdp_spm_load(const char* bytes, size_t n, char** error) {
  auto* sp = new sentencepiece::SentencePieceProcessor();
  const auto status = sp->LoadFromSerializedProto(std::string(bytes, n));
  if (status.ok() && sp->GetPieceSize() > 0) return sp;
  *error = copy_of(status.ok() ? std::string() : status.ToString());
  delete sp;
  return nullptr;
}

void fsdp_spm_destroy(void* sp) { delete static_cast<sentencepiece::SentencePieceProcessor*>(sp); }

int fsdp_spm_piece_size(void* sp) { return static_cast<sentencepiece::SentencePieceProcessor*>(sp)->GetPieceSize(); }

// The ids of text, malloc'd into *ids (free it with fsdp_spm_free); their count, or -1 with
// *error set.
long fsdp_spm_encode(void* sp, const char* text, size_t n, int** ids, char** error) {
  std::vector<int> out;
  const auto status = static_cast<sentencepiece::SentencePieceProcessor*>(sp)->Encode(std::string(text, n), &out);
  if (!status.ok()) {
    *error = copy_of(status.ToString());
    return -1;
  }
  *ids = static_cast<int*>(std::malloc(out.size() * sizeof(int) + 1));
  if (!out.empty()) std::memcpy(*ids, out.data(), out.size() * sizeof(int));
  return static_cast<long>(out.size());
}

// The text of ids (each below the piece size), malloc'd; null when the library refuses them.
char* fsdp_spm_decode(void* sp, const int* ids, size_t n) {
  std::string text;
  const auto status =
      static_cast<sentencepiece::SentencePieceProcessor*>(sp)->Decode(std::vector<int>(ids, ids + n), &text);
  return status.ok() ? copy_of(text) : nullptr;
}

void fsdp_spm_free(void* p) { std::free(p); }

}  // extern "C"
