// tokenizer.cpp — the byte-level and SentencePiece tokenizers (tokenizer.h).
#include "data/tokenizer.h"

#include "config/read_file.h"

#include <dlfcn.h>

#include <filesystem>
#include <stdexcept>
#include <string>
#include <vector>

namespace fsdp {
namespace train {
namespace {

std::string unknown_id(int64_t id) { return "<id " + std::to_string(id) + ">"; }

class ByteTokenizer : public Tokenizer {
 public:
  std::vector<uint32_t> encode(const std::string& text) const override {
    std::vector<uint32_t> ids;
    ids.reserve(text.size());
    for (unsigned char c : text) ids.push_back(c);
    return ids;
  }
  std::string decode(const std::vector<int64_t>& ids) const override {
    std::string s;
    for (int64_t id : ids) s += id >= 0 && id < 256 ? std::string(1, static_cast<char>(id)) : unknown_id(id);
    return s;
  }
  uint64_t vocab_size() const override { return 256; }
  std::string describe() const override { return "byte-level (vocabulary 256)"; }
};

// The plugin's C interface (sentencepiece_plugin.cpp), resolved once.
struct SpmPlugin {
  void* (*load)(const char*, size_t, char**) = nullptr;
  void (*destroy)(void*) = nullptr;
  int (*piece_size)(void*) = nullptr;
  long (*encode)(void*, const char*, size_t, int**, char**) = nullptr;
  char* (*decode)(void*, const int*, size_t) = nullptr;
  void (*free)(void*) = nullptr;
};

// Where a build wrote the plugin: FSDP_SENTENCEPIECE_PLUGIN_IN_BUILD below the build folder,
// which is the nearest folder above the program that has it (fsdp-train, and the tests in other
// folders of the same build). The path is relative so that every build folder (build/,
// build-cuda/) compiles this file with the same command and ccache shares its object.
std::string built_plugin(const std::filesystem::path& exe) {
  for (auto dir = exe.parent_path(); !dir.empty(); dir = dir.parent_path()) {
    const std::filesystem::path candidate = dir / FSDP_SENTENCEPIECE_PLUGIN_IN_BUILD;
    std::error_code ec;
    if (std::filesystem::exists(candidate, ec)) return candidate.string();
    if (dir == dir.root_path()) break;
  }
  return (exe.parent_path() / FSDP_SENTENCEPIECE_PLUGIN_IN_BUILD).string();  // named when none loads
}

// The plugin's candidates: beside an installed fsdp-train (<prefix>/lib/fsdp-train/), then
// where the build wrote it.
std::vector<std::string> plugin_paths() {
  std::error_code ec;
  const std::filesystem::path exe = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (ec)
    throw std::runtime_error("the SentencePiece plugin: /proc/self/exe cannot be read (" + ec.message() +
                             "), so the plugin's folder is unknown; run fsdp-train on Linux with /proc mounted");
  return {(exe.parent_path().parent_path() / FSDP_SENTENCEPIECE_PLUGIN_INSTALLED).string(), built_plugin(exe)};
}

template <class F>
void resolve(void* library, const char* name, F& fn, const std::string& path) {
  fn = reinterpret_cast<F>(dlsym(library, name));
  if (!fn) throw std::runtime_error(path + ": the SentencePiece plugin has no " + name + "; rebuild fsdp-cpp");
}

// Loaded locally with deep binding (sentencepiece_plugin.cpp says why). Throws naming the paths
// tried when it is not there.
const SpmPlugin& spm_plugin() {
  static const SpmPlugin plugin = [] {
    std::string tried;
    for (const std::string& path : plugin_paths()) {
      void* library = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL | RTLD_DEEPBIND);
      if (!library) {
        const char* why = dlerror();
        tried += "\n  " + path + ": " + (why ? why : "not loaded");
        continue;
      }
      SpmPlugin p;
      resolve(library, "fsdp_spm_load", p.load, path);
      resolve(library, "fsdp_spm_destroy", p.destroy, path);
      resolve(library, "fsdp_spm_piece_size", p.piece_size, path);
      resolve(library, "fsdp_spm_encode", p.encode, path);
      resolve(library, "fsdp_spm_decode", p.decode, path);
      resolve(library, "fsdp_spm_free", p.free, path);
      return p;
    }
    throw std::runtime_error(
        "the SentencePiece plugin libfsdp_sentencepiece.so did not load (install "
        "libsentencepiece-dev with scripts/install-deps.sh and rebuild); tried:" +
        tried);
  }();
  return plugin;
}

// What the library said, without its source location: a file of another kind does not parse
// as its model protobuf; one that parses can still be refused (a broken vocabulary).
std::string why_not_a_model(const std::string& said) {
  if (said.empty()) return "it parses, but has no pieces";
  if (said.find("ParseFromArray") != std::string::npos) return "its bytes do not parse as a SentencePiece model";
  return said;
}

// A malloc'd string of the plugin's, taken over.
std::string taken(const SpmPlugin& p, char* s) {
  std::string out = s ? s : "";
  p.free(s);
  return out;
}

class SentencePieceTokenizer : public Tokenizer {
 public:
  SentencePieceTokenizer(const std::string& path, const std::string& key) : path_(path), plugin_(spm_plugin()) {
    const std::string where = path + " (" + key + ")";
    const std::string bytes = read_file(
        path, {where + ": is a directory, not a SentencePiece model", where + ": cannot open the SentencePiece model",
               where + ": reading the SentencePiece model failed"});
    char* error = nullptr;
    sp_ = plugin_.load(bytes.data(), bytes.size(), &error);
    // An empty or foreign file can parse as an empty model; a real one has at least its
    // unknown, begin and end pieces.
    if (!sp_) {
      throw std::runtime_error(where + ": not a SentencePiece model (" + why_not_a_model(taken(plugin_, error)) +
                               "); give the .model file that spm_train writes, or for a tokenizer.json "
                               "use tools/pretokenize.py");
    }
    pieces_ = plugin_.piece_size(sp_);
  }
  ~SentencePieceTokenizer() override { plugin_.destroy(sp_); }
  SentencePieceTokenizer(const SentencePieceTokenizer&) = delete;
  SentencePieceTokenizer& operator=(const SentencePieceTokenizer&) = delete;

  std::vector<uint32_t> encode(const std::string& text) const override {
    int* ids = nullptr;
    char* error = nullptr;
    const long n = plugin_.encode(sp_, text.data(), text.size(), &ids, &error);
    if (n < 0) throw std::runtime_error(path_ + ": SentencePiece could not encode the text: " + taken(plugin_, error));
    std::vector<uint32_t> out(ids, ids + n);
    plugin_.free(ids);
    return out;
  }
  // Runs of known ids are decoded together (a piece's leading space depends on its neighbours).
  std::string decode(const std::vector<int64_t>& ids) const override {
    std::string out;
    std::vector<int> run;
    const auto flush = [&] {
      if (!run.empty()) out += taken(plugin_, plugin_.decode(sp_, run.data(), run.size()));
      run.clear();
    };
    for (int64_t id : ids) {
      if (id >= 0 && id < pieces_) {
        run.push_back(static_cast<int>(id));
        continue;
      }
      flush();
      out += unknown_id(id);
    }
    flush();
    return out;
  }
  uint64_t vocab_size() const override { return static_cast<uint64_t>(pieces_); }
  std::string describe() const override {
    return "SentencePiece model " + path_ + " (vocabulary " + std::to_string(vocab_size()) + ")";
  }

 private:
  std::string path_;
  const SpmPlugin& plugin_;
  void* sp_ = nullptr;
  int pieces_ = 0;
};

}  // namespace

std::unique_ptr<Tokenizer> byte_tokenizer() { return std::make_unique<ByteTokenizer>(); }

std::unique_ptr<Tokenizer> sentencepiece_tokenizer(const std::string& path, const std::string& key) {
  return std::make_unique<SentencePieceTokenizer>(path, key);
}

}  // namespace train
}  // namespace fsdp
