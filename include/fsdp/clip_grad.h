// layer: fsdp (what may include what: docs/architecture.md)
/// \file
/// fsdp/clip_grad.h — gradient clipping over sharded gradients.
///
/// \code{.cpp}
///   double norm = fsdp::clip_grad_norm_(model->parameters(), /*max_norm=*/1.0);
/// \endcode
///
/// Like torch::nn::utils::clip_grad_norm_, but the norm is taken over the whole (global)
/// gradients: each rank reduces its shards locally and ONE all-reduce combines them (sum of
/// |g|^p, or max for the inf-norm) over the parameters' shard group (under HSDP: this
/// replica's, since the replicas hold the same gradients). Collective: every rank of that group
/// calls it with its own shards. Parameters that are DTensors on a mesh with model dims (FSDP
/// with dp_mesh_dims, or tensor parallelism alone: fsdp/tensor_parallel.h) are combined over
/// every dim of that mesh (one all-reduce per dim), each element counted once: a piece copied
/// over a mesh dim (Replicate()) only by that dim's rank 0. Collective over the whole mesh then. Returns the global norm; scales the local
/// gradients in place by max_norm / (norm + 1e-6) when that is below 1.
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

namespace fsdp {

/// norm_type: 2, 1, any p > 0, or INFINITY. Parameters without a grad are skipped. All sharded
/// parameters must share one shard group (or, with model dims, one mesh); plain parameters
/// (neither sharded by fully_shard nor DTensor parameters) are only accepted when all are plain
/// (then no communication happens).
double clip_grad_norm_(const std::vector<at::Tensor>& parameters, double max_norm, double norm_type = 2.0);

}  // namespace fsdp
