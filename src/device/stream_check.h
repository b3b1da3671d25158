// stream_check.h — the CPU device's checking mode: a GPU's stream order, checked on a machine
// without a GPU.
//
// With FSDP_DEVICE_CHECK=1 in the environment when libfsdp is loaded, the CPU's DeviceOps model
// what CUDA's do: FSDP makes its side streams and orders them with events, host memory (CPU
// offload, pinned or not) is told apart from "device" memory, and every operation is checked,
// while it still runs at once on the host, for the order a GPU would need:
//   - every write is stamped with the logical stream that issued it (or the host); a read or
//     write from another stream must come after an event recorded after it and waited on by
//     that stream (the host: synchronized on);
//   - a block freed while work of another stream may still use it is the caching allocator's
//     reuse race: the stream it was allocated on must have waited for that work first;
//   - a kernel cannot touch host memory, nor the host device memory: an operation mixing them
//     (a copy apart) is a device mismatch on a GPU.
// It sees the operations the library really issues: ATen's dispatcher hands every operator
// with its tensor arguments to a boxed fallback (on the calling thread, from libfsdp's load),
// the CPU allocator is wrapped to see allocations and frees, the device layer tells every
// stream switch, event, wait and byte copy, and the process group tells each collective (which
// runs on a stream of its group's own after the issuing stream, as NCCL's does; Work::wait()
// makes the waiter's stream wait for it, and not the host).
//
// A report names the memory (its label, or its size and the operator that allocated it), both
// streams, both operations and the missing wait. Reports are printed to stderr as they are
// found; a process that found any exits with status 86 when it ends normally. Not collective;
// thread-safe. A testing tool: it slows every operator down, and is never on unless asked for.
#pragma once

#include "src/device/device_ops.h"

#include <ATen/core/Tensor.h>
#include <c10/core/Stream.h>

#include <string>
#include <vector>

namespace fsdp {
namespace device {
namespace stream_check {

// The exit status of a process that found reports.
constexpr int kReportsExitCode = 86;

// Whether the checking mode is on in this process (FSDP_DEVICE_CHECK=1 at libfsdp's load).
bool enabled();

// Names the memory of `t` in reports, until it is freed ("flat shard of 'layers.0'"). Off: nothing.
void label(const at::Tensor& t, const std::string& role);
// Names a stream in reports ("all-gather copy-in"). Off: nothing.
void label_stream(c10::Stream stream, const std::string& name);

// A collective over `group` (its name, unique in the process), issued from the calling thread's
// current stream: it runs after that stream's work so far, on a stream of the group's own, and
// reads `reads` and writes `writes`. Returns the event of its end. Off: an empty event.
Event collective(const std::string& group, const char* op, const std::vector<at::Tensor>& reads,
                 const std::vector<at::Tensor>& writes);
// Makes the calling thread's current stream wait for `event` (Work::wait of a collective).
void wait_on_current_stream(const Event& event);

// The reports found so far, each once, in the order found; and forgetting them.
std::vector<std::string> reports();
void clear_reports();

}  // namespace stream_check
}  // namespace device
}  // namespace fsdp
