// bench_matmul: GFLOP/s of at::matmul (fp32 and bf16, N x N) and a numeric
// check of the BLAS that LibTorch is using. Used to pick the system BLAS
// (see docs/blas.md and scripts/select-blas.sh).
//
//   bench_matmul [--n N[,N...]] [--reps K] [--threads T[,T...]]
//                [--dtypes fp32,bf16] [--json]
//
// Defaults: --n 2048 --reps 3 --threads 1,2 --dtypes fp32,bf16.
// Each row reports the best of K timed runs (after one warm-up run).
//
// Threads: a row's thread count is passed to at::set_num_threads(), which
// governs ATen's OpenMP loops and oneDNN (the bf16 path). Debian's LibTorch
// calls the BLAS through the plain Fortran interface, so the BLAS's own
// thread count comes from its environment (OPENBLAS_NUM_THREADS,
// BLIS_NUM_THREADS); the "blas_thr" column shows what the BLAS reports.
//
// Correctness: before timing, fp32 and bf16 products of small, odd shapes
// (including a transposed operand) are compared with a double-precision
// reference computed here with plain loops, so a BLAS that returns garbage
// is caught. Each timed row also checks 64 sampled entries of its N x N
// result. The error is max|C - R| / max|R|. The program exits with status 1
// if any check fails.
//
// Which BLAS: the "sgemm_ from" line names the library whose sgemm_ LibTorch
// binds to (dladdr), and "mapped" lists BLAS/LAPACK/oneDNN files from
// /proc/self/maps. To try another BLAS without changing the system setting:
//   LD_LIBRARY_PATH=/usr/lib/x86_64-linux-gnu/blis-pthread bench_matmul
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <dlfcn.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace {

struct Options {
  std::vector<int64_t> sizes{2048};
  int reps = 3;
  std::vector<int> threads{1, 2};
  std::vector<std::string> dtypes{"fp32", "bf16"};
  bool json = false;
};

[[noreturn]] void usage(const char* argv0, int rc) {
  std::fprintf(rc ? stderr : stdout,
               "usage: %s [--n N[,N...]] [--reps K] [--threads T[,T...]] "
               "[--dtypes fp32,bf16] [--json]\n",
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
      } else if (starts("--n") || starts("--sizes")) {
        o.sizes.clear();
        for (auto& s : split(value())) o.sizes.push_back(std::stoll(s));
      } else if (starts("--reps")) {
        o.reps = std::stoi(value());
      } else if (starts("--threads")) {
        o.threads.clear();
        for (auto& s : split(value())) o.threads.push_back(std::stoi(s));
      } else if (starts("--dtypes")) {
        o.dtypes = split(value());
      } else {
        usage(argv[0], 2);
      }
    } catch (const std::logic_error&) {
      usage(argv[0], 2);
    }
  }
  if (o.sizes.empty() || o.reps < 1 || o.threads.empty()) usage(argv[0], 2);
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
  if (sym == nullptr || dladdr(sym, &info) == 0 || info.dli_fname == nullptr)
    return "(sgemm_ not found)";
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
    bool hit = base.find("blas") != std::string::npos ||
               base.find("blis") != std::string::npos ||
               base.find("lapack") != std::string::npos ||
               base.find("dnnl") != std::string::npos;
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
    if (auto cfg = reinterpret_cast<cstr_fn>(dlsym(RTLD_DEFAULT, "openblas_get_config")))
      out += cfg();
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
    if (auto n = reinterpret_cast<int_fn>(dlsym(RTLD_DEFAULT, "openblas_get_num_threads")))
      return n();
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

// ------------------------------------------------------------ numerics

at::ScalarType to_scalar_type(const std::string& d) {
  return d == "bf16" ? at::kBFloat16 : at::kFloat;
}

// Error bound used for "ok". fp32: exact-product reference, K <= 2048, so a
// correct sgemm is near 1e-6. bf16: inputs are exact in the reference, the
// output is rounded to bf16 (2^-9 relative), plus fp32 accumulation.
double tolerance(at::ScalarType t) { return t == at::kBFloat16 ? 2e-2 : 1e-4; }

// max|C - R| / max|R| over all entries, with R = A·B in double (plain loops).
double check_full(const at::Tensor& a, const at::Tensor& b, const at::Tensor& c) {
  at::Tensor a64 = a.to(at::kDouble).contiguous();
  at::Tensor b64 = b.to(at::kDouble).contiguous();
  at::Tensor c64 = c.to(at::kDouble).contiguous();
  const int64_t m = a.size(0), k = a.size(1), n = b.size(1);
  const double* pa = a64.data_ptr<double>();
  const double* pb = b64.data_ptr<double>();
  const double* pc = c64.data_ptr<double>();
  std::vector<double> row(n);
  double max_err = 0, max_ref = 0;
  for (int64_t i = 0; i < m; ++i) {
    std::fill(row.begin(), row.end(), 0.0);
    for (int64_t p = 0; p < k; ++p) {
      const double aip = pa[i * k + p];
      const double* brow = pb + p * n;
      for (int64_t j = 0; j < n; ++j) row[j] += aip * brow[j];
    }
    for (int64_t j = 0; j < n; ++j) {
      max_err = std::max(max_err, std::fabs(pc[i * n + j] - row[j]));
      max_ref = std::max(max_ref, std::fabs(row[j]));
    }
  }
  return max_ref > 0 ? max_err / max_ref : max_err;
}

// Same measure on `samples` pseudo-random entries of a large product.
double check_sampled(const at::Tensor& a, const at::Tensor& b, const at::Tensor& c,
                     int samples = 64) {
  at::Tensor a64 = a.to(at::kDouble).contiguous();
  at::Tensor bt64 = b.t().to(at::kDouble).contiguous();  // columns of b as rows
  at::Tensor c64 = c.to(at::kDouble).contiguous();
  const int64_t m = a.size(0), k = a.size(1), n = b.size(1);
  std::mt19937_64 rng(12345);
  double max_err = 0, max_ref = 0;
  for (int s = 0; s < samples; ++s) {
    const int64_t i = static_cast<int64_t>(rng() % m), j = static_cast<int64_t>(rng() % n);
    const double* ar = a64.data_ptr<double>() + i * k;
    const double* bc = bt64.data_ptr<double>() + j * k;
    double r = 0;
    for (int64_t p = 0; p < k; ++p) r += ar[p] * bc[p];
    max_err = std::max(max_err, std::fabs(c64.data_ptr<double>()[i * n + j] - r));
    max_ref = std::max(max_ref, std::fabs(r));
  }
  return max_ref > 0 ? max_err / max_ref : max_err;
}

struct Check {
  std::string dtype;
  int64_t m, k, n;
  bool trans_a;
  double err;
  bool ok;
};

Check run_check(const std::string& dtype, int64_t m, int64_t k, int64_t n, bool trans_a) {
  const at::ScalarType st = to_scalar_type(dtype);
  at::Tensor a = trans_a ? at::randn({k, m}).to(st).t()  // non-contiguous: BLAS transA
                         : at::randn({m, k}).to(st);
  at::Tensor b = at::randn({k, n}).to(st);
  at::Tensor c = at::matmul(a, b);
  const double err = check_full(a, b, c);
  return {dtype, m, k, n, trans_a, err, std::isfinite(err) && err < tolerance(st)};
}

struct Row {
  std::string dtype;
  int64_t n;
  int at_threads, blas_threads;
  double best_s, gflops, err;
  bool ok;
};

Row run_row(const std::string& dtype, int64_t n, int threads, int reps, Blas blas) {
  // Let the previous row's spinning workers (OpenBLAS, OpenMP) go to sleep
  // so that they do not compete with this row.
  std::this_thread::sleep_for(std::chrono::milliseconds(250));
  at::set_num_threads(threads);
  const at::ScalarType st = to_scalar_type(dtype);
  at::Tensor a = at::randn({n, n}).to(st);
  at::Tensor b = at::randn({n, n}).to(st);
  at::Tensor c = at::matmul(a, b);  // warm-up (thread pools, oneDNN primitive cache)
  double best = 1e300;
  for (int r = 0; r < reps; ++r) {
    auto t0 = std::chrono::steady_clock::now();
    c = at::matmul(a, b);
    auto t1 = std::chrono::steady_clock::now();
    best = std::min(best, std::chrono::duration<double>(t1 - t0).count());
  }
  const double err = check_sampled(a, b, c);
  const double flops = 2.0 * static_cast<double>(n) * n * n;
  return {dtype, n, threads, blas_threads(blas), best, flops / best / 1e9, err,
          std::isfinite(err) && err < tolerance(st)};
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

}  // namespace

int main(int argc, char** argv) {
  const Options opt = parse(argc, argv);
  at::manual_seed(0);

  const std::string provider = sgemm_provider();
  const Blas blas = blas_kind(provider);
  const std::vector<const char*> env_names = {"OPENBLAS_CORETYPE", "OPENBLAS_NUM_THREADS",
                                              "OPENBLAS_L2_SIZE",  "BLIS_ARCH_TYPE",
                                              "BLIS_NUM_THREADS",  "OMP_NUM_THREADS"};

  // Numeric checks first, single-threaded ATen; odd shapes exercise edge
  // kernels, trans_a exercises the transposed-operand path.
  at::set_num_threads(1);
  std::vector<Check> checks;
  for (const auto& d : opt.dtypes) {
    checks.push_back(run_check(d, 256, 256, 256, false));
    checks.push_back(run_check(d, 197, 263, 131, true));
  }

  std::vector<Row> rows;
  for (int64_t n : opt.sizes)
    for (const auto& d : opt.dtypes)
      for (int t : opt.threads) rows.push_back(run_row(d, n, t, opt.reps, blas));

  bool all_ok = true;
  for (auto& c : checks) all_ok = all_ok && c.ok;
  for (auto& r : rows) all_ok = all_ok && r.ok;

  if (opt.json) {
    std::string j = "{\"sgemm_provider\":" + json_str(provider) +
                    ",\"blas\":" + json_str(blas_name(blas)) +
                    ",\"blas_info\":" + json_str(blas_info(blas)) + ",\"env\":{";
    for (size_t i = 0; i < env_names.size(); ++i)
      j += (i ? "," : "") + json_str(env_names[i]) + ":" + json_str(env_or_dash(env_names[i]));
    j += "},\"mapped\":[";
    auto maps = blas_maps();
    for (size_t i = 0; i < maps.size(); ++i) j += (i ? "," : "") + json_str(maps[i]);
    j += "],\"checks\":[";
    for (size_t i = 0; i < checks.size(); ++i) {
      const auto& c = checks[i];
      j += std::string(i ? "," : "") + "{\"dtype\":" + json_str(c.dtype) +
           ",\"m\":" + std::to_string(c.m) + ",\"k\":" + std::to_string(c.k) +
           ",\"n\":" + std::to_string(c.n) + ",\"trans_a\":" + (c.trans_a ? "true" : "false") +
           ",\"max_rel_err\":" + fmt("%.3e", c.err) + ",\"ok\":" + (c.ok ? "true" : "false") + "}";
    }
    j += "],\"results\":[";
    for (size_t i = 0; i < rows.size(); ++i) {
      const auto& r = rows[i];
      j += std::string(i ? "," : "") + "{\"dtype\":" + json_str(r.dtype) +
           ",\"n\":" + std::to_string(r.n) + ",\"at_threads\":" + std::to_string(r.at_threads) +
           ",\"blas_threads\":" + std::to_string(r.blas_threads) +
           ",\"reps\":" + std::to_string(opt.reps) + ",\"best_s\":" + fmt("%.6f", r.best_s) +
           ",\"gflops\":" + fmt("%.2f", r.gflops) + ",\"max_rel_err\":" + fmt("%.3e", r.err) +
           ",\"ok\":" + (r.ok ? "true" : "false") + "}";
    }
    j += std::string("],\"ok\":") + (all_ok ? "true" : "false") + "}";
    std::printf("%s\n", j.c_str());
    return all_ok ? 0 : 1;
  }

  std::printf("at::matmul(A, B), A and B N x N, best of %d after 1 warm-up\n", opt.reps);
  std::printf("sgemm_ from : %s  [%s]\n", provider.c_str(), blas_name(blas));
  const std::string info = blas_info(blas);
  if (!info.empty()) std::printf("blas info   : %s\n", info.c_str());
  std::printf("mapped      :");
  for (auto& m : blas_maps()) std::printf(" %s", m.c_str());
  std::printf("\nenv         :");
  for (auto* e : env_names) std::printf(" %s=%s", e, env_or_dash(e).c_str());
  std::printf("\nchecks      : max|C-R|/max|R| vs double reference\n");
  for (auto& c : checks)
    std::printf("  %-4s %4lldx%4lldx%4lld%s  %.2e  %s\n", c.dtype.c_str(),
                static_cast<long long>(c.m), static_cast<long long>(c.k),
                static_cast<long long>(c.n), c.trans_a ? " (A^T)" : "      ", c.err,
                c.ok ? "ok" : "FAIL");
  std::printf("\n%-5s %6s %7s %8s %10s %9s  %s\n", "dtype", "N", "at_thr", "blas_thr",
              "best_ms", "GFLOP/s", "sampled err");
  for (auto& r : rows)
    std::printf("%-5s %6lld %7d %8d %10.2f %9.1f  %.2e %s\n", r.dtype.c_str(),
                static_cast<long long>(r.n), r.at_threads, r.blas_threads, r.best_s * 1e3,
                r.gflops, r.err, r.ok ? "ok" : "FAIL");
  if (!all_ok) std::printf("\nFAILED: a result is numerically wrong (see above)\n");
  return all_ok ? 0 : 1;
}
