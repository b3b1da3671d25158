// fsdp/placement.h — how a DTensor's data is laid out along one mesh dimension.
//
//   fsdp::Shard(0)      // tensor dim 0 is split across the mesh dim (torch.chunk rules)
//   fsdp::Replicate()   // every rank of the mesh dim holds the whole tensor
#pragma once

#include <cstdint>
#include <string>

namespace fsdp {

class Placement {
 public:
  static Placement shard(int64_t dim) { return Placement(Kind::kShard, dim); }
  static Placement replicate() { return Placement(Kind::kReplicate, -1); }

  bool is_shard() const { return kind_ == Kind::kShard; }
  // True when this is Shard(dim).
  bool is_shard(int64_t dim) const { return kind_ == Kind::kShard && dim_ == dim; }
  bool is_replicate() const { return kind_ == Kind::kReplicate; }
  // The sharded tensor dimension; only meaningful when is_shard().
  int64_t dim() const { return dim_; }

  // "Shard(0)" or "Replicate()", as PyTorch prints them.
  std::string str() const {
    return is_shard() ? "Shard(" + std::to_string(dim_) + ")" : std::string("Replicate()");
  }
  bool operator==(const Placement& o) const { return kind_ == o.kind_ && dim_ == o.dim_; }
  bool operator!=(const Placement& o) const { return !(*this == o); }

 private:
  enum class Kind { kShard, kReplicate };
  Placement(Kind kind, int64_t dim) : kind_(kind), dim_(dim) {}
  Kind kind_;
  int64_t dim_;
};

// PyTorch's spelling: Shard(0), Replicate().
inline Placement Shard(int64_t dim = 0) { return Placement::shard(dim); }
inline Placement Replicate() { return Placement::replicate(); }

// Where piece `index` of `parts` starts, and its length, when `size` elements are split with
// torch.chunk's rule: pieces of ceil(size / parts); the last ones may be shorter or empty.
struct ChunkBounds {
  int64_t offset;
  int64_t length;
};
inline ChunkBounds chunk_bounds(int64_t size, int64_t parts, int64_t index) {
  const int64_t chunk = (size + parts - 1) / parts;
  const int64_t offset = chunk * index < size ? chunk * index : size;
  const int64_t end = chunk * (index + 1) < size ? chunk * (index + 1) : size;
  return {offset, end - offset};
}

}  // namespace fsdp
