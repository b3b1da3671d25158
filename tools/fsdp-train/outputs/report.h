// report.h — what fsdp-train shows: rank 0's line per step (torchtitan's layout), a progress
// bar when stdout is a terminal, per-rank JSONL metrics, and the summary at the end. Plain
// data in, text out: no torch here.
#pragma once

#include <cstdint>
#include <cstdio>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

namespace fsdp {
namespace train {

// One rank's numbers of one optimizer step.
struct RankStep {
  double local_loss = 0;  // this rank's mean loss over its micro-batches
  double live_mib = 0;    // tensor bytes allocated at the end of the step
  double peak_mib = 0;    // the step's peak of tensor bytes
  double rss_mib = 0;     // resident set now
};

// One optimizer step, as every rank knows it after the metrics all-gather.
struct StepReport {
  int64_t step = 0;      // 1-based
  int64_t steps = 0;     // of the run
  double loss = 0;       // global-batch mean
  double grad_norm = 0;  // global, before clipping (computed every step)
  double lr = 0;
  double step_s = 0;  // forward + backward + optimizer on this rank
  double forward_s = 0, backward_s = 0, optimizer_s = 0;
  double tokens_per_s = 0;          // global tokens of the step / this rank's step_s
  int64_t tokens_seen = 0;          // global tokens trained on so far
  std::string precision;            // the run's dtypes: "fp32" or e.g. "param bf16, reduce fp32"
  double loss_scale = 0;            // fp16: true: the scale this step's loss was multiplied by (0: no scaler)
  bool overflow_skipped = false;    // fp16: true: the gradients overflowed and AdamW did not step
  std::optional<double> eval_loss;  // on the steps eval.interval names: the eval loss after the step
  std::vector<RankStep> ranks;
  // This rank's collectives of the step: all-gather / reduce-scatter time on the comm thread,
  // and the part the training thread waited for (exposed).
  double ag_busy_s = 0, ag_wait_s = 0, rs_busy_s = 0, rs_wait_s = 0;
};

// One kind of collective on one process group, over the run, as one rank saw it.
struct KindTotals {
  double calls = 0;
  double bytes = 0;   // payload bytes this rank sent
  double s = 0;       // busy on the group's communication thread
  double wait_s = 0;  // waited for by the training thread (exposed)
};

// The collectives of one mesh dim's process group (dp, tp, replicate, shard ...), per kind in
// kCollectiveKindNames' order. Kept apart per dim so that a (dp, tp) run shows which
// communication is data-parallel and which tensor-parallel.
constexpr int kCollectiveKinds = 5;
extern const char* const kCollectiveKindNames[kCollectiveKinds];  // "all_gather", ... as in fsdp::to_string
struct MeshDimTotals {
  KindTotals by_kind[kCollectiveKinds];
};

// One rank's totals over the run, for the summary.
struct RankTotals {
  double peak_rss_mib = 0;     // VmHWM
  double peak_tensor_mib = 0;  // peak of tensor bytes
  double median_step_s = 0;
  double ag_s = 0, ag_wait_s = 0, rs_s = 0, rs_wait_s = 0;  // all-gather / reduce-scatter: busy, waited for
  double ar_s = 0, ar_wait_s = 0;                           // all-reduce (HSDP, NO_SHARD): busy, waited for
  // Payload bytes this rank sent over the run, per kind of collective, over every group of the
  // data-parallel mesh.
  double ag_bytes = 0, rs_bytes = 0, ar_bytes = 0;
  // Peak of tensor bytes while the model was built and sharded (before any weights were loaded):
  // below the whole model's parameters under the sharded strategies, which build it sharded.
  double build_peak_tensor_mib = 0;
  std::vector<MeshDimTotals> by_mesh_dim;  // one per dim of the run's mesh
  // Flattened for the all-gather to rank 0: the same count on every rank of one mesh.
  static size_t field_count(size_t mesh_dims);
  std::vector<double> to_vector() const;
  static RankTotals from(const double* fields, size_t mesh_dims);
};

// How many leading steps the summary's medians leave out: logging.summary_warmup, but at most
// all steps but one.
size_t summary_warmup_steps(int64_t summary_warmup, size_t steps);
// The median of v after its first `skip` values; NaN when none are left.
double median_after(const std::vector<double>& v, size_t skip);

// The end of a run, as rank 0 reports it.
struct RunSummary {
  int64_t steps_run = 0;          // steps this process trained (not those before a resume)
  std::string precision;          // as StepReport::precision
  size_t warmup = 0;              // leading steps left out of median_step_s
  double median_step_s = 0;       // rank 0's
  double tokens_per_s = 0;        // global tokens of a step / median_step_s
  std::vector<double> losses;     // global-batch mean per step run
  std::vector<double> step_s;     // rank 0's time per step run
  std::vector<RankTotals> ranks;  // every rank's totals
};

// The summary's text: loss, tokens/s, and per rank peak memory and communication hidden vs
// exposed (exposed = waited for; hidden = busy - exposed). Needs at least one step.
std::string format_summary(const RunSummary& s);

// The run's shape, written with the summary to logging.summary_json.
struct RunShape {
  int world = 1;
  std::string preset;
  int64_t params = 0;  // of the whole (unsharded) model
  int64_t batch = 0;   // training.micro_batch_size
  int64_t gradient_accumulation_steps = 1;
  int64_t seq = 0;
  int torch_threads = 1;
  std::string param_dtype = "float32", reduce_dtype = "float32";  // fsdp_config's spelling
  // The model's ModelArgs.
  int64_t n_layers = 0, vocab_size = 0, max_seq_len = 0, dim = 0, n_heads = 0;
  double dropout_p = 0;
  int64_t model_parallel_size = 1;
  bool vocab_parallel =
      false;  // the embedding and head split by vocabulary over tp (only with model_parallel_size > 1)
  // The mesh the collectives ran on: a name per dim (those of RankTotals::by_mesh_dim) and its sizes.
  std::vector<std::string> mesh_dim_names;
  std::vector<int64_t> mesh_shape;
};

// Writes shape and summary as one JSON object (the keys bench/peer_ab.py reads: world, preset,
// params, batch, seq, steps, warmup, median_step_s, tokens_per_s, losses, step_s_rank0,
// model_args and per-rank lists *_per_rank, whose communication is summed over the mesh's dims;
// and param_dtype, reduce_dtype, model_parallel_size, vocab_parallel, mesh_shape, mesh_dim_names, and
// comm_by_mesh_dim: {dim name: {kind: {calls_per_rank, bytes_per_rank, s_per_rank,
// wait_s_per_rank}}}, run totals). Throws naming path when it cannot be written.
void write_summary_json(const std::string& path, const RunShape& shape, const RunSummary& s);

class Console {
 public:
  // progress: "auto" (when stdout is a terminal), "on" or "off".
  Console(const std::string& progress, int64_t first_step, int64_t steps);
  // The step line (rank 0, every log_interval steps and the last), then the bar.
  void step_line(const StepReport& r);
  // Moves the bar to `step` (steps without a line).
  void progress(int64_t step);
  // A line of its own (clears and redraws the bar around it).
  void line(const std::string& text);
  // Removes the bar for good.
  void finish();

 private:
  void clear_bar();
  void draw_bar(int64_t step);
  bool bar_ = false;
  bool bar_drawn_ = false;
  int64_t first_step_, steps_;
  double started_;
};

std::string format_step_line(const StepReport& r);

// Appends one JSON object per step to a file (each rank its own file).
class JsonlWriter {
 public:
  JsonlWriter() = default;
  // append: keep what an interrupted run wrote (a resumed run continues the file).
  void open(const std::string& path, bool append);
  void write(const StepReport& r, int rank);
  void write_raw(const std::string& json_line);
  bool is_open() const { return out_.is_open(); }

 private:
  std::ofstream out_;
};

// The path a rank writes its JSONL to: "{rank}" in the template is replaced by the rank; a
// template without it is written by rank 0 only (empty result for the others).
std::string jsonl_path_for_rank(const std::string& path_template, int rank);

double now_seconds();

}  // namespace train
}  // namespace fsdp
