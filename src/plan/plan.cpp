// plan.cpp — the step replay of fsdp/plan.h: a ledger of what is alive, walked through one
// optimizer step in the order fully_shard allocates and frees (src/fsdp/param_group.cpp,
// state.cpp, collectives.cpp), the largest total kept with what made it up.
#include <fsdp/plan.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <set>
#include <stdexcept>
#include <utility>

namespace fsdp {
namespace plan {

int64_t bytes_of(Dtype d) { return d == Dtype::kFloat32 ? 4 : 2; }
const char* name_of(Dtype d) {
  switch (d) {
    case Dtype::kFloat32: return "fp32";
    case Dtype::kBFloat16: return "bf16";
    case Dtype::kFloat16: return "fp16";
  }
  return "?";
}
const char* name_of(Backend b) { return b == Backend::kMpi ? "mpi" : "gloo"; }
const char* name_of(Device d) { return d == Device::kCuda ? "cuda" : "cpu"; }

int64_t ParamSpec::numel() const {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return n;
}

namespace {

void require(bool ok, const std::string& what) {
  if (!ok) throw std::invalid_argument("fsdp::plan: " + what);
}

// How one group is laid out over its shard group of `shards` ranks (collectives.cpp): each
// parameter's dim 0 in pieces of ceil(rows / shards) rows, the pieces of every parameter one
// after another in a flat row of row_numel elements per rank.
struct GroupLayout {
  int64_t unsharded_numel = 0;          // the parameters whole
  int64_t row_numel = 0;                // one rank's flat shard, padding included
  int64_t real_numel = 0;               // this rank's real elements (what the optimizer state covers)
  int64_t largest_real = 0;             // this rank's largest real piece of one parameter
  std::vector<int64_t> real_per_param;  // this rank's real piece of each parameter, in order
};

GroupLayout layout_of(const GroupSpec& g, int64_t shards, int64_t shard_rank) {
  GroupLayout l;
  for (const ParamSpec& p : g.params) {
    const int64_t rows = p.shape.empty() ? 1 : p.shape[0];
    const int64_t rest = rows > 0 ? p.numel() / rows : 0;
    const int64_t chunk = (rows + shards - 1) / shards;
    const int64_t real_rows = std::max<int64_t>(0, std::min(chunk, rows - shard_rank * chunk));
    l.unsharded_numel += p.numel();
    l.row_numel += chunk * rest;
    l.real_numel += real_rows * rest;
    l.largest_real = std::max(l.largest_real, real_rows * rest);
    l.real_per_param.push_back(real_rows * rest);
  }
  return l;
}

// The ranks each parameter is sharded over: the data-parallel ranks of one replica.
int64_t shards_of(const ModelSpec& m, const PlanOptions& o) {
  return o.no_shard_ ? 1 : o.world_ / m.tensor_parallel / o.replicate_;
}

// What is alive: named entries, and the largest total seen with its entries.
class Ledger {
 public:
  void set(const std::string& key, const std::string& module, const std::string& what, double bytes) {
    if (bytes <= 0) return drop(key);
    live_[key] = Buffer{module, what, static_cast<int64_t>(std::llround(bytes))};
  }
  void drop(const std::string& key) { live_.erase(key); }
  bool has(const std::string& key) const { return live_.count(key) != 0; }
  // A point of the step: what is alive plus `extra` (transients of this moment).
  void point(const std::string& where, const std::vector<Buffer>& extra = {}) {
    int64_t total = 0;
    for (const auto& kv : live_) total += kv.second.bytes;
    for (const Buffer& b : extra) total += b.bytes;
    if (total <= peak_) return;
    peak_ = total;
    peak_at_ = where;
    at_peak_.clear();
    for (const auto& kv : live_) at_peak_.push_back(kv.second);
    for (const Buffer& b : extra)
      if (b.bytes > 0) at_peak_.push_back(b);
  }
  int64_t total_of(const std::string& key_prefix) const {
    int64_t n = 0;
    for (const auto& kv : live_)
      if (kv.first.compare(0, key_prefix.size(), key_prefix) == 0) n += kv.second.bytes;
    return n;
  }
  int64_t peak() const { return std::max<int64_t>(peak_, 0); }
  const std::string& peak_at() const { return peak_at_; }
  std::vector<Buffer> at_peak() const {  // merged by (module, what), largest first
    std::map<std::pair<std::string, std::string>, int64_t> merged;
    for (const Buffer& b : at_peak_) merged[{b.module, b.what}] += b.bytes;
    std::vector<Buffer> out;
    for (const auto& kv : merged) out.push_back(Buffer{kv.first.first, kv.first.second, kv.second});
    std::stable_sort(out.begin(), out.end(), [](const Buffer& a, const Buffer& b) { return a.bytes > b.bytes; });
    return out;
  }

 private:
  std::map<std::string, Buffer> live_;
  int64_t peak_ = -1;
  std::string peak_at_;
  std::vector<Buffer> at_peak_;
};

std::string label(const std::string& module) { return module.empty() ? "(root)" : module; }

// One rank's replay of one step: the tensors the runtime allocates and frees, in the order it
// does (src/fsdp/param_group.cpp: the all-gather output at unshard, freed at reshard, the
// reduce-scatter's input and the gradient shards in post-backward; src/fsdp/state.cpp: the
// root's pre-forward and the end of backward; src/ddp/reducer.cpp: the buckets). The planner
// includes no torch, so it restates that order instead of calling the runtime; the plan tests
// of fsdp-train (tests/train/test_plan_cli.cpp) hold the two together by comparing its peaks
// with what the trainer measures, and fail when either moves alone.
// On device cuda two ledgers run side by side: ledger_ is the GPU's, host_ the host's, and what
// lives where follows src/fsdp/policies.cpp (the shard device under CPUOffloadPolicy is the
// host), collectives.cpp (the all-gather input copied to the GPU, the reduce-scatter output
// copied to the host) and src/optim/device_state_adamw.cpp. On device cpu host_ stays empty.
class StepReplay {
 public:
  StepReplay(const ModelSpec& m, const PlanOptions& o, int rank) : m_(m), o_(o) {
    shards_ = shards_of(m, o);
    // Row-major meshes: a tp group is tp consecutive ranks, a shard group consecutive dp ranks.
    const int64_t shard_rank = (rank / m.tensor_parallel) % shards_;
    for (const GroupSpec& g : m.groups) layouts_.push_back(layout_of(g, shards_, shard_rank));
    pb_ = bytes_of(o.param_dtype_);
    rb_ = bytes_of(o.reduce_dtype_);
    cuda_ = o.device_ == Device::kCuda;
    shards_on_host_ = cuda_ && o.offload_;
    state_on_host_ = shards_on_host_ && o.optimizer_ != Optimizer::kDeviceStateAdamW;
    // One rank with no cast or copy to the GPU: the unsharded parameters are the shards (no
    // all-gather ever).
    aliased_ = o.no_shard_ || (shards_ == 1 && o.param_dtype_ == Dtype::kFloat32 && !shards_on_host_);
    for (size_t s = 0; s < m.stages.size(); ++s) {
      const int g = m.stages[s].group;
      if (!first_stage_.count(g)) first_stage_[g] = static_cast<int>(s);
      last_stage_[g] = static_cast<int>(s);
    }
  }

  RankPlan run(int rank) {
    floor();
    if (o_.evaluation_) {
      evaluation_forward();
    } else {
      for (int64_t micro = 0; micro < o_.micro_batches_; ++micro) {
        forward(micro);
        backward(micro);
      }
      optimizer_step();
    }
    RankPlan r;
    r.rank = rank;
    r.peak_tensor_bytes = ledger_.peak();
    r.peak_at = ledger_.peak_at();
    r.at_peak = ledger_.at_peak();
    if (cuda_) {
      r.host_peak_tensor_bytes = host_.peak();
      r.host_peak_at = host_.peak_at();
      r.host_at_peak = host_.at_peak();
    }
    r.params_in = r.grads_in = shards_on_host_ ? Memory::kHost : Memory::kDevice;
    r.optimizer_state_in = state_on_host_ ? Memory::kHost : Memory::kDevice;
    r.activation_bytes = activation_bytes_;
    int64_t params = 0, states = 0;
    for (const GroupLayout& l : layouts_) {
      params += (o_.no_shard_ ? l.unsharded_numel : l.row_numel) * 4;
      states += 2 * (o_.no_shard_ ? l.unsharded_numel : l.real_numel) * 4;
    }
    r.params = {{Dtype::kFloat32, params}};
    r.optimizer_state = {{Dtype::kFloat32, o_.evaluation_ ? 0 : states}};
    r.grads = {{Dtype::kFloat32, grad_bytes_}};
    const Staging staged = checkpoint_staging();
    r.checkpoint_staging_bytes = staged.device + staged.host;
    const bool saves = o_.background_checkpoints_;
    r.peak_tensor_bytes_after_save = r.peak_tensor_bytes + (saves ? staged.device : 0);
    if (cuda_) r.host_peak_tensor_bytes_after_save = r.host_peak_tensor_bytes + (saves ? staged.host : 0);
    const Constants& c = o_.constants_;
    // RSS: the runtime's own (libraries, the process group, the heap; runtime_rss_bytes) plus
    // the peak tensors, scaled by what the block cache and page rounding add to them
    // (rss_per_tensor_byte). Nothing else is counted because nothing else is held above a step's
    // peak: a synchronous checkpoint save (the final one, every DCP save) writes its file a piece
    // at a time from the live tensors; the Hugging Face export (after the steps, without the
    // gradients) holds its dtype's copy of the rank's parameters and one whole tensor at a time;
    // the model is built and loaded a group at a time, and the block cache is emptied after the
    // build and the load (glibc maps every large block on its own, so a freed one leaves no
    // resident hole).
    if (!cuda_)
      r.peak_rss_bytes =
          static_cast<int64_t>(c.runtime_rss_bytes + c.rss_per_tensor_byte * r.peak_tensor_bytes_after_save);
    return r;
  }

 private:
  const GroupSpec& group(int g) const { return m_.groups[g]; }
  const std::string& gname(int g) const { return m_.groups[g].name; }
  std::string key(const char* kind, int g) const { return std::string(kind) + ":" + std::to_string(g); }
  bool is_root(int g) const { return g == 0; }
  // The root keeps its parameters from forward to backward (FSDP2 never reshards the root after
  // forward); the others when reshard_after_forward is false, or when their spec says so.
  bool reshards_after_forward(int g) const {
    return !is_root(g) && group(g).reshard_after_forward && o_.reshard_after_forward_;
  }

  // What a background checkpoint stages (CheckpointManager::save_async): a copy of this rank's
  // real parameter elements and AdamW's two moments, fp32, plus the trainer's counters and the
  // generator's state (5056 bytes, host tensors), all in host memory (a GPU's pieces in pinned
  // host memory). On device cpu all of it is `device`.
  struct Staging {
    int64_t device = 0, host = 0;
  };
  Staging checkpoint_staging() const {
    int64_t real = 0;
    for (const GroupLayout& l : layouts_) real += o_.no_shard_ ? l.unsharded_numel : l.real_numel;
    Staging s;
    (cuda_ ? s.host : s.device) += 3 * real * 4 + 16 + 5056;
    return s;
  }

  // The ledger of the memory a tensor lives in: the host's when it is apart from the GPU.
  Ledger& in(bool on_host) { return on_host ? host_ : ledger_; }
  // A point of the step in each memory: `extra` the compute device's transients of this moment,
  // `host_extra` the host's (device cuda only).
  void point(const std::string& where, const std::vector<Buffer>& extra = {},
             const std::vector<Buffer>& host_extra = {}) {
    ledger_.point(where, extra);
    if (cuda_) host_.point(where, host_extra);
  }

  // This rank's sharded parameters and AdamW's two moments: alive throughout.
  void floor() {
    for (size_t g = 0; g < layouts_.size(); ++g) {
      const GroupLayout& l = layouts_[g];
      const int gi = static_cast<int>(g);
      if (o_.no_shard_) {
        ledger_.set(key("params", gi), gname(gi), "parameters (whole)", l.unsharded_numel * 4.0);
        if (o_.evaluation_) continue;
        ledger_.set(key("state", gi), gname(gi), "optimizer state", 2.0 * l.unsharded_numel * 4);
        // replicate's gradients are views of its all-reduce buckets, allocated once.
        ledger_.set(key("sgrad", gi), gname(gi), "gradient buckets", l.unsharded_numel * 4.0);
      } else {
        in(shards_on_host_)
            .set(key("params", gi), gname(gi), shards_on_host_ ? "sharded parameters (pinned)" : "sharded parameters",
                 l.row_numel * 4.0);
        if (!o_.evaluation_)
          in(state_on_host_).set(key("state", gi), gname(gi), "optimizer state", 2.0 * l.real_numel * 4);
      }
    }
    if (!cuda_) {
      ledger_.set("data", "", "the step's tokens", m_.input_bytes);
      ledger_.set("scratch", "", "collective scratch (kept by the process groups)", scratch_bytes());
      return;
    }
    // A GPU's collectives run on NCCL, whose buffers are not tensors: no scratch.
    host_.set("data", "", "the step's tokens", m_.input_bytes);
    ledger_.set("data", "", "the micro-batch's tokens", m_.device_input_bytes);
  }

  // Each process group keeps one scratch tensor, grown to its largest call
  // (src/comm/queued_process_group.cpp). Gloo: a ring reduce-scatter over more than two ranks
  // holds two chunks; an all-reduce of up to 64 KiB every rank's copy, a larger one a chunk. MPI
  // leaves collectives below 256 KiB to OpenMPI (whose temporaries are not tensors) and runs the
  // larger ones on the same rings: two chunks for a reduce-scatter over more than two ranks, a
  // chunk for an all-reduce.
  double scratch_bytes() const {
    const bool mpi = o_.backend_ == Backend::kMpi;
    const double ring_from = mpi ? 256 * 1024 : 0;
    auto all_reduce = [mpi, ring_from](double bytes, double ranks) {
      if (ranks <= 1 || bytes < ring_from) return 0.0;
      return !mpi && bytes <= 64 * 1024 ? ranks * bytes : std::ceil(bytes / ranks / 4) * 4;
    };
    auto reduce_scatter = [ring_from](double row_bytes, double ranks) {
      return ranks > 2 && ranks * row_bytes >= ring_from ? 2 * row_bytes : 0.0;
    };
    double tp = 0;  // the tp group's, grown to its largest all-reduce
    if (m_.tensor_parallel > 1)
      for (const StageSpec& s : m_.stages)
        for (const TpAllReduce& x : s.tp_all_reduces)
          if (x.forward + x.backward > 0) tp = std::max(tp, all_reduce(x.bytes, m_.tensor_parallel));
    if (o_.no_shard_) {
      double total = 0;
      for (const GroupLayout& l : layouts_) total += l.unsharded_numel * 4.0;
      return all_reduce(std::min(total, 25.0 * (1 << 20)), o_.world_);
    }
    double rs = 0, ar = 0;
    for (const GroupLayout& l : layouts_) {
      const double row_bytes = static_cast<double>(l.row_numel) * rb_;
      rs = std::max(rs, reduce_scatter(row_bytes, static_cast<double>(shards_)));
      if (o_.replicate_ > 1) ar = std::max(ar, all_reduce(row_bytes, o_.replicate_));
    }
    return rs + ar + tp;
  }

  double gathered_bytes(int g) const { return static_cast<double>(shards_) * layouts_[g].row_numel * pb_; }
  double unsharded_bytes(int g) const { return static_cast<double>(layouts_[g].unsharded_numel) * pb_; }
  // The all-gather's input (the shard cast to the compute dtype, or copied from the host to the
  // GPU) and output, from its issue to the copy-out.
  double all_gather_buffer_bytes(int g) const {
    const bool copied = o_.param_dtype_ != Dtype::kFloat32 || shards_on_host_;
    const double cast = copied ? layouts_[g].row_numel * static_cast<double>(pb_) : 0;
    return (shards_ > 1 ? gathered_bytes(g) : 0) + cast;
  }

  void issue_all_gather(int g, const char* why) {
    if (aliased_ || ledger_.has(key("unsharded", g)) || ledger_.has(key("ag", g))) return;
    ledger_.set(key("ag", g), gname(g), std::string("all-gather buffers") + why, all_gather_buffer_bytes(g));
  }
  void unshard(int g, const std::string& where) {
    if (aliased_ || ledger_.has(key("unsharded", g))) return;
    issue_all_gather(g, "");
    ledger_.set(key("unsharded", g), gname(g), "unsharded parameters", unsharded_bytes(g));
    point(where + ": all-gather copy-out of " + label(gname(g)));
    ledger_.drop(key("ag", g));
  }
  void reshard(int g) {
    if (aliased_) return;
    ledger_.drop(key("unsharded", g));
    ledger_.drop(key("ag", g));
  }

  // Stage s starts its group in forward: the group is unsharded, and the forward prefetch issues
  // the all-gather of the group that starts next (the one that ran next in the previous iteration).
  void gather_for_forward(size_t s, const std::string& when) {
    const int group = m_.stages[s].group;
    unshard(group, when);
    for (size_t n = s + 1; n < m_.stages.size(); ++n) {
      if (m_.stages[n].group != group && first_stage_[m_.stages[n].group] == static_cast<int>(n)) {
        issue_all_gather(m_.stages[n].group, " (forward prefetch)");
        return;
      }
    }
  }

  void forward(int64_t micro) {
    const std::string when = "micro-batch " + std::to_string(micro + 1) + " forward";
    int previous_group = -1;
    for (size_t s = 0; s < m_.stages.size(); ++s) {
      const StageSpec& st = m_.stages[s];
      if (st.group != previous_group && first_stage_[st.group] == static_cast<int>(s)) gather_for_forward(s, when);
      previous_group = st.group;
      const std::string at = when + " of " + label(st.name);
      if (st.checkpointed) {
        point(at, {{st.name, "activations (no-grad forward)", static_cast<int64_t>(st.forward_extra_bytes)}});
        ledger_.set("saved:" + std::to_string(s), st.name, "activations (checkpoint output)", st.output_bytes);
      } else {
        point(at, {{st.name, "activations", static_cast<int64_t>(st.saved_bytes + st.forward_extra_bytes)}});
        ledger_.set("saved:" + std::to_string(s), st.name, "activations", st.saved_bytes);
      }
      if (last_stage_[st.group] == static_cast<int>(s) && reshards_after_forward(st.group)) reshard(st.group);
    }
    activation_bytes_ = ledger_.total_of("saved:");
  }

  // An evaluation's forward (no grad): each group gathered at its first stage (with the forward
  // prefetch of the next), every stage at its no-grad high point beside the previous stage's
  // output, nothing saved for a backward; the groups reshard after their last stage as in
  // training, the root keeps its parameters.
  void evaluation_forward() {
    const std::string when = "evaluation forward";
    int previous_group = -1;
    double input = 0;  // the previous stage's output, this stage's input
    for (size_t s = 0; s < m_.stages.size(); ++s) {
      const StageSpec& st = m_.stages[s];
      if (st.group != previous_group && first_stage_[st.group] == static_cast<int>(s)) gather_for_forward(s, when);
      previous_group = st.group;
      const double high = st.checkpointed ? st.forward_extra_bytes : st.saved_bytes + st.forward_extra_bytes;
      point(when + " of " + label(st.name), {{st.name, "stage input", static_cast<int64_t>(input)},
                                             {st.name, "activations (no-grad forward)", static_cast<int64_t>(high)}});
      input = st.output_bytes;
      if (last_stage_[st.group] == static_cast<int>(s) && reshards_after_forward(st.group)) reshard(st.group);
    }
  }

  // The group that finished forward just before g (its backward comes next): FSDP2's default
  // backward prefetch. The root finishes last, so it prefetches the last block.
  int previous_in_post_forward_order(int g) const {
    std::vector<int> order;  // groups in the order their forward ended; the root last
    for (size_t s = 0; s < m_.stages.size(); ++s) {
      const int gs = m_.stages[s].group;
      if (!is_root(gs) && last_stage_.at(gs) == static_cast<int>(s)) order.push_back(gs);
    }
    order.push_back(0);
    for (size_t i = 1; i < order.size(); ++i)
      if (order[i] == g) return order[i - 1];
    return -1;
  }

  void backward(int64_t micro) {
    const std::string when = "micro-batch " + std::to_string(micro + 1) + " backward";
    const bool last_micro = micro + 1 == o_.micro_batches_;
    std::map<int, bool> started;
    // A group's pre-backward: its parameters, and the prefetch of the group that finished forward
    // just before it. The root's runs first, on the loss, whichever stage of it comes first.
    auto pre_backward = [&](int g) {
      started[g] = true;
      unshard(g, when);
      const int previous = previous_in_post_forward_order(g);
      if (previous >= 0 && !aliased_ && reshards_after_forward(previous))
        issue_all_gather(previous, " (backward prefetch)");
    };
    pre_backward(0);
    for (int s = static_cast<int>(m_.stages.size()) - 1; s >= 0; --s) {
      const StageSpec& st = m_.stages[s];
      const int g = st.group;
      const std::string at = when + " of " + label(st.name);
      if (!started[g]) pre_backward(g);
      const std::string saved = "saved:" + std::to_string(s);
      const std::vector<Buffer> grads = stage_grads(st);
      if (st.checkpointed) {
        // The region's output was the next stage's saved input, released by that stage's
        // backward, which has run: the recomputed forward makes its own (in saved_bytes).
        ledger_.drop(saved);
        for (int64_t piece = 0; piece < std::min<int64_t>(st.pieces, 2); ++piece) {
          const std::string where = at + (st.pieces > 1 ? " (piece " + std::to_string(piece + 1) + ")" : "");
          std::vector<Buffer> extra = {
              {st.name, "activations (recomputed)", static_cast<int64_t>(st.saved_bytes + st.backward_extra_bytes)}};
          if (st.grads_accumulated_in_fp32) {
            for (const Buffer& b : grads)
              extra.push_back({b.module, "gradients (fp32 accumulator)", b.bytes / pb_ * 4});
          } else if (piece > 0 || st.pieces == 1) {
            extra.insert(extra.end(), grads.begin(), grads.end());
          }
          point(where, extra);
        }
      } else {
        std::vector<Buffer> extra = {{st.name, "activation gradients", static_cast<int64_t>(st.backward_extra_bytes)}};
        if (st.grads_before_peak) extra.insert(extra.end(), grads.begin(), grads.end());
        point(at, extra);
      }
      ledger_.drop(saved);
      for (size_t i = 0; i < grads.size(); ++i)
        ledger_.set("ugrad:" + std::to_string(s) + ":" + std::to_string(i), grads[i].module, grads[i].what,
                    grads[i].bytes);
      point(at + " (done)");
      if (first_stage_[g] == s) post_backward(g, last_micro, when);
    }
    finish_reductions();
  }

  // The unsharded gradients a stage's backward makes, in the compute dtype.
  std::vector<Buffer> stage_grads(const StageSpec& st) const {
    if (o_.no_shard_) return {};  // written into the buckets
    double numel = 0;
    for (int i : st.grads) numel += static_cast<double>(group(st.group).params.at(i).numel());
    return {{group(st.group).name, "unsharded gradients", static_cast<int64_t>(numel * pb_)}};
  }
  void drop_unsharded_grads(int g) {
    for (size_t s = 0; s < m_.stages.size(); ++s)
      if (m_.stages[s].group == g)
        for (size_t i = 0; i < 4; ++i) ledger_.drop("ugrad:" + std::to_string(s) + ":" + std::to_string(i));
  }

  void post_backward(int g, bool last_micro, const std::string& when) {
    const bool hybrid = o_.replicate_ > 1 && !o_.no_shard_;
    if (o_.no_shard_) return;
    const double unsharded = static_cast<double>(layouts_[g].unsharded_numel);
    if (!last_micro && !hybrid) {  // no sync: the unsharded gradients keep accumulating
      if (pb_ != rb_) {
        ledger_.set(key("accgrad", g), gname(g), "accumulated unsharded gradients", unsharded * rb_);
        drop_unsharded_grads(g);
      }
      reshard(g);
      return;
    }
    reshard(g);
    finish_reductions();  // the group before's reduce-scatter has landed by now
    const double row = static_cast<double>(layouts_[g].row_numel);
    if (shards_ == 1 && !hybrid) {  // handed over: the gradient tensors become the shards' own
      const bool cast = o_.param_dtype_ != Dtype::kFloat32 || o_.reduce_dtype_ != Dtype::kFloat32;
      if (shards_on_host_) {  // cast to the reduce dtype on the GPU, then copied to the host in fp32
        if (pb_ != rb_)
          point(when + ": gradients of " + label(gname(g)) + " cast to the reduce dtype",
                {{gname(g), "gradients (reduce dtype)", static_cast<int64_t>(unsharded * rb_)}});
      } else if (cast) {
        point(when + ": gradients of " + label(gname(g)) + " cast to fp32",
              {{gname(g), "sharded gradients", static_cast<int64_t>(unsharded * 4)}});
      }
      drop_unsharded_grads(g);
      ledger_.drop(key("accgrad", g));
      add_sharded_grad(g, unsharded * 4);
      if (shards_on_host_) point(when + ": gradients of " + label(gname(g)) + " copied to the host");
      return;
    }
    const double input = static_cast<double>(shards_) * row * rb_;
    point(when + ": reduce-scatter copy-in of " + label(gname(g)),
          {{gname(g), "reduce-scatter input", static_cast<int64_t>(input)}});
    drop_unsharded_grads(g);
    ledger_.drop(key("accgrad", g));
    ledger_.set(key("rs", g), gname(g), "reduce-scatter input (in flight)", input);
    ledger_.set(key("rsout", g), gname(g), "reduce-scatter output", row * rb_);
    pending_.push_back(g);
  }
  void add_sharded_grad(int g, double bytes) {
    Ledger& l = in(shards_on_host_);
    if (!l.has(key("sgrad", g))) grad_bytes_ += static_cast<int64_t>(bytes);
    l.set(key("sgrad", g), gname(g), shards_on_host_ ? "sharded gradients (pinned)" : "sharded gradients", bytes);
  }
  // Copy-out: the output becomes the sharded gradients (converted to fp32 when reduced in less).
  // Under offload on a GPU it is copied to the host, converted on the GPU first when reduced in
  // less than fp32.
  void finish_reductions() {
    for (int g : pending_) {
      const double row = static_cast<double>(layouts_[g].row_numel);
      const std::string where = "reduce-scatter copy-out of " + label(gname(g));
      ledger_.drop(key("rs", g));
      if (rb_ != 4)
        point(where, {{gname(g), shards_on_host_ ? "reduce-scatter output in fp32" : "sharded gradients",
                       static_cast<int64_t>(row * 4)}});
      ledger_.drop(key("rsout", g));
      add_sharded_grad(g, row * 4);
      if (shards_on_host_) point(where + " to the host");
    }
    pending_.clear();
  }

  // AdamW's step: torch::optim::AdamW makes two temporaries of one parameter's size (the square
  // root and its quotient); FusedAdamW's one pass none, on host tensors (a GPU's it steps per op,
  // as AdamW). Where the state lives, there it steps.
  void optimizer_step() {
    if (o_.optimizer_ == Optimizer::kDeviceStateAdamW) return device_state_step();
    int64_t largest = 0;
    for (const GroupLayout& l : layouts_)
      largest = std::max(largest, o_.no_shard_ ? l.unsharded_numel : l.largest_real);
    const bool fused_pass = o_.optimizer_ == Optimizer::kFusedAdamW && (!cuda_ || state_on_host_);
    const double temporaries = fused_pass ? 0 : 2.0 * largest * 4;
    const std::vector<Buffer> t = {{"", "optimizer temporaries", static_cast<int64_t>(temporaries)}};
    if (state_on_host_) point("optimizer step (on the host)", {}, t);
    else point("optimizer step", t);
  }

  // DeviceStateAdamW::step, per parameter in the optimizer's order: its shard and gradient copied
  // to the GPU, the next parameter's copies issued before its update, the update's two
  // temporaries (adamw_per_op.cpp: the square root and its quotient), and the copies freed after
  // the download. The highest moment: 4 bytes x (2 this + 2 next + 2 temporaries of this).
  void device_state_step() {
    const std::vector<std::pair<std::string, int64_t>> order = optimizer_order();
    size_t top = 0;
    int64_t most = -1;
    for (size_t i = 0; i < order.size(); ++i) {
      const int64_t next = i + 1 < order.size() ? order[i + 1].second : 0;
      const int64_t at_i = 4 * order[i].second + 2 * next;
      if (at_i > most) {
        most = at_i;
        top = i;
      }
    }
    if (order.empty()) return point("optimizer step");
    const int64_t current = order[top].second, next = top + 1 < order.size() ? order[top + 1].second : 0;
    point("optimizer step (DeviceStateAdamW, " + order[top].first + ")",
          {{"", "DeviceStateAdamW copies (shard and gradient, this parameter and the next)", 8 * (current + next)},
           {"", "optimizer temporaries", 8 * current}});
  }
  // The parameters as the optimizer holds them (the model's parameters(), registration order),
  // taken as the order forward first uses them: each stage's gradients in forward order, then
  // those no stage names, group by group. Each with this rank's real elements.
  std::vector<std::pair<std::string, int64_t>> optimizer_order() const {
    std::vector<std::pair<std::string, int64_t>> out;
    std::set<std::pair<int, int>> seen;
    auto add = [&](int g, int i) {
      if (seen.insert({g, i}).second) out.push_back({group(g).params[i].name, layouts_[g].real_per_param[i]});
    };
    for (const StageSpec& st : m_.stages)
      for (int i : st.grads) add(st.group, i);
    for (size_t g = 0; g < m_.groups.size(); ++g)
      for (size_t i = 0; i < m_.groups[g].params.size(); ++i) add(static_cast<int>(g), static_cast<int>(i));
    return out;
  }

  const ModelSpec& m_;
  const PlanOptions& o_;
  int64_t shards_ = 1;
  std::vector<GroupLayout> layouts_;
  int64_t pb_ = 4, rb_ = 4;
  bool aliased_ = false;
  bool cuda_ = false, shards_on_host_ = false, state_on_host_ = false;
  std::map<int, int> first_stage_, last_stage_;
  std::vector<int> pending_;
  Ledger ledger_;  // the compute device's memory (the one memory on device cpu)
  Ledger host_;    // device cuda: the host's, apart
  int64_t activation_bytes_ = 0;
  int64_t grad_bytes_ = 0;
};

void check_options(const ModelSpec& m, const PlanOptions& o) {
  require(!m.groups.empty() && !m.stages.empty(), "the model has no groups or no stages");
  require(o.world_ >= 1, "world must be >= 1, got " + std::to_string(o.world_));
  require(m.tensor_parallel >= 1 && o.world_ % m.tensor_parallel == 0,
          "the model's tensor_parallel (" + std::to_string(m.tensor_parallel) + ") must divide the world (" +
              std::to_string(o.world_) + ")");
  require(m.tensor_parallel == 1 || (!o.no_shard_ && o.replicate_ == 1),
          "tensor parallelism combines with FULL_SHARD or SHARD_GRAD_OP only (no_shard and replicate > 1 "
          "with tensor_parallel > 1 are not modelled)");
  require(o.replicate_ >= 1 && o.world_ % o.replicate_ == 0,
          "replicate (" + std::to_string(o.replicate_) + ") must divide the world (" + std::to_string(o.world_) + ")");
  require(o.micro_batches_ >= 1, "micro_batches must be >= 1");
  require(!o.no_shard_ || (o.param_dtype_ == Dtype::kFloat32 && o.reduce_dtype_ == Dtype::kFloat32),
          "no_shard (fsdp::replicate) has no mixed precision");
  require(!o.no_shard_ || !o.offload_, "no_shard (fsdp::replicate) has no offload");
  require(o.device_ == Device::kCpu || !o.no_shard_,
          "no_shard (fsdp::replicate) on device cuda is not modelled (the trainer runs it on cpu only)");
  require(o.optimizer_ != Optimizer::kDeviceStateAdamW || (o.device_ == Device::kCuda && o.offload_),
          "optimizer kDeviceStateAdamW keeps AdamW's state on a GPU beside offloaded parameters: it needs "
          "device(Device::kCuda) and offload(true)");
  for (const StageSpec& s : m.stages) {
    require(s.group >= 0 && s.group < static_cast<int>(m.groups.size()), "stage '" + s.name + "' names no group");
    require(s.pieces >= 1, "stage '" + s.name + "' has pieces < 1");
    for (int i : s.grads)
      require(i >= 0 && i < static_cast<int>(m.groups[s.group].params.size()),
              "stage '" + s.name + "' names a parameter its group does not have");
  }
}

// Per step, per group: what fully_shard issues (param_group.cpp), counted and summed.
std::vector<Collectives> collectives_of(const ModelSpec& m, const PlanOptions& o) {
  std::vector<Collectives> out;
  const int64_t k = o.micro_batches_;
  if (o.no_shard_) {
    if (o.world_ == 1) return out;
    double total = 0;
    for (const GroupSpec& g : m.groups)
      for (const ParamSpec& p : g.params) total += static_cast<double>(p.numel()) * 4;
    // replicate's buckets: the first of 1 MiB, then 25 MiB each (DDP's defaults).
    const double first = 1 << 20, rest = 25.0 * (1 << 20);
    const int64_t buckets = total <= first ? 1 : 1 + static_cast<int64_t>(std::ceil((total - first) / rest));
    out.push_back({"(all)", "all_reduce", "world", buckets, static_cast<int64_t>(total)});
    return out;
  }
  const int64_t shards = shards_of(m, o);
  const int64_t pb = bytes_of(o.param_dtype_), rb = bytes_of(o.reduce_dtype_);
  const bool hybrid = o.replicate_ > 1;
  for (size_t gi = 0; gi < m.groups.size(); ++gi) {
    const GroupLayout l = layout_of(m.groups[gi], shards, 0);
    const std::string name = m.groups[gi].name.empty() ? "(root)" : m.groups[gi].name;
    if (shards > 1) {
      const bool reshards = gi != 0 && m.groups[gi].reshard_after_forward && o.reshard_after_forward_;
      const int64_t per_micro = reshards ? 2 : 1;  // forward (+ backward)
      out.push_back({name, "all_gather", "shard", per_micro * k, per_micro * k * shards * l.row_numel * pb});
      const int64_t rs = hybrid ? k : 1;
      out.push_back({name, "reduce_scatter", "shard", rs, rs * shards * l.row_numel * rb});
    }
    if (hybrid) out.push_back({name, "all_reduce", "replicate", 1, l.row_numel * rb});
  }
  if (m.tensor_parallel > 1) {
    for (const StageSpec& s : m.stages) {
      int64_t count = 0;
      double bytes = 0;
      for (const TpAllReduce& x : s.tp_all_reduces) {
        // A checkpointed stage runs its forward again in backward, all-reduces included.
        const int64_t per_micro = x.forward * (s.checkpointed && x.recomputed ? 2 : 1) + x.backward;
        count += per_micro;
        bytes += per_micro * x.bytes;
      }
      if (count == 0) continue;
      out.push_back({label(s.name), "all_reduce", "tp", count * k, static_cast<int64_t>(std::llround(k * bytes))});
    }
  }
  return out;
}

// How fast one rank runs: the rates of its thread setting, and the share of a core's time each of
// its threads gets when the machine's ranks outnumber its cores.
struct RankSpeed {
  ComputeRates rates;
  double share = 1;
  double oversubscription = 1;  // ranks (threads) per core, at least 1
};

RankSpeed speed_of(const PlanOptions& o) {
  const Constants& c = o.constants_;
  const int local = o.local_world_ > 0 ? o.local_world_ : o.world_;
  Threads t = o.threads_;
  if (t == Threads::kAsLaunched) t = local > 1 ? Threads::kOnePerRank : Threads::kLibraryDefaults;
  RankSpeed s;
  const double cores = std::max(1, c.cpu_cores);
  // Each rank alone would use the whole machine with the libraries' threads: they take turns.
  s.oversubscription = std::max(1.0, t == Threads::kOnePerRank ? local / cores : static_cast<double>(local));
  s.share = 1 / s.oversubscription;
  s.rates = t == Threads::kOnePerRank ? c.one_thread : c.single_rank;
  return s;
}

// Per collective: a latency for each step of its ring, the bytes at the bus bandwidth; with more
// ranks than cores a waiting rank's peer must first get a core (measured at two ranks per core).
double collective_seconds(const Collectives& x, double parts, const PlanOptions& o, const RankSpeed& speed) {
  const Constants& c = o.constants_;
  const bool mpi = o.backend_ == Backend::kMpi;
  const double base = mpi ? c.mpi_collective_latency_s : c.collective_latency_s;
  const double over = mpi ? c.mpi_collective_latency_s_oversubscribed : c.collective_latency_s_oversubscribed;
  const double step_latency = base + (over - base) * (speed.oversubscription - 1);
  const double bus = (mpi ? c.mpi_collective_bytes_per_s : c.collective_bytes_per_s) * speed.share;
  const double factor = x.kind == "all_reduce" ? 2 * (parts - 1) / parts : (parts - 1) / parts;
  return x.count * (parts - 1) * step_latency + x.bytes * factor / bus;
}

void step_time(const ModelSpec& m, const PlanOptions& o, const std::vector<Collectives>& coll, Plan& p) {
  const Constants& c = o.constants_;
  const RankSpeed speed = speed_of(o);
  const ComputeRates& r = speed.rates;
  const bool fp32 = o.param_dtype_ == Dtype::kFloat32;
  const double matmul_rate = (fp32 ? r.matmul_flops_fp32 : r.matmul_flops_bf16) * speed.share;
  double matmul_s = 0, elementwise_s = 0;
  for (const StageSpec& s : m.stages) {
    // forward, backward (twice the forward), and the forward again when checkpointed
    const double passes = 3 + (s.checkpointed ? 1 : 0);
    const bool in_fp32 = fp32 || s.elementwise_in_fp32;
    const double bandwidth = (in_fp32 ? r.elementwise_bytes_per_s_fp32 : r.elementwise_bytes_per_s_bf16) * speed.share;
    matmul_s += passes * s.forward_flops / matmul_rate;
    elementwise_s += passes * s.other_bytes_moved / bandwidth;
  }
  const double k = static_cast<double>(o.micro_batches_);
  p.compute_s = k * (matmul_s + elementwise_s);
  const int64_t shards = shards_of(m, o);
  double comm = 0;
  for (const Collectives& x : coll) {
    const double parts = x.mesh == "replicate" ? o.replicate_
                         : x.mesh == "tp"      ? m.tensor_parallel
                         : x.mesh == "world"   ? o.world_
                                               : static_cast<double>(shards);
    comm += collective_seconds(x, parts, o, speed);
  }
  p.communication_s = comm;
  double params = 0;  // this rank's tp pieces, whole
  for (const GroupSpec& g : m.groups)
    for (const ParamSpec& q : g.params) params += static_cast<double>(q.numel());
  const double per_rank = params / shards;
  // Bytes per parameter one step moves: FusedAdamW's one pass 28, AdamW's per-op passes about
  // twice that; the gradient norm reads the gradients once more.
  const double optimizer_bytes = (o.optimizer_ == Optimizer::kFusedAdamW ? 28.0 : 60.0) + 4;
  p.optimizer_s = per_rank * optimizer_bytes / (c.memory_bytes_per_s * speed.share);
  double per_micro_batch = 0;
  const double per_stage = fp32 ? c.stage_overhead_s : c.bf16_stage_overhead_s;
  for (const StageSpec& s : m.stages)
    per_micro_batch += per_stage + (s.checkpointed ? c.checkpointed_stage_overhead_s : 0);
  p.overhead_s = k * per_micro_batch / speed.share;
  p.step_time_s = p.compute_s + p.communication_s + p.optimizer_s + p.overhead_s;
}

}  // namespace

Plan plan(const ModelSpec& model, const PlanOptions& options) {
  check_options(model, options);
  Plan p;
  p.constants_source = options.constants_.source;
  const std::vector<Collectives> coll = collectives_of(model, options);
  for (int r = 0; r < options.world_; ++r) {
    RankPlan rp = StepReplay(model, options, r).run(r);
    rp.collectives = coll;
    p.ranks.push_back(std::move(rp));
  }
  // The rates are CPU and Gloo measurements: no GPU step time is made of them; an evaluation has
  // no step.
  if (options.evaluation_) {
    p.step_time_modeled = false;
    for (RankPlan& r : p.ranks) r.collectives.clear();
  } else if (options.device_ == Device::kCuda) {
    p.step_time_modeled = false;
  } else {
    step_time(model, options, coll, p);
  }
  return p;
}

}  // namespace plan
}  // namespace fsdp
