// bench_bf16_ops: forward + backward time of the Transformer's non-matmul ops (and its attention
// matmuls) in fp32 and bf16, at the shapes of the peer benchmark's presets, in LibTorch on CPU.
// Under mixed precision (param_dtype bf16) the whole model computes in bf16, so an op whose bf16
// CPU kernel is slow in LibTorch 1.13 costs step time that bf16 matmuls do not win back.
//
//   bench_bf16_ops [--presets small,medium] [--threads T[,T...]] [--reps K] [--min-time-ms MS]
//                  [--ops NAME[,NAME...]] [--json]
//
// Defaults: --presets small,medium --threads 1 --reps 3 --min-time-ms 100, all ops.
// Shapes per preset (bench/peer_ab.py's defaults: small B = 8, T = 256, d = 256, h = 8,
// V = 8192; medium B = 2, T = 512, d = 768, h = 12, V = 32000), each op as the model in
// src/models/transformer/transformer.cpp calls it:
//   layer_norm     at::layer_norm over d of (B, T, d), bf16 weight and bias (params are bf16 too)
//   softmax        at::softmax(-1) of the scores (B, h, T, T)
//   masked_fill    scores.masked_fill(causal mask, -inf), (B, h, T, T)
//   gelu           at::gelu (exact erf form) of (B, T, 4d)
//   dropout        at::dropout(p = 0.1, train) of (B, T, d) (the benchmark runs use p = 0)
//   dropout_probs  at::dropout(p = 0.1, train) of the probabilities (B, h, T, T)
//   embedding      at::embedding of (V, d) by (B, T) token ids; backward = embedding_dense_backward
//   cross_entropy  cross_entropy (log_softmax + nll_loss, mean) of (B*T, V) logits; the model
//                  itself casts the logits to fp32 first (see to_float)
//   to_float       the model's logits.to(kFloat) of (B, T, V) and its backward (bf16 only;
//                  the fp32 row is a no-op)
//   residual_add   x + f(x) of (B, T, d)
//   attn_scores    at::matmul(q, k^T), (B, h, T, d/h) x (B, h, d/h, T)   (attention's bmm)
//   attn_av        at::matmul(probs, v), (B, h, T, T) x (B, h, T, d/h)
// Each row: forward (with autograd recording) and backward (y.backward(random grad), inputs'
// .grad reset to undefined before every iteration, as zero_grad(set_to_none)) in ms, the best of
// --reps repetitions of at least --min-time-ms each (fp32 and bf16 repetitions alternate), and
// bf16 / fp32 of the forward + backward time. Inputs are drawn in fp32 and cast, so both dtypes
// see the same values. The fp32 to_float row is a no-op forward whose backward copies the
// gradient into .grad: for that op read the bf16 row as the extra cost of bf16.
//
// Memory: the program links the fsdp library, whose CPU block cache (fsdp/memory.h, on unless
// FSDP_CPU_CACHING=0) hands freed blocks back to the next iteration, as in fsdp-train; without it
// each iteration's fresh outputs fault in new pages, which on these VMs costs more than many of
// the kernels timed here (e.g. ~70 ms for a 64 MiB gradient).
#include <fsdp/memory.h>

#include <torch/torch.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace {

struct Preset {
  std::string name;
  int64_t batch, seq, dim, heads, vocab;
};

const std::vector<Preset> kPresets = {
    {"tiny", 4, 16, 16, 4, 8},
    {"small", 8, 256, 256, 8, 8192},
    {"medium", 2, 512, 768, 12, 32000},
};

const std::vector<std::string> kOps = {"layer_norm", "softmax",       "masked_fill", "gelu",
                                       "dropout",    "dropout_probs", "embedding",   "cross_entropy",
                                       "to_float",   "residual_add",  "attn_scores", "attn_av"};

struct Options {
  std::vector<std::string> presets{"small", "medium"};
  std::vector<int> threads{1};
  std::vector<std::string> ops = kOps;
  int reps = 3;
  double min_time_ms = 100;
  bool json = false;
};

[[noreturn]] void usage(const char* argv0, int rc) {
  std::fprintf(rc ? stderr : stdout,
               "usage: %s [--presets tiny,small,medium] [--threads T[,T...]] [--reps K] "
               "[--min-time-ms MS] [--ops NAME[,NAME...]] [--json]\n",
               argv0);
  std::exit(rc);
}

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ','))
    if (!item.empty()) out.push_back(item);
  return out;
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto value = [&]() -> std::string {
      auto eq = a.find('=');
      if (eq != std::string::npos) return a.substr(eq + 1);
      if (i + 1 >= argc) usage(argv[0], 2);
      return argv[++i];
    };
    auto starts = [&](const char* p) {
      std::string s(p);
      return a == s || a.rfind(s + "=", 0) == 0;
    };
    try {
      if (a == "--json") {
        o.json = true;
      } else if (a == "-h" || a == "--help") {
        usage(argv[0], 0);
      } else if (starts("--presets")) {
        o.presets = split(value());
      } else if (starts("--threads")) {
        o.threads.clear();
        for (auto& s : split(value())) o.threads.push_back(std::stoi(s));
      } else if (starts("--reps")) {
        o.reps = std::stoi(value());
      } else if (starts("--min-time-ms")) {
        o.min_time_ms = std::stod(value());
      } else if (starts("--ops")) {
        o.ops = split(value());
      } else {
        usage(argv[0], 2);
      }
    } catch (const std::logic_error&) {
      usage(argv[0], 2);
    }
  }
  if (o.reps < 1 || o.threads.empty() || o.presets.empty() || o.ops.empty()) usage(argv[0], 2);
  for (int t : o.threads)
    if (t < 1) usage(argv[0], 2);
  for (auto& p : o.presets)
    if (std::none_of(kPresets.begin(), kPresets.end(), [&](const Preset& x) { return x.name == p; })) usage(argv[0], 2);
  for (auto& op : o.ops)
    if (std::find(kOps.begin(), kOps.end(), op) == kOps.end()) usage(argv[0], 2);
  return o;
}

std::string cpu_model() {
  std::ifstream f("/proc/cpuinfo");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind("model name", 0) == 0) return line.substr(line.find(':') + 2);
  return "unknown";
}

// One op instance: its leaves (inputs needing gradients) and a forward producing one tensor.
struct Case {
  std::string shape;               // for the table
  std::vector<at::Tensor> leaves;  // requires_grad inputs
  std::function<at::Tensor()> forward;
};

at::Tensor leaf(const at::Tensor& fp32, at::ScalarType st) { return fp32.to(st).detach().requires_grad_(true); }

std::string dims(std::initializer_list<int64_t> d) {
  std::string s = "(";
  for (auto it = d.begin(); it != d.end(); ++it) s += (it == d.begin() ? "" : ", ") + std::to_string(*it);
  return s + ")";
}

Case make_case(const std::string& op, const Preset& p, at::ScalarType st) {
  const int64_t B = p.batch, T = p.seq, d = p.dim, h = p.heads, V = p.vocab, hd = d / h;
  const auto opt = at::TensorOptions().dtype(at::kFloat);
  Case c;
  if (op == "layer_norm") {
    at::Tensor x = leaf(at::randn({B, T, d}, opt), st), w = leaf(1 + 0.1 * at::randn({d}, opt), st),
               b = leaf(0.1 * at::randn({d}, opt), st);
    c.shape = dims({B, T, d});
    c.leaves = {x, w, b};
    c.forward = [=] { return at::layer_norm(x, {d}, w, b, 1e-5); };
  } else if (op == "softmax" || op == "masked_fill" || op == "dropout_probs") {
    at::Tensor x =
        leaf(op == "dropout_probs" ? at::softmax(at::randn({B, h, T, T}, opt), -1) : at::randn({B, h, T, T}, opt), st);
    c.shape = dims({B, h, T, T});
    c.leaves = {x};
    if (op == "softmax") {
      c.forward = [=] { return at::softmax(x, -1); };
    } else if (op == "masked_fill") {
      at::Tensor future = at::ones({T, T}, at::TensorOptions().dtype(at::kBool)).triu(1);
      c.forward = [=] { return x.masked_fill(future, -std::numeric_limits<double>::infinity()); };
    } else {
      c.forward = [=] { return at::dropout(x, 0.1, /*train=*/true); };
    }
  } else if (op == "gelu") {
    at::Tensor x = leaf(at::randn({B, T, 4 * d}, opt), st);
    c.shape = dims({B, T, 4 * d});
    c.leaves = {x};
    c.forward = [=] { return at::gelu(x); };
  } else if (op == "dropout" || op == "residual_add") {
    at::Tensor x = leaf(at::randn({B, T, d}, opt), st);
    c.shape = dims({B, T, d});
    c.leaves = {x};
    if (op == "dropout") {
      c.forward = [=] { return at::dropout(x, 0.1, /*train=*/true); };
    } else {
      at::Tensor y = leaf(at::randn({B, T, d}, opt), st);
      c.leaves.push_back(y);
      c.forward = [=] { return x + y; };
    }
  } else if (op == "embedding") {
    at::Tensor w = leaf(at::randn({V, d}, opt), st);
    at::Tensor ids = at::randint(V, {B, T}, at::TensorOptions().dtype(at::kLong));
    c.shape = dims({V, d}) + " by " + dims({B, T});
    c.leaves = {w};
    c.forward = [=] { return at::embedding(w, ids); };
  } else if (op == "cross_entropy") {
    at::Tensor x = leaf(at::randn({B * T, V}, opt), st);
    at::Tensor t = at::randint(V, {B * T}, at::TensorOptions().dtype(at::kLong));
    c.shape = dims({B * T, V});
    c.leaves = {x};
    c.forward = [=] { return torch::nn::functional::cross_entropy(x, t); };
  } else if (op == "to_float") {
    at::Tensor x = leaf(at::randn({B, T, V}, opt), st);
    c.shape = dims({B, T, V});
    c.leaves = {x};
    c.forward = [=] { return x.to(at::kFloat); };
  } else if (op == "attn_scores") {
    at::Tensor q = leaf(at::randn({B, h, T, hd}, opt), st), k = leaf(at::randn({B, h, T, hd}, opt), st);
    c.shape = dims({B, h, T, hd}) + " x k^T";
    c.leaves = {q, k};
    c.forward = [=] { return at::matmul(q, k.transpose(-2, -1)); };
  } else if (op == "attn_av") {
    at::Tensor pr = leaf(at::softmax(at::randn({B, h, T, T}, opt), -1), st),
               v = leaf(at::randn({B, h, T, hd}, opt), st);
    c.shape = dims({B, h, T, T}) + " x " + dims({B, h, T, hd});
    c.leaves = {pr, v};
    c.forward = [=] { return at::matmul(pr, v); };
  }
  return c;
}

struct Timing {
  double fwd_s = 0, bwd_s = 0;
  int64_t inner = 0;
};

// Times one case: warm-up and calibration, then repetitions of `inner` iterations each, keeping
// the fastest repetition (its per-iteration forward and backward times).
class CaseTimer {
 public:
  CaseTimer(Case c, double min_time_ms) : c_(std::move(c)) {
    double f = 0, b = 0;
    once(f, b);  // warm-up
    f = b = 0;
    once(f, b);  // calibration
    best_.inner = std::max<int64_t>(1, static_cast<int64_t>(std::ceil(min_time_ms * 1e-3 / std::max(f + b, 1e-9))));
  }
  void rep() {
    double f = 0, b = 0;
    for (int64_t i = 0; i < best_.inner; ++i) once(f, b);
    f /= static_cast<double>(best_.inner);
    b /= static_cast<double>(best_.inner);
    if (f + b < best_total_) {
      best_total_ = f + b;
      best_.fwd_s = f;
      best_.bwd_s = b;
    }
  }
  const Timing& best() const { return best_; }
  const std::string& shape() const { return c_.shape; }

 private:
  void once(double& fwd, double& bwd) {
    for (auto& l : c_.leaves) l.mutable_grad() = at::Tensor();
    auto t0 = std::chrono::steady_clock::now();
    at::Tensor y = c_.forward();
    auto t1 = std::chrono::steady_clock::now();
    if (!gy_.defined()) gy_ = at::randn(y.sizes(), y.options().requires_grad(false));
    y.backward(gy_);
    auto t2 = std::chrono::steady_clock::now();
    fwd += std::chrono::duration<double>(t1 - t0).count();
    bwd += std::chrono::duration<double>(t2 - t1).count();
  }
  Case c_;
  at::Tensor gy_;
  Timing best_;
  double best_total_ = 1e300;
};

struct Row {
  std::string preset, op, shape;
  int threads;
  Timing fp32, bf16;
};

}  // namespace

int main(int argc, char** argv) {
  const Options opt = parse(argc, argv);
  at::manual_seed(0);
  std::vector<Row> rows;
  for (int t : opt.threads) {
    at::set_num_threads(t);
    for (auto& pname : opt.presets) {
      const Preset& p =
          *std::find_if(kPresets.begin(), kPresets.end(), [&](const Preset& x) { return x.name == pname; });
      for (auto& op : opt.ops) {
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
        Row r;
        r.preset = p.name, r.op = op, r.threads = t;
        CaseTimer fp32(make_case(op, p, at::kFloat), opt.min_time_ms);
        CaseTimer bf16(make_case(op, p, at::kBFloat16), opt.min_time_ms);
        for (int k = 0; k < opt.reps; ++k) {  // alternating, so that drift hits both dtypes
          fp32.rep();
          bf16.rep();
        }
        r.shape = fp32.shape();
        r.fp32 = fp32.best();
        r.bf16 = bf16.best();
        rows.push_back(r);
        if (!opt.json) std::fprintf(stderr, ".");
      }
    }
  }
  if (!opt.json) std::fprintf(stderr, "\n");

  if (opt.json) {
    std::printf("{\"cpu_model\":\"%s\",\"fsdp_block_cache\":%s,\"torch_threads\":[", cpu_model().c_str(),
                fsdp::memory::tracking_allocator_installed() ? "true" : "false");
    for (size_t i = 0; i < opt.threads.size(); ++i) std::printf("%s%d", i ? "," : "", opt.threads[i]);
    std::printf("],\"rows\":[");
    for (size_t i = 0; i < rows.size(); ++i) {
      const auto& r = rows[i];
      std::printf(
          "%s{\"preset\":\"%s\",\"op\":\"%s\",\"shape\":\"%s\",\"threads\":%d,"
          "\"fp32_fwd_ms\":%.4g,\"fp32_bwd_ms\":%.4g,\"bf16_fwd_ms\":%.4g,\"bf16_bwd_ms\":%.4g,"
          "\"ratio_bf16_fp32\":%.4g}",
          i ? "," : "", r.preset.c_str(), r.op.c_str(), r.shape.c_str(), r.threads, r.fp32.fwd_s * 1e3,
          r.fp32.bwd_s * 1e3, r.bf16.fwd_s * 1e3, r.bf16.bwd_s * 1e3,
          (r.bf16.fwd_s + r.bf16.bwd_s) / (r.fp32.fwd_s + r.fp32.bwd_s));
    }
    std::printf("]}\n");
    return 0;
  }
  std::printf(
      "CPU: %s; LibTorch ATen threads per row; forward + backward, best of %d repetitions "
      "(each >= %g ms); ms per call; fsdp CPU block cache: %s\n\n",
      cpu_model().c_str(), opt.reps, opt.min_time_ms,
      fsdp::memory::tracking_allocator_installed() ? "installed (see FSDP_CPU_CACHING)" : "not installed");
  std::printf(
      "| preset | threads | op | shape | fp32 fwd | fp32 bwd | bf16 fwd | bf16 bwd | "
      "bf16/fp32 fwd | bf16/fp32 bwd | bf16/fp32 fwd+bwd |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|---|---|\n");
  for (auto& r : rows)
    std::printf("| %s | %d | %s | %s | %.3f | %.3f | %.3f | %.3f | %.2f | %.2f | **%.2f** |\n", r.preset.c_str(),
                r.threads, r.op.c_str(), r.shape.c_str(), r.fp32.fwd_s * 1e3, r.fp32.bwd_s * 1e3, r.bf16.fwd_s * 1e3,
                r.bf16.bwd_s * 1e3, r.bf16.fwd_s / r.fp32.fwd_s, r.bf16.bwd_s / r.fp32.bwd_s,
                (r.bf16.fwd_s + r.bf16.bwd_s) / (r.fp32.fwd_s + r.fp32.bwd_s));
  return 0;
}
