// bench_matmul: GFLOP/s of at::matmul (fp32 and bf16) and a numeric check of
// the kernels LibTorch is using: the system BLAS for fp32, oneDNN or ATen's
// own fallback gemm for bf16. Used to pick the system BLAS (docs/blas.md,
// scripts/select-blas.sh) and by bench/peer_ab.py for the matmul rates behind
// its matmul-fraction and MFU columns.
//
//   bench_matmul [--n N[,N...]] [--shapes [B*]MxKxN[,...]] [--reps K]
//                [--threads T[,T...]] [--dtypes fp32,bf16] [--min-time-ms MS]
//                [--bf16-kernel auto|fallback] [--json]
//
// Defaults: --n 2048 (only when --shapes is not given) --reps 3
// --threads 1,2 --dtypes fp32,bf16 --min-time-ms 50 --bf16-kernel auto.
// --n N times the product of two N x N matrices. --shapes MxKxN times
// (M x K) x (K x N);
// BxMxKxN times a batched product (B, M, K) x (B, K, N) (at::matmul -> bmm,
// as attention's QK^T and AV). Each row reports the best of K timed
// repetitions after two warm-up calls; a repetition repeats the product until
// it has run at least --min-time-ms (so small shapes are timed over many
// calls) and best_ms is the time of one product.
//
// Threads: a row's thread count is passed to at::set_num_threads(), which
// governs ATen's OpenMP loops and oneDNN (the bf16 path). Debian's LibTorch
// calls the BLAS through the plain Fortran interface, so the BLAS's own
// thread count comes from its environment (OPENBLAS_NUM_THREADS,
// BLIS_NUM_THREADS); the "blas_thr" column shows what the BLAS reports.
//
// Which bf16 kernel ran. LibTorch 1.13 (cpublas::gemm for BFloat16 ->
// mkldnn_bf16_gemm in aten/src/ATen/native/mkldnn/Matmul.cpp) hands a bf16
// gemm to oneDNN only when at::hasMKLDNN(), at::globalContext()
// .userEnabledMkldnn(), the CPU has avx512bw, avx512vl and avx512dq
// (mkldnn_bf16_device_check, via cpuinfo) and m*n*k > 16*16*16; otherwise it
// runs ATen's scalar fallback gemm (gemm_stub, native/cpu/BlasKernel.cpp).
// The program prints that prediction (CPU flags from __builtin_cpu_supports,
// which, like cpuinfo, also requires the OS to enable the AVX-512 state) and,
// for every check and timed row, what actually ran: it switches oneDNN's
// verbose mode on (dnnl_set_verbose, looked up in the loaded libdnnl) for
// one call of that product, with stdout diverted to a temporary file, and
// reads back the "*_verbose,exec,cpu,<primitive>,<implementation>" lines.
// No line means no oneDNN primitive ran: the ATen fallback. (With
// DNNL_VERBOSE/ONEDNN_VERBOSE set in the environment, the probed calls' lines
// are passed on to stderr and the other calls' lines go to stdout as usual,
// so the --json object is then the last line.) --bf16-kernel fallback calls
// setUserEnabledMkldnn(false), which forces the fallback on any CPU: how an
// AVX2-only CPU (e.g. Zen 3) runs bf16 matmul.
//
// Correctness: before timing, products of small, odd shapes (including a
// transposed A and a transposed B) are compared with a double-precision
// reference computed here with plain loops, so a kernel that returns
// garbage is caught. Each timed row also checks 64 sampled entries of its
// result. The error is max|C - R| / max|R|, R the exact product of the
// (bf16- or fp32-valued) inputs. The program exits with status 1 if any check
// fails. Tolerances:
//   fp32: 1e-4 (a correct sgemm is near 1e-6 at these K).
//   bf16: derived per check from bf16's unit roundoff u = 2^-8, fp32's
//   u32 = 2^-24, K, and how the kernel that ran accumulates; the bound is
//   computed for every checked entry and tol = max(bound) / max|R|:
//   * fp32 accumulation, one rounding to bf16 at the end (oneDNN's brgemm;
//     ATen's fallback when B is transposed, i.e. its column-major gemm_transa_,
//     which sums in float): a deterministic bound,
//       |C - R| <= u |R| + (1 + u) gamma_K S,  gamma_K = K u32 / (1 - K u32),
//     S = sum_k |a_k b_k| (products of bf16 values are exact in fp32).
//   * bf16 accumulation (ATen's fallback otherwise: gemm_notrans_, _transb_,
//     _transab_ add each product into the bf16 output, c += a*b, so the
//     product and then every partial sum are rounded to bf16; checked
//     bit-exactly against a simulation on Debian's 1.13.1 build): the
//     worst-case bound gamma_K(u) S is vacuous for K >= 256, so the check uses
//     the probabilistic bound of Higham & Mary (2019): rounding errors
//     independent, mean zero, |delta| <= u; by Hoeffding's inequality,
//       |C - R| <= lambda u sqrt(V),  V = sum_k (s_k^2 + p_k^2),
//     with s_k the partial sums (k ascending, the fallback's order) and p_k
//     the products, holds for all E checked entries with probability at least
//     1 - 1e-6 when lambda = sqrt(2 ln(2E / 1e-6)). For N(0,1) inputs this is
//     about 0.3 at K = 256 (all 65536 entries) and 0.6 at K = 2048 (64
//     sampled entries), against a measured 0.035-0.055 for the fallback
//     (which failed the old fixed tolerance of 2e-2 on a Zen 3), while a kernel
//     returning garbage or zeros gives an error of 1 or more. (The bound grows
//     like sqrt(K): past K ~ 8192 it no longer catches zeros.)
//
// Which BLAS: the "sgemm_ from" line names the library whose sgemm_ LibTorch
// binds to (dladdr), and "mapped" lists BLAS/LAPACK/oneDNN files from
// /proc/self/maps. To try another BLAS without changing the system setting:
//   LD_LIBRARY_PATH=/usr/lib/x86_64-linux-gnu/blis-pthread bench_matmul
#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <ATen/Parallel.h>

#include <dlfcn.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <limits>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace {

// One product: (batch x) M x K times K x N; batch 0 = a plain 2-D product.
struct Shape {
  int64_t batch = 0, m = 0, k = 0, n = 0;
  bool square = false;  // given with --n (printed as N)
  std::string str() const {
    if (square) return std::to_string(n);
    std::string s = std::to_string(m) + "x" + std::to_string(k) + "x" + std::to_string(n);
    return batch > 0 ? std::to_string(batch) + "x" + s : s;
  }
  double flops() const { return 2.0 * std::max<int64_t>(batch, 1) * m * k * n; }
};

struct Options {
  std::vector<Shape> shapes;
  int reps = 3;
  std::vector<int> threads{1, 2};
  std::vector<std::string> dtypes{"fp32", "bf16"};
  double min_time_ms = 50;
  bool force_fallback = false;
  bool json = false;
};

[[noreturn]] void usage(const char* argv0, int rc) {
  std::fprintf(rc ? stderr : stdout,
               "usage: %s [--n N[,N...]] [--shapes [B*]MxKxN[,...]] [--reps K] "
               "[--threads T[,T...]] [--dtypes fp32,bf16] [--min-time-ms MS] "
               "[--bf16-kernel auto|fallback] [--json]\n",
               argv0);
  std::exit(rc);
}

std::vector<std::string> split(const std::string& s, char sep = ',') {
  std::vector<std::string> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, sep))
    if (!item.empty()) out.push_back(item);
  return out;
}

// "MxKxN" or "BxMxKxN" (also with '*' after B).
Shape parse_shape(std::string s) {
  std::replace(s.begin(), s.end(), '*', 'x');
  auto parts = split(s, 'x');
  std::vector<int64_t> v;
  for (auto& p : parts) {
    size_t used = 0;
    v.push_back(std::stoll(p, &used));
    if (used != p.size() || v.back() < 1) throw std::invalid_argument(s);
  }
  Shape sh;
  if (v.size() == 3) {
    sh.m = v[0], sh.k = v[1], sh.n = v[2];
  } else if (v.size() == 4) {
    sh.batch = v[0], sh.m = v[1], sh.k = v[2], sh.n = v[3];
  } else {
    throw std::invalid_argument(s);
  }
  return sh;
}

Options parse(int argc, char** argv) {
  Options o;
  std::vector<Shape> squares, shapes;
  bool squares_given = false;
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
      } else if (starts("--n") || starts("--sizes")) {
        squares_given = true;
        squares.clear();
        for (auto& s : split(value())) {
          Shape sh;
          sh.m = sh.k = sh.n = std::stoll(s);
          sh.square = true;
          if (sh.n < 1) usage(argv[0], 2);
          squares.push_back(sh);
        }
      } else if (starts("--shapes")) {
        shapes.clear();
        for (auto& s : split(value())) shapes.push_back(parse_shape(s));
      } else if (starts("--reps")) {
        o.reps = std::stoi(value());
      } else if (starts("--threads")) {
        o.threads.clear();
        for (auto& s : split(value())) o.threads.push_back(std::stoi(s));
      } else if (starts("--dtypes")) {
        o.dtypes = split(value());
      } else if (starts("--min-time-ms")) {
        o.min_time_ms = std::stod(value());
      } else if (starts("--bf16-kernel")) {
        std::string v = value();
        if (v != "auto" && v != "fallback") usage(argv[0], 2);
        o.force_fallback = v == "fallback";
      } else {
        usage(argv[0], 2);
      }
    } catch (const std::logic_error&) {
      usage(argv[0], 2);
    }
  }
  if (!squares_given && shapes.empty()) {
    Shape sh;
    sh.m = sh.k = sh.n = 2048;
    sh.square = true;
    squares.push_back(sh);
  }
  o.shapes = squares;
  o.shapes.insert(o.shapes.end(), shapes.begin(), shapes.end());
  if (o.reps < 1 || o.threads.empty() || o.min_time_ms < 0) usage(argv[0], 2);
  for (int t : o.threads)
    if (t < 1) usage(argv[0], 2);
  for (auto& d : o.dtypes)
    if (d != "fp32" && d != "bf16") usage(argv[0], 2);
  return o;
}

// ------------------------------------------------------------ which BLAS

// The object that defines sgemm_ in the global scope is the one LibTorch's
// calls bind to (libtorch_cpu needs libblas.so.3 and is resolved through the
// same global scope).
std::string sgemm_provider() {
  void* sym = dlsym(RTLD_DEFAULT, "sgemm_");
  Dl_info info{};
  if (sym == nullptr || dladdr(sym, &info) == 0 || info.dli_fname == nullptr) return "(sgemm_ not found)";
  char buf[4096];
  const char* real = realpath(info.dli_fname, buf);
  std::string out = info.dli_fname;
  if (real != nullptr && out != real) out += std::string(" -> ") + real;
  return out;
}

// Mapped files whose name mentions a BLAS, LAPACK or oneDNN, deduplicated.
std::vector<std::string> blas_maps() {
  std::ifstream f("/proc/self/maps");
  std::set<std::string> seen;
  std::vector<std::string> out;
  std::string line;
  while (std::getline(f, line)) {
    auto slash = line.find('/');
    if (slash == std::string::npos) continue;
    std::string path = line.substr(slash);
    std::string base = path.substr(path.rfind('/') + 1);
    bool hit = base.find("blas") != std::string::npos || base.find("blis") != std::string::npos ||
               base.find("lapack") != std::string::npos || base.find("dnnl") != std::string::npos;
    if (hit && seen.insert(path).second) out.push_back(path);
  }
  return out;
}

std::string env_or_dash(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr ? std::string(v) : std::string("-");
}

enum class Blas { kOpenBlas, kBlis, kReference, kUnknown };

Blas blas_kind(const std::string& provider) {
  // Look at the resolved path (after " -> "), else the path itself.
  auto arrow = provider.find(" -> ");
  std::string p = arrow == std::string::npos ? provider : provider.substr(arrow + 4);
  if (p.find("openblas") != std::string::npos) return Blas::kOpenBlas;
  if (p.find("blis") != std::string::npos) return Blas::kBlis;
  if (p.find("/blas/") != std::string::npos) return Blas::kReference;
  return Blas::kUnknown;
}

const char* blas_name(Blas b) {
  switch (b) {
    case Blas::kOpenBlas: return "OpenBLAS";
    case Blas::kBlis: return "BLIS";
    case Blas::kReference: return "reference (netlib)";
    default: return "unknown";
  }
}

// Extra facts the BLAS can tell about itself. OpenBLAS exports
// openblas_get_config/corename; Debian's BLIS libblas.so.3 exports only the
// BLAS and CBLAS symbols, so for BLIS we can only echo its environment
// (run with BLIS_ARCH_DEBUG=1 to make BLIS print the sub-configuration).
std::string blas_info(Blas b) {
  using cstr_fn = char* (*)();
  if (b == Blas::kOpenBlas) {
    std::string out;
    if (auto cfg = reinterpret_cast<cstr_fn>(dlsym(RTLD_DEFAULT, "openblas_get_config"))) out += cfg();
    if (auto core = reinterpret_cast<cstr_fn>(dlsym(RTLD_DEFAULT, "openblas_get_corename")))
      out += std::string(", core ") + core();
    return out;
  }
  if (b == Blas::kBlis) return "BLIS_ARCH_TYPE=" + env_or_dash("BLIS_ARCH_TYPE");
  return "";
}

// Threads the BLAS itself will use for one call.
int blas_threads(Blas b) {
  if (b == Blas::kOpenBlas) {
    using int_fn = int (*)();
    if (auto n = reinterpret_cast<int_fn>(dlsym(RTLD_DEFAULT, "openblas_get_num_threads"))) return n();
    return -1;
  }
  if (b == Blas::kBlis) {  // BLIS: BLIS_NUM_THREADS, else OMP_NUM_THREADS, else 1
    for (const char* var : {"BLIS_NUM_THREADS", "OMP_NUM_THREADS"}) {
      const char* v = std::getenv(var);
      if (v != nullptr && std::atoi(v) > 0) return std::atoi(v);
    }
    return 1;
  }
  if (b == Blas::kReference) return 1;
  return -1;
}

// ------------------------------------------------------------ which bf16 kernel

// LibTorch 1.13's conditions for handing a bf16 gemm to oneDNN, except the
// size test (m*n*k > 4096), which bf16_onednn_predicted() adds per product.
struct Bf16Eligibility {
  bool has_mkldnn, user_enabled, avx512bw, avx512vl, avx512dq;
  bool eligible() const { return has_mkldnn && user_enabled && avx512bw && avx512vl && avx512dq; }
};

Bf16Eligibility bf16_eligibility() {
  __builtin_cpu_init();
  return {at::hasMKLDNN(), at::globalContext().userEnabledMkldnn(), __builtin_cpu_supports("avx512bw") != 0,
          __builtin_cpu_supports("avx512vl") != 0, __builtin_cpu_supports("avx512dq") != 0};
}

// 2-D: m*n*k > 4096 (mkldnn_bf16_gemm). Batched (bmm): batch*m*k*n > 4096
// (use_mkldnn_bf16_matmul's checksize), else per-matrix gemms or ATen's small
// bmm kernel.
bool bf16_onednn_predicted(const Bf16Eligibility& e, const Shape& s) {
  return e.eligible() && std::max<int64_t>(s.batch, 1) * s.m * s.n * s.k > 16 * 16 * 16;
}

// oneDNN's verbose lines for what one call executes. oneDNN 2.x prints them
// with printf to stdout, so the call runs with fd 1 diverted to a temporary
// file.
class OnednnProbe {
 public:
  OnednnProbe() {
    set_verbose_ = reinterpret_cast<int (*)(int)>(dlsym(RTLD_DEFAULT, "dnnl_set_verbose"));
    for (const char* var : {"MKLDNN_VERBOSE", "DNNL_VERBOSE", "ONEDNN_VERBOSE"}) {
      const char* v = std::getenv(var);
      if (v != nullptr && *v != '\0') env_level_ = std::atoi(v);
    }
  }
  bool available() const { return set_verbose_ != nullptr; }

  // Runs fn; returns "<primitive> <implementation>" of every oneDNN primitive
  // it executed, joined by "; " (empty: none ran). Without libdnnl: "?".
  std::string run(const std::function<void()>& fn) const {
    if (!available()) {
      fn();
      return "?";
    }
    std::fflush(stdout);
    std::FILE* tmp = std::tmpfile();
    const int saved = dup(STDOUT_FILENO);
    if (tmp == nullptr || saved < 0 || dup2(fileno(tmp), STDOUT_FILENO) < 0) {
      if (tmp != nullptr) std::fclose(tmp);
      if (saved >= 0) close(saved);
      fn();
      return "?";
    }
    set_verbose_(1);
    fn();
    std::fflush(stdout);
    set_verbose_(env_level_);
    dup2(saved, STDOUT_FILENO);
    close(saved);
    std::rewind(tmp);
    std::set<std::string> seen;
    std::string out;
    char buf[8192];
    while (std::fgets(buf, sizeof buf, tmp) != nullptr) {
      std::string line(buf);
      if (env_level_ > 0) std::fputs(buf, stderr);  // the user asked for them
      if (line.find("_verbose,exec,cpu,") == std::string::npos) continue;
      auto f = split(line);  // onednn_verbose,exec,cpu,<primitive>,<impl>,...
      if (f.size() < 5) continue;
      std::string what = f[3] + " " + f[4];
      if (seen.insert(what).second) out += (out.empty() ? "" : "; ") + what;
    }
    std::fclose(tmp);
    return out;
  }

 private:
  int (*set_verbose_)(int) = nullptr;
  int env_level_ = 0;
};

// ------------------------------------------------------------ numerics

at::ScalarType to_scalar_type(const std::string& d) { return d == "bf16" ? at::kBFloat16 : at::kFloat; }

enum class Accum { kFp32, kBf16 };  // how a bf16 kernel accumulates

const char* accum_name(Accum a) { return a == Accum::kFp32 ? "fp32 accumulation" : "bf16 accumulation"; }

constexpr double kBf16U = 1.0 / 256;         // 2^-8, bf16 unit roundoff
constexpr double kFp32U = 1.0 / 16777216.0;  // 2^-24
constexpr double kFp32Tol = 1e-4;
constexpr double kFailProbability = 1e-6;  // for the probabilistic bound

// Per checked entry: the exact value, sum |products|, sum of (partial sum^2 +
// product^2) in k order.
struct EntryStats {
  double r = 0, s = 0, v = 0;
};

struct ErrorReport {
  double err = 0;  // max|C - R| / max|R|
  double tol = 0;
};

// Accumulates the error and its bound over checked entries.
class ErrorAccumulator {
 public:
  ErrorAccumulator(at::ScalarType st, Accum accum, int64_t k, int64_t entries)
      : bf16_(st == at::kBFloat16), accum_(accum) {
    const double kk = static_cast<double>(k);
    gamma_ = kk * kFp32U / (1 - kk * kFp32U);
    lambda_ = std::sqrt(2 * std::log(2.0 * static_cast<double>(entries) / kFailProbability));
  }
  void add(double c, const EntryStats& e) {
    max_err_ = std::max(max_err_, std::fabs(c - e.r));
    max_ref_ = std::max(max_ref_, std::fabs(e.r));
    double bound = 0;
    if (accum_ == Accum::kFp32) bound = kBf16U * std::fabs(e.r) + (1 + kBf16U) * gamma_ * e.s;
    else bound = lambda_ * kBf16U * std::sqrt(e.v);
    max_bound_ = std::max(max_bound_, bound);
    if (!std::isfinite(c)) finite_ = false;
  }
  ErrorReport report() const {
    const double ref = max_ref_ > 0 ? max_ref_ : 1.0;
    ErrorReport r;
    r.err = finite_ ? max_err_ / ref : std::numeric_limits<double>::infinity();
    r.tol = bf16_ ? max_bound_ / ref : kFp32Tol;
    return r;
  }
  double lambda() const { return lambda_; }

 private:
  bool bf16_;
  Accum accum_;
  double gamma_ = 0, lambda_ = 0;
  double max_err_ = 0, max_ref_ = 0, max_bound_ = 0;
  bool finite_ = true;
};

// How the kernel that ran accumulates (bf16 only): oneDNN in fp32; ATen's
// fallback in fp32 only for a transposed B (column-major gemm_transa_). For
// a batched product that fell back, bf16 accumulation is assumed (the looser
// bound).
Accum bf16_accum(bool onednn, bool trans_b) { return onednn || trans_b ? Accum::kFp32 : Accum::kBf16; }

// Stats of one entry from a row of A and a column of B (double, length k).
EntryStats entry_stats(const double* arow, const double* bcol, int64_t k) {
  EntryStats e;
  for (int64_t p = 0; p < k; ++p) {
    const double prod = arow[p] * bcol[p];
    e.r += prod;
    e.s += std::fabs(prod);
    e.v += e.r * e.r + prod * prod;
  }
  return e;
}

// Every entry of a 2-D product.
ErrorReport check_full(const at::Tensor& a, const at::Tensor& b, const at::Tensor& c, at::ScalarType st, Accum accum) {
  at::Tensor a64 = a.to(at::kDouble).contiguous();
  at::Tensor bt64 = b.t().to(at::kDouble).contiguous();  // columns of b as rows
  at::Tensor c64 = c.to(at::kDouble).contiguous();
  const int64_t m = a.size(0), k = a.size(1), n = b.size(1);
  ErrorAccumulator acc(st, accum, k, m * n);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j)
      acc.add(c64.data_ptr<double>()[i * n + j],
              entry_stats(a64.data_ptr<double>() + i * k, bt64.data_ptr<double>() + j * k, k));
  return acc.report();
}

// `samples` pseudo-random entries of a (batched) product; only the rows of A
// and columns of B needed are converted.
ErrorReport check_sampled(const at::Tensor& a, const at::Tensor& b, const at::Tensor& c, at::ScalarType st, Accum accum,
                          int samples = 64) {
  const bool batched = a.dim() == 3;
  const int64_t nb = batched ? a.size(0) : 1;
  const int64_t m = a.size(-2), k = a.size(-1), n = b.size(-1);
  std::mt19937_64 rng(12345);
  ErrorAccumulator acc(st, accum, k, samples);
  for (int s = 0; s < samples; ++s) {
    const int64_t bi = static_cast<int64_t>(rng() % nb);
    const int64_t i = static_cast<int64_t>(rng() % m), j = static_cast<int64_t>(rng() % n);
    at::Tensor a2 = batched ? a[bi] : a, b2 = batched ? b[bi] : b, c2 = batched ? c[bi] : c;
    at::Tensor arow = a2[i].to(at::kDouble).contiguous();
    at::Tensor bcol = b2.select(1, j).to(at::kDouble).contiguous();
    const double cij = c2[i][j].item<double>();
    acc.add(cij, entry_stats(arow.data_ptr<double>(), bcol.data_ptr<double>(), k));
  }
  return acc.report();
}

struct Check {
  std::string dtype;
  int64_t m, k, n;
  bool trans_a, trans_b;
  std::string kernel, accumulation;
  double err, tol;
  bool ok;
};

std::string bf16_kernel_name(const std::string& observed, bool predicted_onednn) {
  if (observed == "?")  // no oneDNN library to ask: the prediction
    return predicted_onednn ? "oneDNN (predicted)" : "ATen fallback gemm (predicted)";
  if (observed.empty()) return "ATen fallback gemm";
  return "oneDNN " + observed;
}

bool is_onednn(const std::string& kernel) { return kernel.rfind("oneDNN", 0) == 0; }

Check run_check(const std::string& dtype, int64_t m, int64_t k, int64_t n, bool trans_a, bool trans_b,
                const OnednnProbe& probe, const Bf16Eligibility& elig, const std::string& blas_kernel) {
  const at::ScalarType st = to_scalar_type(dtype);
  at::Tensor a = trans_a ? at::randn({k, m}).to(st).t()  // non-contiguous: BLAS transA
                         : at::randn({m, k}).to(st);
  at::Tensor b = trans_b ? at::randn({n, k}).to(st).t() : at::randn({k, n}).to(st);
  at::Tensor c;
  std::string kernel = blas_kernel, accumulation = "fp32";
  Accum accum = Accum::kFp32;
  if (st == at::kBFloat16) {
    Shape sh;
    sh.m = m, sh.k = k, sh.n = n;
    kernel = bf16_kernel_name(probe.run([&] { c = at::matmul(a, b); }), bf16_onednn_predicted(elig, sh));
    accum = bf16_accum(is_onednn(kernel), trans_b);
    accumulation = accum_name(accum);
  } else {
    c = at::matmul(a, b);
  }
  const ErrorReport r = check_full(a, b, c, st, accum);
  return {dtype, m, k, n, trans_a, trans_b, kernel, accumulation, r.err, r.tol, std::isfinite(r.err) && r.err <= r.tol};
}

struct Row {
  std::string dtype;
  Shape shape;
  int at_threads, blas_threads;
  int64_t inner;  // products per timed repetition
  double best_s, gflops, err, tol;
  std::string kernel, accumulation;
  bool ok;
};

Row run_row(const std::string& dtype, const Shape& shape, int threads, const Options& opt, Blas blas,
            const OnednnProbe& probe, const Bf16Eligibility& elig, const std::string& blas_kernel) {
  // Let the previous row's spinning workers (OpenBLAS, OpenMP) go to sleep
  // so that they do not compete with this row.
  std::this_thread::sleep_for(std::chrono::milliseconds(250));
  at::set_num_threads(threads);
  const at::ScalarType st = to_scalar_type(dtype);
  std::vector<int64_t> sa{shape.m, shape.k}, sb{shape.k, shape.n};
  if (shape.batch > 0) {
    sa.insert(sa.begin(), shape.batch);
    sb.insert(sb.begin(), shape.batch);
  }
  at::Tensor a = at::randn(sa).to(st);
  at::Tensor b = at::randn(sb).to(st);
  at::Tensor c;
  // First warm-up (thread pools, oneDNN primitive cache), asking oneDNN what ran.
  std::string kernel = blas_kernel, accumulation = "fp32";
  Accum accum = Accum::kFp32;
  if (st == at::kBFloat16) {
    kernel = bf16_kernel_name(probe.run([&] { c = at::matmul(a, b); }), bf16_onednn_predicted(elig, shape));
    accum = bf16_accum(is_onednn(kernel), false);
    accumulation = accum_name(accum);
    if (shape.batch > 0 && accum == Accum::kBf16) accumulation += " (assumed)";
  } else {
    c = at::matmul(a, b);
  }
  // Second warm-up, timed: how many products make one repetition.
  auto t0 = std::chrono::steady_clock::now();
  c = at::matmul(a, b);
  const double once = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const int64_t inner =
      std::max<int64_t>(1, static_cast<int64_t>(std::ceil(opt.min_time_ms * 1e-3 / std::max(once, 1e-9))));
  double best = 1e300;
  for (int r = 0; r < opt.reps; ++r) {
    t0 = std::chrono::steady_clock::now();
    for (int64_t i = 0; i < inner; ++i) c = at::matmul(a, b);
    const double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = std::min(best, t / static_cast<double>(inner));
  }
  const ErrorReport e = check_sampled(a, b, c, st, accum);
  return {dtype,
          shape,
          threads,
          blas_threads(blas),
          inner,
          best,
          shape.flops() / best / 1e9,
          e.err,
          e.tol,
          kernel,
          accumulation,
          std::isfinite(e.err) && e.err <= e.tol};
}

std::string json_str(const std::string& s) {
  std::string out = "\"";
  for (char ch : s) {
    if (ch == '"' || ch == '\\') {
      out += '\\';
      out += ch;
    } else if (static_cast<unsigned char>(ch) < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", ch);
      out += buf;
    } else {
      out += ch;
    }
  }
  return out + "\"";
}

std::string fmt(const char* f, double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, f, v);
  return buf;
}

const char* yes_no(bool b) { return b ? "yes" : "no"; }
const char* json_bool(bool b) { return b ? "true" : "false"; }

const char* kToleranceRule =
    "fp32: 1e-4. bf16: tol = max over checked entries of the bound / max|R|, u = 2^-8; "
    "fp32 accumulation (oneDNN; ATen fallback with B transposed): u|R| + (1+u) gamma_K(2^-24) "
    "sum|a_k b_k|; bf16 accumulation (ATen fallback otherwise): lambda u sqrt(sum_k s_k^2 + "
    "p_k^2), lambda = sqrt(2 ln(2E/1e-6)) (probabilistic, Higham-Mary model)";

}  // namespace

int main(int argc, char** argv) {
  const Options opt = parse(argc, argv);
  at::manual_seed(0);
  if (opt.force_fallback) at::globalContext().setUserEnabledMkldnn(false);

  const std::string provider = sgemm_provider();
  const Blas blas = blas_kind(provider);
  const std::string blas_kernel = std::string("sgemm_ (") + blas_name(blas) + ")";
  const Bf16Eligibility elig = bf16_eligibility();
  const OnednnProbe probe;
  const std::vector<const char*> env_names = {"OPENBLAS_CORETYPE", "OPENBLAS_NUM_THREADS", "OPENBLAS_L2_SIZE",
                                              "BLIS_ARCH_TYPE",    "BLIS_NUM_THREADS",     "OMP_NUM_THREADS"};

  // Numeric checks first, single-threaded ATen; odd shapes exercise edge
  // kernels, trans_a / trans_b the transposed-operand paths.
  at::set_num_threads(1);
  std::vector<Check> checks;
  for (const auto& d : opt.dtypes) {
    checks.push_back(run_check(d, 256, 256, 256, false, false, probe, elig, blas_kernel));
    checks.push_back(run_check(d, 197, 263, 131, true, false, probe, elig, blas_kernel));
    if (d == "bf16")  // the fallback's fp32-accumulating path
      checks.push_back(run_check(d, 131, 263, 197, false, true, probe, elig, blas_kernel));
  }

  std::vector<Row> rows;
  for (const auto& s : opt.shapes)
    for (const auto& d : opt.dtypes)
      for (int t : opt.threads) rows.push_back(run_row(d, s, t, opt, blas, probe, elig, blas_kernel));

  bool all_ok = true;
  for (auto& c : checks) all_ok = all_ok && c.ok;
  for (auto& r : rows) all_ok = all_ok && r.ok;

  if (opt.json) {
    std::string j = "{\"sgemm_provider\":" + json_str(provider) + ",\"blas\":" + json_str(blas_name(blas)) +
                    ",\"blas_info\":" + json_str(blas_info(blas)) + ",\"env\":{";
    for (size_t i = 0; i < env_names.size(); ++i)
      j += (i ? "," : "") + json_str(env_names[i]) + ":" + json_str(env_or_dash(env_names[i]));
    j += "},\"mapped\":[";
    auto maps = blas_maps();
    for (size_t i = 0; i < maps.size(); ++i) j += (i ? "," : "") + json_str(maps[i]);
    j += std::string("],\"bf16_gemm\":{\"onednn_eligible\":") + json_bool(elig.eligible()) +
         ",\"has_mkldnn\":" + json_bool(elig.has_mkldnn) + ",\"user_enabled_mkldnn\":" + json_bool(elig.user_enabled) +
         ",\"avx512bw\":" + json_bool(elig.avx512bw) + ",\"avx512vl\":" + json_bool(elig.avx512vl) +
         ",\"avx512dq\":" + json_bool(elig.avx512dq) + ",\"forced_fallback\":" + json_bool(opt.force_fallback) +
         ",\"verbose_probe\":" + json_bool(probe.available()) + "}";
    j += ",\"tolerance_rule\":" + json_str(kToleranceRule) + ",\"checks\":[";
    for (size_t i = 0; i < checks.size(); ++i) {
      const auto& c = checks[i];
      j += std::string(i ? "," : "") + "{\"dtype\":" + json_str(c.dtype) + ",\"m\":" + std::to_string(c.m) +
           ",\"k\":" + std::to_string(c.k) + ",\"n\":" + std::to_string(c.n) + ",\"trans_a\":" + json_bool(c.trans_a) +
           ",\"trans_b\":" + json_bool(c.trans_b) + ",\"kernel\":" + json_str(c.kernel) +
           ",\"accumulation\":" + json_str(c.accumulation) + ",\"max_rel_err\":" + fmt("%.3e", c.err) +
           ",\"tol\":" + fmt("%.3e", c.tol) + ",\"ok\":" + json_bool(c.ok) + "}";
    }
    j += "],\"results\":[";
    for (size_t i = 0; i < rows.size(); ++i) {
      const auto& r = rows[i];
      j += std::string(i ? "," : "") + "{\"dtype\":" + json_str(r.dtype) + ",\"shape\":" + json_str(r.shape.str()) +
           ",\"batch\":" + std::to_string(r.shape.batch) + ",\"m\":" + std::to_string(r.shape.m) +
           ",\"k\":" + std::to_string(r.shape.k) + ",\"n\":" + std::to_string(r.shape.n) +
           ",\"at_threads\":" + std::to_string(r.at_threads) + ",\"blas_threads\":" + std::to_string(r.blas_threads) +
           ",\"reps\":" + std::to_string(opt.reps) + ",\"inner\":" + std::to_string(r.inner) +
           ",\"best_s\":" + fmt("%.6g", r.best_s) + ",\"gflops\":" + fmt("%.4g", r.gflops) +
           ",\"kernel\":" + json_str(r.kernel) + ",\"accumulation\":" + json_str(r.accumulation) +
           ",\"max_rel_err\":" + fmt("%.3e", r.err) + ",\"tol\":" + fmt("%.3e", r.tol) + ",\"ok\":" + json_bool(r.ok) +
           "}";
    }
    j += std::string("],\"ok\":") + json_bool(all_ok) + "}";
    std::printf("%s\n", j.c_str());
    return all_ok ? 0 : 1;
  }

  std::printf("at::matmul(A, B), best of %d repetitions (each >= %g ms) after 2 warm-up calls\n", opt.reps,
              opt.min_time_ms);
  std::printf("sgemm_ from : %s  [%s]\n", provider.c_str(), blas_name(blas));
  const std::string info = blas_info(blas);
  if (!info.empty()) std::printf("blas info   : %s\n", info.c_str());
  std::printf("mapped      :");
  for (auto& m : blas_maps()) std::printf(" %s", m.c_str());
  std::printf("\nenv         :");
  for (auto* e : env_names) std::printf(" %s=%s", e, env_or_dash(e).c_str());
  std::printf(
      "\nbf16 gemm   : oneDNN eligible: %s (hasMKLDNN %s, userEnabledMkldnn %s%s, avx512bw %s, "
      "avx512vl %s, avx512dq %s; LibTorch 1.13 then uses it for m*n*k > 4096, else ATen's "
      "fallback gemm); kernel that ran: %s\n",
      yes_no(elig.eligible()), yes_no(elig.has_mkldnn), yes_no(elig.user_enabled),
      opt.force_fallback ? " (--bf16-kernel fallback)" : "", yes_no(elig.avx512bw), yes_no(elig.avx512vl),
      yes_no(elig.avx512dq),
      probe.available() ? "from oneDNN's verbose lines (dnnl_set_verbose)"
                        : "predicted (no dnnl_set_verbose in the process)");
  std::printf("tolerance   : %s\n", kToleranceRule);
  std::printf("checks      : max|C-R|/max|R| vs double reference\n");
  for (auto& c : checks)
    std::printf("  %-4s %4lldx%4lldx%4lld%s  %.2e  %s   (tol %.2e; %s, %s)\n", c.dtype.c_str(),
                static_cast<long long>(c.m), static_cast<long long>(c.k), static_cast<long long>(c.n),
                c.trans_a   ? " (A^T)"
                : c.trans_b ? " (B^T)"
                            : "      ",
                c.err, c.ok ? "ok" : "FAIL", c.tol, c.kernel.c_str(), c.accumulation.c_str());
  std::printf("\n%-5s %6s %7s %8s %10s %9s  %s\n", "dtype", "N", "at_thr", "blas_thr", "best_ms", "GFLOP/s",
              "sampled err, tol, kernel");
  for (auto& r : rows)
    std::printf("%-5s %6s %7d %8d %10.3f %9.1f  %.2e %s  (tol %.2e; %s, %s)\n", r.dtype.c_str(), r.shape.str().c_str(),
                r.at_threads, r.blas_threads, r.best_s * 1e3, r.gflops, r.err, r.ok ? "ok" : "FAIL", r.tol,
                r.kernel.c_str(), r.accumulation.c_str());
  if (!all_ok) std::printf("\nFAILED: a result is numerically wrong (see above)\n");
  return all_ok ? 0 : 1;
}
