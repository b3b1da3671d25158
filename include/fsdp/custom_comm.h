// layer: fsdp (what may include what: docs/architecture.md)
/// \file
/// fsdp/custom_comm.h — replacing how one FSDP module's all-gather or reduce-scatter gets its
/// buffers and runs (FSDPModule::set_custom_all_gather / set_custom_reduce_scatter): e.g. to
/// count or trace them, to run them on a process group of one's own, or to place the buffers in
/// memory a transport registered.
///
/// \code{.cpp}
///   struct CountingAllGather : fsdp::AllGather {
///     int64_t calls = 0;
///     fsdp::WorkHandle operator()(const at::Tensor& output, const at::Tensor& input,
///                                 fsdp::ProcessGroup& group) override {
///       ++calls;
///       return group.all_gather_into(output, input);   // asynchronous: FSDP waits for it
///     }
///   };
///   auto counter = std::make_shared<CountingAllGather>();
///   fsdp::get_fsdp_module(*block).set_custom_all_gather(counter);
/// \endcode
///
/// What FSDP does with one (the buffer layouts are FSDP's own: see the module's shard layout):
///  1. allocate(numel, dtype, device) for the collective's input, then for its output. FSDP
///     writes every element of the input before the call and reads the output only after it
///     finished; both stay referenced by FSDP until then.
///  2. operator()(output, input, group[, op]) at the point where FSDP would issue the collective
///     itself, on the thread that runs the hooks, in the same order on every rank.
///  3. If it returned a Work, Work::wait() before the output is read (the work may still be running
///     when operator() returns: that is how communication overlaps compute); null means the
///     collective completed before operator() returned.
///
/// A Work comes from a ProcessGroup only (fsdp/process_group.h), and keeps the tensors it was
/// given alive until it finished. On a shard group of one rank nothing is communicated and
/// neither object is called. Neither is called concurrently with itself by FSDP; an object
/// installed on several modules is called by each.
#pragma once

#include <fsdp/process_group.h>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include <cstdint>

namespace fsdp {

/// The buffers of one collective. The default allocates ordinary memory (at::empty).
class CommBufferAllocator {
 public:
  virtual ~CommBufferAllocator() = default;
  /// A contiguous 1-D tensor of `numel` elements of `dtype` on `device`; its values do not
  /// matter (FSDP overwrites them). Anything else is refused with an error naming it.
  virtual at::Tensor allocate(int64_t numel, at::ScalarType dtype, c10::Device device);
};

/// A custom all-gather for FSDPModule::set_custom_all_gather: allocates its buffers and runs it.
class AllGather : public CommBufferAllocator {
 public:
  /// Collective over `group`: output[i * n : (i + 1) * n] = `input` of group rank i, with
  /// n = input.numel() and output.numel() = group.size() * n; writes nothing else. Both tensors
  /// come from allocate(). Returns the Work still running, or null when already done.
  virtual WorkHandle operator()(const at::Tensor& output, const at::Tensor& input, ProcessGroup& group) = 0;
};

/// A custom reduce-scatter for FSDPModule::set_custom_reduce_scatter: allocates its buffers and
/// runs it.
class ReduceScatter : public CommBufferAllocator {
 public:
  /// Collective over `group`: output = `op` over all ranks of input[r * n : (r + 1) * n], with
  /// r = group.rank(), n = output.numel() and input.numel() = group.size() * n. `op` is
  /// ReduceOp::kSum or kAvg, as FSDP's gradient division chose. Must not modify `input`. Both
  /// tensors come from allocate(). Returns the Work still running, or null when already done.
  virtual WorkHandle operator()(const at::Tensor& output, const at::Tensor& input, ProcessGroup& group,
                                ReduceOp op) = 0;
};

}  // namespace fsdp
