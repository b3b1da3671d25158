// layer: tensor (what may include what: docs/architecture.md)
/// \file
/// fsdp/placement.h — how a DTensor's data is laid out along one mesh dimension.
///
/// \code{.cpp}
///   fsdp::Shard(0)      // tensor dim 0 is split across the mesh dim (torch.chunk rules)
///   fsdp::Replicate()   // every rank of the mesh dim holds the whole tensor
///   fsdp::StridedShard(0, 2)  // tensor dim 0 split across this mesh dim, but only after the later
///                             // mesh dims that also shard dim 0 (2 pieces in all) split it first
/// \endcode
///
/// StridedShard is what FSDP over tensor parallelism gives a parameter that both shard along the
/// same dim: on a (dp, tp) mesh with TP's Shard(0) on tp, FSDP splits each tp rank's piece again
/// over dp, so the dp placement is StridedShard(0, tp) (PyTorch prints it _StridedShard(dim=0,
/// sf=tp)): rank (a, b) holds chunk a of chunk b of the tensor, not chunk b of chunk a.
#pragma once

#include <fsdp/chunk.h>

#include <cstdint>
#include <string>

namespace fsdp {

/// How a tensor is laid out along one mesh dim: Shard(dim), StridedShard(dim, split_factor) or
/// Replicate(), with PyTorch's meaning. A value type.
class Placement {
 public:
  /** @{ */
  /// Shard(dim): each rank of the mesh dim holds its torch.chunk piece along tensor dim `dim`;
  /// Replicate(): each holds the whole.
  static Placement shard(int64_t dim) { return Placement(Kind::kShard, dim); }
  static Placement replicate() { return Placement(Kind::kReplicate, -1); }
  /** @} */
  /// Shard(dim) applied after the later mesh dims that shard `dim`; split_factor is the number of
  /// pieces those later dims make of it (the product of their sizes).
  static Placement strided_shard(int64_t dim, int64_t split_factor) {
    Placement p(Kind::kShard, dim);
    p.split_factor_ = split_factor;
    return p;
  }

  /// True for Shard and StridedShard of any dim.
  bool is_shard() const { return kind_ == Kind::kShard; }
  /// True when this is Shard(dim).
  bool is_shard(int64_t dim) const { return kind_ == Kind::kShard && dim_ == dim; }
  /// True for Replicate().
  bool is_replicate() const { return kind_ == Kind::kReplicate; }
  /// A StridedShard is also a shard (is_shard() is true): only the order its split applies in differs.
  bool is_strided_shard() const { return kind_ == Kind::kShard && split_factor_ > 1; }
  /// The pieces later mesh dims make of the sharded dim: 1 except for a StridedShard.
  int64_t split_factor() const { return split_factor_; }
  /// The sharded tensor dimension; only meaningful when is_shard().
  int64_t dim() const { return dim_; }

  /// "Shard(0)", "_StridedShard(dim=0, sf=2)" or "Replicate()", as PyTorch prints them.
  std::string str() const {
    if (is_strided_shard()) {
      return "_StridedShard(dim=" + std::to_string(dim_) + ", sf=" + std::to_string(split_factor_) + ")";
    }
    return is_shard() ? "Shard(" + std::to_string(dim_) + ")" : std::string("Replicate()");
  }
  /** @{ */
  /// Equal when the kind, the dim and the split factor are.
  bool operator==(const Placement& o) const {
    return kind_ == o.kind_ && dim_ == o.dim_ && split_factor_ == o.split_factor_;
  }
  bool operator!=(const Placement& o) const { return !(*this == o); }
  /** @} */

 private:
  enum class Kind { kShard, kReplicate };
  Placement(Kind kind, int64_t dim) : kind_(kind), dim_(dim) {}
  Kind kind_;
  int64_t dim_;
  int64_t split_factor_ = 1;  ///< > 1 only for a StridedShard
};

/** @{ */
/// PyTorch's spellings: Shard(0), Replicate(), and StridedShard(dim, split_factor) (PyTorch's _StridedShard).
inline Placement Shard(int64_t dim = 0) { return Placement::shard(dim); }
inline Placement Replicate() { return Placement::replicate(); }
inline Placement StridedShard(int64_t dim, int64_t split_factor) { return Placement::strided_shard(dim, split_factor); }
/** @} */

}  // namespace fsdp
