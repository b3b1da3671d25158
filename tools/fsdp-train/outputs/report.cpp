// report.cpp — step lines, progress bar, JSONL metrics and the end-of-run summary of fsdp-train.
#include "outputs/report.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <iostream>
#include <sstream>
#include <stdexcept>
#include <unistd.h>

namespace fsdp {
namespace train {
namespace {

std::string fixed(double v, int digits) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", digits, v);
  return buf;
}

// 12345678 -> "12,345,678" (torchtitan prints tokens per second this way).
std::string grouped(double v) {
  std::string digits = std::to_string(static_cast<int64_t>(std::llround(v)));
  std::string out;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out.push_back(',');
    out.push_back(digits[i]);
  }
  return out;
}

std::string duration(double s) {
  if (!(s >= 0) || !std::isfinite(s)) return "?";
  const int64_t t = static_cast<int64_t>(s + 0.5);
  char buf[32];
  if (t >= 3600)
    std::snprintf(buf, sizeof buf, "%lld:%02lld:%02lld", (long long)(t / 3600), (long long)(t / 60 % 60),
                  (long long)(t % 60));
  else std::snprintf(buf, sizeof buf, "%lld:%02lld", (long long)(t / 60), (long long)(t % 60));
  return buf;
}

// {dim name: {kind: {calls_per_rank, bytes_per_rank, s_per_rank, wait_s_per_rank}}}.
nlohmann::json comm_by_mesh_dim(const std::vector<std::string>& dim_names, const std::vector<RankTotals>& ranks) {
  const std::pair<const char*, double KindTotals::*> fields[] = {{"calls_per_rank", &KindTotals::calls},
                                                                 {"bytes_per_rank", &KindTotals::bytes},
                                                                 {"s_per_rank", &KindTotals::s},
                                                                 {"wait_s_per_rank", &KindTotals::wait_s}};
  nlohmann::json by_dim = nlohmann::json::object();
  for (size_t d = 0; d < dim_names.size(); ++d) {
    nlohmann::json by_kind = nlohmann::json::object();
    for (int k = 0; k < kCollectiveKinds; ++k) {
      nlohmann::json kind = nlohmann::json::object();
      for (const auto& [name, field] : fields) {
        std::vector<double> values;
        for (const RankTotals& r : ranks)
          values.push_back(d < r.by_mesh_dim.size() ? r.by_mesh_dim[d].by_kind[k].*field : 0.0);
        kind[name] = values;
      }
      by_kind[kCollectiveKindNames[k]] = kind;
    }
    by_dim[dim_names[d]] = by_kind;
  }
  return by_dim;
}

}  // namespace

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

std::string format_step_line(const StepReport& r) {
  std::ostringstream s;
  s << "step: " << r.step << "  loss: " << fixed(r.loss, 4);
  if (r.eval_loss) s << "  eval loss: " << fixed(*r.eval_loss, 4);
  s << "  grad_norm: " << fixed(r.grad_norm, 4);
  char lr[32];
  std::snprintf(lr, sizeof lr, "%.2e", r.lr);
  s << "  lr: " << lr << "  tps: " << grouped(r.tokens_per_s) << "  step_time: " << fixed(r.step_s, 3) << "s";
  if (!r.precision.empty()) s << "  precision: " << r.precision;
  if (r.loss_scale > 0)
    s << "  loss_scale: " << r.loss_scale << (r.overflow_skipped ? " (overflow: step skipped)" : "");
  s << "  memory (live/peak MiB per rank):";
  for (size_t q = 0; q < r.ranks.size(); ++q)
    s << (q ? " |" : "") << " " << fixed(r.ranks[q].live_mib, 1) << "/" << fixed(r.ranks[q].peak_mib, 1);
  return s.str();
}

const char* const kCollectiveKindNames[kCollectiveKinds] = {"all_gather", "reduce_scatter", "all_reduce", "broadcast",
                                                            "barrier"};

namespace {
constexpr size_t kScalarFields = 13;  // RankTotals' numbers before by_mesh_dim
constexpr size_t kKindFields = 4;     // KindTotals' numbers
}  // namespace

size_t RankTotals::field_count(size_t mesh_dims) { return kScalarFields + mesh_dims * kCollectiveKinds * kKindFields; }

std::vector<double> RankTotals::to_vector() const {
  std::vector<double> v = {
      peak_rss_mib, peak_tensor_mib, median_step_s,        ag_s, ag_wait_s, rs_s, rs_wait_s, ar_s, ar_wait_s, ag_bytes,
      rs_bytes,     ar_bytes,        build_peak_tensor_mib};
  for (const MeshDimTotals& dim : by_mesh_dim) {
    for (const KindTotals& k : dim.by_kind) v.insert(v.end(), {k.calls, k.bytes, k.s, k.wait_s});
  }
  return v;
}

RankTotals RankTotals::from(const double* f, size_t mesh_dims) {
  RankTotals r{f[0], f[1], f[2], f[3], f[4], f[5], f[6], f[7], f[8], f[9], f[10], f[11], f[12], {}};
  f += kScalarFields;
  r.by_mesh_dim.resize(mesh_dims);
  for (MeshDimTotals& dim : r.by_mesh_dim) {
    for (KindTotals& k : dim.by_kind) {
      k = KindTotals{f[0], f[1], f[2], f[3]};
      f += kKindFields;
    }
  }
  return r;
}

size_t summary_warmup_steps(int64_t summary_warmup, size_t steps) {
  return std::min<size_t>(static_cast<size_t>(summary_warmup), steps > 1 ? steps - 1 : 0);
}

double median_after(const std::vector<double>& v, size_t skip) {
  std::vector<double> rest(v.begin() + static_cast<std::ptrdiff_t>(std::min(skip, v.size())), v.end());
  if (rest.empty()) return NAN;
  std::sort(rest.begin(), rest.end());
  const size_t n = rest.size();
  return n % 2 ? rest[n / 2] : 0.5 * (rest[n / 2 - 1] + rest[n / 2]);
}

std::string format_summary(const RunSummary& sum) {
  std::ostringstream s;
  char buf[256];
  std::snprintf(buf, sizeof buf, "summary: %lld steps, loss %.4f -> %.4f", static_cast<long long>(sum.steps_run),
                sum.losses.front(), sum.losses.back());
  s << buf;
  if (!sum.precision.empty()) s << " (" << sum.precision << ")";
  s << "\n";
  std::snprintf(buf, sizeof buf, "  median step %.4f s (steps after the first %zu), %s tokens/s\n", sum.median_step_s,
                sum.warmup, grouped(sum.tokens_per_s).c_str());
  s << buf;
  for (size_t q = 0; q < sum.ranks.size(); ++q) {
    const RankTotals& r = sum.ranks[q];
    const double exposed = r.ag_wait_s + r.rs_wait_s + r.ar_wait_s;
    std::snprintf(buf, sizeof buf,
                  "  rank %zu: peak RSS %.1f MiB, peak tensors %.1f MiB (%.1f MiB building the model); all-gather "
                  "%.3f s + reduce-scatter %.3f s + all-reduce %.3f s of communication, %.3f s exposed (waited for), "
                  "%.3f s hidden\n",
                  q, r.peak_rss_mib, r.peak_tensor_mib, r.build_peak_tensor_mib, r.ag_s, r.rs_s, r.ar_s, exposed,
                  std::max(0.0, r.ag_s + r.rs_s + r.ar_s - exposed));
    s << buf;
  }
  return s.str();
}

void write_summary_json(const std::string& path, const RunShape& shape, const RunSummary& s) {
  nlohmann::json j = {{"world", shape.world},
                      {"preset", shape.preset},
                      {"params", shape.params},
                      {"batch", shape.batch},
                      {"gradient_accumulation_steps", shape.gradient_accumulation_steps},
                      {"seq", shape.seq},
                      {"steps", s.steps_run},
                      {"warmup", s.warmup},
                      {"median_step_s", s.median_step_s},
                      {"tokens_per_s", s.tokens_per_s},
                      {"losses", s.losses},
                      {"step_s_rank0", s.step_s},
                      {"torch_threads", shape.torch_threads},
                      {"param_dtype", shape.param_dtype},
                      {"reduce_dtype", shape.reduce_dtype}};
  j["model_args"] = {{"n_layers", shape.n_layers}, {"vocab_size", shape.vocab_size}, {"max_seq_len", shape.max_seq_len},
                     {"dim", shape.dim},           {"n_heads", shape.n_heads},       {"dropout_p", shape.dropout_p}};
  const std::pair<const char*, double RankTotals::*> per_rank_fields[] = {
      {"median_step_s_per_rank", &RankTotals::median_step_s},
      {"peak_rss_mib_per_rank", &RankTotals::peak_rss_mib},
      {"peak_tensor_mib_per_rank", &RankTotals::peak_tensor_mib},
      {"all_gather_s_per_rank", &RankTotals::ag_s},
      {"all_gather_wait_s_per_rank", &RankTotals::ag_wait_s},
      {"reduce_scatter_s_per_rank", &RankTotals::rs_s},
      {"reduce_scatter_wait_s_per_rank", &RankTotals::rs_wait_s},
      {"all_reduce_s_per_rank", &RankTotals::ar_s},
      {"all_reduce_wait_s_per_rank", &RankTotals::ar_wait_s},
      {"all_gather_bytes_per_rank", &RankTotals::ag_bytes},
      {"reduce_scatter_bytes_per_rank", &RankTotals::rs_bytes},
      {"all_reduce_bytes_per_rank", &RankTotals::ar_bytes},
      {"build_peak_tensor_mib_per_rank", &RankTotals::build_peak_tensor_mib}};
  for (const auto& [name, field] : per_rank_fields) {
    std::vector<double> values;
    for (const RankTotals& r : s.ranks) values.push_back(r.*field);
    j[name] = values;
  }
  j["model_parallel_size"] = shape.model_parallel_size;
  j["vocab_parallel"] = shape.vocab_parallel;
  j["mesh_shape"] = shape.mesh_shape;
  j["mesh_dim_names"] = shape.mesh_dim_names;
  j["comm_by_mesh_dim"] = comm_by_mesh_dim(shape.mesh_dim_names, s.ranks);
  std::ofstream f(path);
  f << j.dump() << "\n";
  if (!f) throw std::runtime_error(path + ": cannot write the summary (logging.summary_json)");
}

Console::Console(const std::string& progress, int64_t first_step, int64_t steps)
    : first_step_(first_step), steps_(steps), started_(now_seconds()) {
  bar_ = progress == "on" || (progress == "auto" && isatty(STDOUT_FILENO));
}

void Console::clear_bar() {
  if (bar_drawn_) std::cout << "\r\033[K";  // back to the line's start, erase it
  bar_drawn_ = false;
}

void Console::draw_bar(int64_t step) {
  if (!bar_) return;
  constexpr int kWidth = 30;
  const double done = steps_ > 0 ? static_cast<double>(step) / steps_ : 1.0;
  const int filled = static_cast<int>(done * kWidth);
  const double elapsed = now_seconds() - started_;
  const int64_t run = step - first_step_;
  const double eta = run > 0 ? elapsed / run * (steps_ - step) : NAN;
  std::cout << "[" << std::string(filled, '#') << std::string(kWidth - filled, '.') << "] " << step << "/" << steps_
            << "  " << duration(elapsed) << " elapsed, eta " << duration(eta) << std::flush;
  bar_drawn_ = true;
}

void Console::step_line(const StepReport& r) {
  clear_bar();
  std::cout << format_step_line(r) << "\n";
  draw_bar(r.step);
  std::cout << std::flush;
}

void Console::progress(int64_t step) {
  if (!bar_) return;
  clear_bar();
  draw_bar(step);
}

void Console::line(const std::string& text) {
  clear_bar();
  std::cout << text << "\n" << std::flush;
}

void Console::finish() {
  clear_bar();
  bar_ = false;
  std::cout << std::flush;
}

std::string jsonl_path_for_rank(const std::string& path_template, int rank) {
  const auto pos = path_template.find("{rank}");
  if (pos == std::string::npos) return rank == 0 ? path_template : std::string();
  std::string p = path_template;
  p.replace(pos, 6, std::to_string(rank));
  return p;
}

void JsonlWriter::open(const std::string& path, bool append) {
  const auto parent = std::filesystem::path(path).parent_path();
  if (!parent.empty()) std::filesystem::create_directories(parent);
  out_.open(path, append ? std::ios::app : std::ios::trunc);
  if (!out_) throw std::runtime_error(path + ": cannot write the JSONL metrics (logging.jsonl)");
}

void JsonlWriter::write(const StepReport& r, int rank) {
  nlohmann::json j = {{"step", r.step},
                      {"rank", rank},
                      {"loss", r.loss},
                      {"local_loss", r.ranks.at(rank).local_loss},
                      {"lr", r.lr},
                      {"step_s", r.step_s},
                      {"forward_s", r.forward_s},
                      {"backward_s", r.backward_s},
                      {"optimizer_s", r.optimizer_s},
                      {"tokens_per_s", r.tokens_per_s},
                      {"tokens_seen", r.tokens_seen},
                      {"live_mib", r.ranks.at(rank).live_mib},
                      {"peak_mib", r.ranks.at(rank).peak_mib},
                      {"rss_mib", r.ranks.at(rank).rss_mib},
                      {"all_gather_s", r.ag_busy_s},
                      {"all_gather_wait_s", r.ag_wait_s},
                      {"reduce_scatter_s", r.rs_busy_s},
                      {"reduce_scatter_wait_s", r.rs_wait_s},
                      {"grad_norm", r.grad_norm}};
  if (r.eval_loss) j["eval_loss"] = *r.eval_loss;
  if (r.loss_scale > 0) {
    j["loss_scale"] = r.loss_scale;
    j["overflow_skipped"] = r.overflow_skipped;
  }
  write_raw(j.dump());
}

void JsonlWriter::write_raw(const std::string& json_line) {
  if (!out_.is_open()) return;
  out_ << json_line << "\n" << std::flush;  // flushed: a killed run keeps its lines
}

}  // namespace train
}  // namespace fsdp
