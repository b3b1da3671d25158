// model_size.h — how much memory a run needs per rank, estimated from the configured sizes
// before anything is allocated. A model or batch the machine cannot hold stops the run at
// configuration time (exit 2, naming the key) instead of failing in the allocator, or growing
// until the kernel kills it. No torch here: the sizes are plain numbers.
//
// The estimate is a lower bound (what the run cannot do without), so no run that would fit is
// refused:
//   model    16 bytes per parameter (the parameter, its gradient and AdamW's two moments),
//            sharded over the ranks each parameter is split over. Nothing more for building
//            the model: the sharded strategies build it sharded, one block at a time
//            (fsdp::models::sharded_transformer), which holds less than training does
//   data     the step's global batch (int64 tokens), which every rank draws whole
//   compute  one micro-batch's logits and their gradient, and every layer's attention
//            probabilities (kept for backward; the Llama family's fused attention keeps none)
// Rule: estimate per rank × the ranks on this machine (LOCAL_WORLD_SIZE) <= MemTotal.
#pragma once

#include <cstdint>

namespace fsdp {
namespace train {

// The sizes of fsdp::models::Transformer (include/fsdp/models/transformer.h).
// For the Llama family (llama = true) dim is hidden_size and max_seq_len max_position_embeddings,
// and its own sizes below count: SwiGLU's three projections of intermediate_size, grouped-query
// k/v of n_kv_heads x head_dim, the q/k/v biases, the tied head once; no position embeddings.
struct ModelSizes {
  int64_t n_layers = 0, vocab_size = 0, max_seq_len = 0, dim = 0, n_heads = 0;
  bool llama = false;
  int64_t intermediate_size = 0, n_kv_heads = 0, head_dim = 0;
  bool attention_bias = false, tie_word_embeddings = false;
};

// The sizes of one optimizer step.
struct StepSizes {
  int64_t world = 1;         // ranks in the job
  int64_t local_world = 1;   // ranks on this machine
  int64_t micro_batch = 1;   // training.micro_batch_size
  int64_t accumulation = 1;  // training.gradient_accumulation_steps
  int64_t seq = 1;           // the training sequence length
  int64_t shard_world = 0;   // ranks each parameter is sharded over (1: NO_SHARD); 0 = world
};

// The Transformer's parameter count, in double so that no configured size overflows it:
// 2 * vocab * dim (embeddings, output) + max_seq_len * dim + n_layers * (12 dim^2 + 9 dim) + 2 dim.
double transformer_parameters(const ModelSizes& m);
// The Llama family's (m.llama): (1 or 2) * vocab * dim + dim + n_layers * (2 dim + dim * (2 q + 2 kv)
// + 3 dim * intermediate + biases), q = n_heads * head_dim, kv = n_kv_heads * head_dim.
double llama_parameters(const ModelSizes& m);

// The estimate above, in bytes per rank.
double bytes_per_rank(const ModelSizes& m, const StepSizes& s);

// Throws ConfigError when bytes_per_rank * s.local_world exceeds mem_total_bytes, naming the
// key whose value makes up most of it, the estimate, the machine's memory and the rule. A
// mem_total_bytes of 0 (unknown) only rejects estimates beyond 2^63 bytes.
void check_fits_in_memory(const ModelSizes& m, const StepSizes& s, double mem_total_bytes);

// MemTotal from /proc/meminfo, in bytes; 0 when it cannot be read.
double machine_memory_bytes();

}  // namespace train
}  // namespace fsdp
