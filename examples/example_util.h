// example_util.h — what the two training examples share: their command line and their data.
#pragma once

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Functions.h>
#include <ATen/TensorOperators.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>

namespace examples {

struct Options {
  int steps = 10;
  int64_t batch = 8;  // global batch size
  int64_t seq = 0;    // 0: the model's max_seq_len
  std::string preset = "tiny";
};

inline Options parse_args(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const bool has_value = i + 1 < argc;
    if (!std::strcmp(argv[i], "--steps") && has_value) o.steps = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--batch") && has_value) o.batch = std::atoll(argv[++i]);
    else if (!std::strcmp(argv[i], "--seq") && has_value) o.seq = std::atoll(argv[++i]);
    else if (!std::strcmp(argv[i], "--preset") && has_value) o.preset = argv[++i];
    else {
      std::fprintf(stderr, "usage: %s [--steps N] [--batch B] [--seq S] [--preset tiny|small|medium]\n", argv[0]);
      std::exit(2);
    }
  }
  return o;
}

// This rank's part of step `step`'s global batch: (inputs, next-token targets), int64 [B/W, seq].
// The sequences are random but learnable: a random start and a random stride (1 or 2) per
// sequence, then token[t + 1] = token[t] + stride (mod vocab). The generator is seeded with the
// step, so every rank draws the same global batch and keeps its own rows of it.
inline std::pair<at::Tensor, at::Tensor> get_batch(int step, int64_t global_batch, int64_t seq, int64_t vocab, int rank,
                                                   int world) {
  at::Generator gen = at::detail::createCPUGenerator(/*seed_in=*/1000 + step);
  const auto i64 = at::TensorOptions().dtype(at::kLong);
  at::Tensor start = at::randint(0, vocab, {global_batch, 1}, gen, i64);
  at::Tensor stride = at::randint(1, 3, {global_batch, 1}, gen, i64);
  at::Tensor tokens = (start + stride * at::arange(seq + 1, i64)).remainder(vocab);  // [B, seq + 1]
  const int64_t per_rank = global_batch / world;
  tokens = tokens.narrow(0, rank * per_rank, per_rank);
  return {tokens.narrow(1, 0, seq).contiguous(), tokens.narrow(1, 1, seq).contiguous()};
}

}  // namespace examples
