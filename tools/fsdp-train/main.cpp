// fsdp-train — the config-driven trainer of fsdp-cpp.
//
//   fsdprun --standalone --nproc-per-node 2 fsdp-train configs/small.yaml [--section.key=value ...] [--trace]
//   fsdp-train tokenize [--tokenizer M.model] INPUT.txt OUTPUT.tokens   # a token file for data.source: tokens
//   fsdprun ... fsdp-train eval configs/small.yaml --eval.path=F.tokens  # prints `eval loss: <value>`
//
// Without a launcher it trains as one process (world size 1). See docs/trainer.md and configs/.
#include "common/errors.h"
#include "config/config.h"
#include "config/read_file.h"
#include "data/data.h"
#include "data/tokenizer.h"
#include "models/model_setup.h"
#include "plan_command.h"
#include "run/stop_signal.h"
#include "run/trainer.h"

#include <fsdp/distributed.h>
#include <fsdp/flight_recorder.h>

#include <cstring>
#include <iostream>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

const char* kUsage =
    "usage: fsdp-train [CONFIG.yaml] [--section.key=value ...] [--trace]\n"
    "       fsdp-train tokenize [--tokenizer MODEL] INPUT OUTPUT\n"
    "       fsdp-train eval [CONFIG.yaml] [--section.key=value ...]\n"
    "       fsdp-train plan CONFIG.yaml [--section.key=value ...] [--world N] [--memory-per-rank SIZE] [--json]\n"
    "Trains the model CONFIG.yaml names (see configs/, docs/models.md); every key can be overridden on the\n"
    "command line, e.g. --training.steps=20 --optimizer.betas=[0.9,0.95]. --trace is\n"
    "--logging.trace=true. Start it with fsdprun for several ranks.\n"
    "tokenize: turns any file into a token file: byte-level (vocabulary 256), or with --tokenizer the\n"
    "ids of a SentencePiece model (spm_train's .model; its vocabulary size is recorded).\n"
    "eval: loads the weights training would start from and prints `eval loss: <value>`, the mean\n"
    "cross-entropy over eval.batches global batches from the start of eval.path.\n"
    "plan: the memory, collectives and step time a run needs per rank, predicted without running it\n"
    "(fsdp-train plan --help).\n"
    "Exit codes: 0 done, 1 runtime error, 2 configuration error, 3 non-finite loss or gradient\n"
    "norm (the step is not applied), 128+N stopped by signal N (after saving a checkpoint).\n";

// tokenize [--tokenizer MODEL] INPUT OUTPUT (also --tokenizer=MODEL).
int tokenize(int argc, char** argv) {
  std::vector<std::string> files;
  std::string model;
  for (int i = 2; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--tokenizer" && i + 1 < argc) model = argv[++i];
    else if (arg.rfind("--tokenizer=", 0) == 0) model = arg.substr(12);
    else files.push_back(arg);
  }
  if (files.size() != 2 || files[0].rfind("--", 0) == 0 || files[1].rfind("--", 0) == 0) {
    std::cerr << "fsdp-train tokenize: expected [--tokenizer MODEL] INPUT OUTPUT\n" << kUsage;
    return fsdp::train::kExitConfig;
  }
  const std::string& input = files[0];
  std::string text;
  std::unique_ptr<fsdp::train::Tokenizer> tokenizer;
  try {
    tokenizer =
        model.empty() ? fsdp::train::byte_tokenizer() : fsdp::train::sentencepiece_tokenizer(model, "--tokenizer");
    text = fsdp::train::read_file(input, {input + " is a directory; expected a file to tokenize",
                                          "cannot open " + input, "reading " + input + " failed"});
  } catch (const std::runtime_error& e) {
    std::cerr << "fsdp-train tokenize: " << e.what() << "\n";
    return fsdp::train::kExitError;
  }
  const std::vector<uint32_t> ids = tokenizer->encode(text);
  fsdp::train::write_token_file(files[1], ids, tokenizer->vocab_size());
  std::cout << "fsdp-train tokenize: " << ids.size() << " tokens of " << tokenizer->describe() << " from " << input
            << " -> " << files[1] << "\n";
  return fsdp::train::kExitOk;
}

// "rank R: " when this process is one of several ranks (as any launcher the library knows
// says: torchrun/fsdprun, OpenMPI, Slurm), so that each rank's line says whose it is; "" for a
// single process, and when the environment is malformed (the error then says so).
std::string rank_prefix() {
  try {
    const fsdp::RendezvousInfo env = fsdp::rendezvous_info_from_env();
    return env.world_size > 1 ? "rank " + std::to_string(env.rank) + ": " : "";
  } catch (const std::exception&) {
    return "";
  }
}

}  // namespace

int main(int argc, char** argv) {
  using namespace fsdp::train;
  try {
    if (argc >= 2 && !std::strcmp(argv[1], "tokenize")) return tokenize(argc, argv);
    if (argc >= 2 && !std::strcmp(argv[1], "plan")) return plan_command(argc, argv);
    const bool eval = argc >= 2 && !std::strcmp(argv[1], "eval");
    std::string config_path;
    std::vector<std::string> overrides;
    for (int i = eval ? 2 : 1; i < argc; ++i) {
      const std::string arg = argv[i];
      if (arg == "-h" || arg == "--help") {
        std::cout << kUsage;
        return kExitOk;
      }
      if (arg == "--trace") overrides.push_back("--logging.trace=true");
      else if (arg.rfind("--", 0) == 0 && arg.find('.') != std::string::npos) overrides.push_back(arg);
      else if (!arg.empty() && arg[0] == '-')
        throw ConfigError("command line: unknown option '" + arg + "' (fsdp-train takes --section.key=value, " +
                          "--trace and -h/--help)");
      else if (config_path.empty()) config_path = arg;
      else throw ConfigError("command line: a second config file '" + arg + "' (only one is read)");
    }
    const TrainConfig cfg = load_config(config_path, overrides);
    check_supported(cfg, device_support_for(cfg));
    install_stop_signal_handlers();
    return eval ? run_evaluation(cfg) : run_training(cfg);
  } catch (const ConfigError& e) {
    std::cerr << "fsdp-train: " << rank_prefix() << "configuration error: " << terminal_safe(e.what()) << "\n";
    return kExitConfig;
  } catch (const std::exception& e) {
    std::cerr << "fsdp-train: " << rank_prefix() << "error: " << terminal_safe(error_text(e)) << "\n";
    // What this rank's collectives were when it failed, for fsdprun's diagnosis (no-op unless
    // the launcher set FSDP_FLIGHT_RECORDER_DIR).
    fsdp::FlightRecorder::global().dump("error: " + error_text(e));
    return kExitError;
  }
}
