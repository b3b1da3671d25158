// trainer_runs.h — what the fsdp-train end-to-end tests share: the programs under test, the
// small run they start from, and reading a run's per-rank JSONL metrics.
#pragma once

#include "process_harness.h"

#include <cmath>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace trainer_test {

// The programs under test and the shipped configs (paths from CMake).
extern const process_test::Program trainer;
extern const process_test::Program fsdprun;
std::string configs_dir();

// The reference Transformer's parameter count (fsdp/models/transformer.h), by its shapes: the
// embeddings and the head 2 V D, the position embeddings S D, each block's four attention
// projections, two norms and its MLP 12 D^2 + 9 D, the final norm 2 D.
inline double transformer_parameter_count(double n_layers, double vocab, double max_seq_len, double dim) {
  return 2 * vocab * dim + max_seq_len * dim + n_layers * (12 * dim * dim + 9 * dim) + 2 * dim;
}

// A small model that still takes a few milliseconds per step, so that a test can stop a run in
// the middle; checkpoints every 5 steps under dir/ckpt, metrics per rank in dir/m<rank>.jsonl.
std::vector<std::string> base_args(const std::string& dir, int steps);
std::vector<std::string> with(std::vector<std::string> args, const std::vector<std::string>& more);
// fsdprun's arguments for `nproc` ranks of the trainer.
std::vector<std::string> under_fsdprun(int nproc, const std::vector<std::string>& trainer_args,
                                       const std::vector<std::string>& launcher_flags = {});

struct StepMetrics {
  double loss = NAN;
  double grad_norm = NAN;
};
// step -> metrics, the LAST line of each step winning: a resumed run appends the steps it
// redoes after those the interrupted run wrote.
std::map<int64_t, StepMetrics> read_metrics(const std::string& path);
// The steps of every line, in file order.
std::vector<int64_t> steps_in(const std::string& path);
int64_t last_step_in(const std::string& path);
// Waits until the run's rank-0 metrics reach `step` (or `timeout_s` passes).
bool wait_for_step(const std::string& jsonl, int64_t step, double timeout_s = 60);

// Whether the run's stdout or stderr holds `text`.
bool contains(const process_test::RunResult& r, const std::string& text);

// Writes text to path; with executable, as a script to run.
void write_text(const std::string& path, const std::string& text, bool executable = false);
// Runs a Python program with torch (Debian's /usr/bin/python3); its exit status.
int run_python(const std::string& script_path, const std::vector<std::string>& args);

}  // namespace trainer_test
