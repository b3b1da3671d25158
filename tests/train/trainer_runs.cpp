// trainer_runs.cpp — the shared pieces of the fsdp-train end-to-end tests (trainer_runs.h).
#include "trainer_runs.h"

#include "../python_path.h"
#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <thread>

namespace trainer_test {

const process_test::Program trainer(process_test::beside_this_program(FSDP_TRAIN_BIN));
const process_test::Program fsdprun(process_test::beside_this_program(FSDPRUN_BIN));
std::string configs_dir() { return FSDP_TRAIN_CONFIGS_DIR; }

std::vector<std::string> base_args(const std::string& dir, int steps) {
  return {configs_dir() + "/tiny.yaml",
          "--model.dim=64",
          "--model.max_seq_len=64",
          "--model.vocab_size=64",
          "--training.seq_len=64",
          "--training.steps=" + std::to_string(steps),
          "--training.micro_batch_size=4",
          "--training.keep_checkpoints=0",
          "--fsdp_config.checkpoint_interval=5",
          "--fsdp_config.checkpoint_dir=" + dir + "/ckpt",
          "--logging.jsonl=" + dir + "/m{rank}.jsonl",
          "--logging.progress=off",
          "--logging.log_interval=1000",
          "--training.export=none"};
}

std::vector<std::string> with(std::vector<std::string> args, const std::vector<std::string>& more) {
  args.insert(args.end(), more.begin(), more.end());
  return args;
}

std::vector<std::string> under_fsdprun(int nproc, const std::vector<std::string>& trainer_args,
                                       const std::vector<std::string>& launcher_flags) {
  std::vector<std::string> a = {"--standalone", "--nproc-per-node", std::to_string(nproc)};
  a.insert(a.end(), launcher_flags.begin(), launcher_flags.end());
  a.push_back(trainer.path());
  a.insert(a.end(), trainer_args.begin(), trainer_args.end());
  return a;
}

std::map<int64_t, StepMetrics> read_metrics(const std::string& path) {
  std::map<int64_t, StepMetrics> steps;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    const auto j = nlohmann::json::parse(line);
    StepMetrics m;
    m.loss = j.at("loss").get<double>();
    m.grad_norm = j.at("grad_norm").get<double>();  // every applied step has one
    steps[j.at("step").get<int64_t>()] = m;
  }
  return steps;
}

std::vector<int64_t> steps_in(const std::string& path) {
  std::vector<int64_t> steps;
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);)
    if (!line.empty()) steps.push_back(nlohmann::json::parse(line).at("step").get<int64_t>());
  return steps;
}

int64_t last_step_in(const std::string& path) {
  std::ifstream in(path);
  std::string line, last;
  while (std::getline(in, line))
    if (!line.empty() && line.back() == '}') last = line;
  if (last.empty()) return 0;
  try {
    return nlohmann::json::parse(last).at("step").get<int64_t>();
  } catch (...) {
    return 0;
  }
}

bool wait_for_step(const std::string& jsonl, int64_t step, double timeout_s) {
  const double deadline = process_test::now_seconds() + timeout_s;
  while (process_test::now_seconds() < deadline) {
    if (last_step_in(jsonl) >= step) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  return false;
}

void write_text(const std::string& path, const std::string& text, bool executable) {
  std::ofstream(path, std::ios::binary) << text;
  if (executable)
    std::filesystem::permissions(path, std::filesystem::perms::owner_all, std::filesystem::perm_options::add);
}

bool contains(const process_test::RunResult& r, const std::string& text) {
  return (r.out + r.err).find(text) != std::string::npos;
}

int run_python(const std::string& script_path, const std::vector<std::string>& args) {
  std::string cmd = fsdp_test::python() + " '" + script_path + "'";
  for (const auto& a : args) cmd += " '" + a + "'";
  return std::system(cmd.c_str());
}

}  // namespace trainer_test
