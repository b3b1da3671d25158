// run_end.h — the end of a run, and the counters it reports from: the collectives' time and
// bytes per mesh dim between two snapshots, the summary (every rank's totals gathered to rank
// 0), the trace files, the export (training.export) and the sample.
#pragma once

#include "config/config.h"
#include "data/tokenizer.h"
#include "models/model_setup.h"
#include "outputs/report.h"

#include <fsdp/device_mesh.h>
#include <fsdp/process_group.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace fsdp {
namespace train {

// The counters of each process group of a mesh, one per dim: the shard group and, on a 2-D
// mesh, the replicate group or (model_parallel_size > 1) the tp group, whose all-reduces the
// tensor-parallel layers issue. Not collective.
std::vector<CollectiveStats> mesh_dim_stats(const DeviceMesh& mesh);
// The same, summed over the dims.
CollectiveStats mesh_stats(const DeviceMesh& mesh);

// Seconds of all-gather, reduce-scatter and all-reduce between two snapshots of the mesh's
// counters: busy on the communication threads, and waited for by the training thread (exposed);
// and the payload bytes this rank sent.
struct CommSeconds {
  CommSeconds(const CollectiveStats& before, const CollectiveStats& after);
  double all_gather, all_gather_wait, reduce_scatter, reduce_scatter_wait, all_reduce, all_reduce_wait;
  double all_gather_bytes, reduce_scatter_bytes, all_reduce_bytes;
};

// What a run has recorded by its end, for the summary.
struct RunRecord {
  int64_t steps_run = 0;  // steps this process trained (not those before a resume)
  int64_t seq = 0;
  int64_t tokens_per_step = 0;
  std::vector<double> losses, step_times;
  CollectiveStats comm_before;  // when training started
  std::vector<CollectiveStats> comm_before_by_dim;
};

// Collective over the world: every rank's totals go to rank 0, which prints the summary (after
// `console`'s bar is removed) and writes logging.summary_json.
void write_summary(const TrainConfig& cfg, const ModelShape& shape, const ParallelModel& pm, const Precision& precision,
                   const RunRecord& record, Console* console);

// When logging.trace is on: stops the trace and writes this rank's file; returns the line to
// print ("" when tracing is off).
std::string write_trace(const TrainConfig& cfg, int rank);

// Collective over the world, at start-up, before the model is built: every place a training run
// writes besides fsdp_config.checkpoint_dir (RunCheckpoints::check_dir's) is checked by each rank
// that writes it: training.export, logging.jsonl, logging.tensorboard_dir, logging.summary_json
// and, with logging.trace, logging.trace_dir. A folder must be one (or creatable), a file must not
// be a folder, and the folder that will hold it (or the nearest existing one above it) must take
// a probe file, written and removed; nothing else is created. Throws ConfigError on every rank
// naming each key, path and rank that cannot be written.
void check_output_destinations(const TrainConfig& cfg);

// Whether export_and_sample writes anything (training.export other than none), and where.
bool writes_export(const TrainConfig& cfg);
std::string export_destination(const TrainConfig& cfg);

// Collective over the world: training.export (.safetensors: written by every rank from its
// shards; hf or hf:<dir>: a Hugging Face directory of the family's, every rank writing its file;
// otherwise one PyTorch file written by rank 0), then rank 0's sample, its text that of
// `tokenizer` (nullptr: token ids). `print` shows rank 0's lines. Throws ConfigError for hf with
// a family that has no Hugging Face format.
void export_and_sample(const TrainConfig& cfg, const ModelFamily& family, ParallelModel& pm, const Tokenizer* tokenizer,
                       const std::function<void(const std::string&)>& print);

}  // namespace train
}  // namespace fsdp
