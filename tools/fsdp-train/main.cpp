// fsdp-train — the config-driven Transformer trainer of fsdp-cpp.
//
//   fsdprun --standalone --nproc-per-node 2 fsdp-train configs/small.yaml [--section.key=value ...] [--trace]
//   fsdp-train tokenize INPUT.txt OUTPUT.tokens        # byte-level token file for data.source: tokens
//
// Without a launcher it trains as one process (world size 1). See README.md and configs/.
#include "config.h"
#include "data.h"
#include "stop_signal.h"
#include "trainer.h"

#include <c10/util/Exception.h>

#include <cstring>
#include <fstream>
#include <iostream>
#include <iterator>
#include <string>
#include <vector>

namespace {

const char* kUsage =
    "usage: fsdp-train [CONFIG.yaml] [--section.key=value ...] [--trace]\n"
    "       fsdp-train tokenize INPUT OUTPUT\n"
    "Trains the Transformer as CONFIG.yaml says (see configs/); every key can be overridden on the\n"
    "command line, e.g. --training.steps=20 --optimizer.betas=[0.9,0.95]. --trace is\n"
    "--logging.trace=true. Start it with fsdprun for several ranks.\n"
    "tokenize: turns any file into a byte-level token file (vocabulary 256).\n";

int tokenize(int argc, char** argv) {
  if (argc != 4) {
    std::cerr << "fsdp-train tokenize: expected INPUT and OUTPUT\n" << kUsage;
    return fsdp::train::kExitConfig;
  }
  std::ifstream in(argv[2], std::ios::binary);
  if (!in) {
    std::cerr << "fsdp-train tokenize: cannot open " << argv[2] << "\n";
    return fsdp::train::kExitError;
  }
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  fsdp::train::write_token_file(argv[3], fsdp::train::byte_tokens(text), 256);
  std::cout << "fsdp-train tokenize: " << text.size() << " byte tokens (vocab 256) from " << argv[2] << " -> "
            << argv[3] << "\n";
  return fsdp::train::kExitOk;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace fsdp::train;
  try {
    if (argc >= 2 && !std::strcmp(argv[1], "tokenize")) return tokenize(argc, argv);
    std::string config_path;
    std::vector<std::string> overrides;
    for (int i = 1; i < argc; ++i) {
      const std::string arg = argv[i];
      if (arg == "-h" || arg == "--help") {
        std::cout << kUsage;
        return kExitOk;
      }
      if (arg == "--trace") overrides.push_back("--logging.trace=true");
      else if (arg.rfind("--", 0) == 0) overrides.push_back(arg);
      else if (config_path.empty()) config_path = arg;
      else throw ConfigError("command line: a second config file '" + arg + "' (only one is read)");
    }
    const TrainConfig cfg = load_config(config_path, overrides);
    check_supported(cfg);
    install_stop_signal_handlers();
    return run_training(cfg);
  } catch (const ConfigError& e) {
    std::cerr << "fsdp-train: configuration error: " << e.what() << "\n";
    return kExitConfig;
  } catch (const c10::Error& e) {
    std::cerr << "fsdp-train: error: " << e.what_without_backtrace() << "\n";
    return kExitError;
  } catch (const std::exception& e) {
    std::cerr << "fsdp-train: error: " << e.what() << "\n";
    return kExitError;
  }
}
