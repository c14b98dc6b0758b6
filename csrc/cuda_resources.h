// Host-side CUDA resources of the transfer kernels: errors, the per-device pool of op tables
// (and the staged route's staging rings), SM counts, the device guard. Included by
// cuda_transfer.cu only.
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

namespace kvconnect {
namespace cuda {

// ---------------------------------------------------------------------------------------
// errors

class CudaError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

inline void check(cudaError_t status, const char* what) {
  if (status == cudaSuccess) return;
  cudaGetLastError();  // clear a non-sticky error so the next call starts clean
  throw CudaError(std::string("kvconnect CUDA transfer: ") + what + " failed: " + cudaGetErrorName(status) + " (" +
                  cudaGetErrorString(status) + ")");
}

// One contiguous copy between paged memory and the buffer. 24 bytes, read once per warp.
struct CopyOp {
  int64_t paged;       // device address of the first paged byte
  int64_t flat;        // byte offset in the buffer
  int32_t bytes;       // <= max_op_bytes
  int32_t width_log2;  // log2 of the vector unit both start addresses are aligned to (0..4)
};
static_assert(sizeof(CopyOp) == 24, "CopyOp layout");

// ---------------------------------------------------------------------------------------
// host side: per-device resources

// One launch's op table: mapped pinned memory (the kernel reads it zero-copy through
// `host_alias`) and, only for the copied-table variant, a device copy. Reused once the event
// recorded after its launch has completed.
struct Workspace {
  int device = -1;
  CopyOp* host = nullptr;
  CopyOp* host_alias = nullptr;  // device address of `host`
  size_t capacity = 0;
  CopyOp* dev = nullptr;
  size_t dev_capacity = 0;
  cudaEvent_t done = nullptr;
  // the staged route's ring (allocated on its first use): device slots of `slot_bytes`, a
  // copy stream, and per slot the events "filled" and "drained"
  char* staging = nullptr;
  int64_t staging_capacity = 0;  // bytes allocated
  int64_t slot_bytes = 0;
  cudaStream_t copy_stream = nullptr;
  std::vector<cudaEvent_t> filled, drained;
  cudaEvent_t start = nullptr, copies_done = nullptr;
  bool busy = false;      // owned by a call right now
  bool recorded = false;  // `done` was recorded after its last use
  uint64_t last_use = 0;  // order of release, to wait on the oldest
};

// Per device at most kMaxWorkspaces op tables exist; a caller that finds all of them in
// flight waits for the oldest instead of allocating (back-pressure, bounded pinned memory,
// and no allocation on the hot path of a pipelined caller).
constexpr int kMaxWorkspaces = 4;

class WorkspacePool {
 public:
  Workspace* acquire(int device, size_t num_ops) {
    Workspace* ws = nullptr;
    bool must_wait = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      int count = 0;
      Workspace* oldest = nullptr;
      for (auto& w : all_) {
        if (w->device != device) continue;
        ++count;
        if (w->busy) continue;
        if (w->recorded) {
          const cudaError_t q = cudaEventQuery(w->done);
          if (q == cudaErrorNotReady) {
            if (oldest == nullptr || w->last_use < oldest->last_use) oldest = w.get();
            continue;
          }
          check(q, "cudaEventQuery (workspace reuse)");
          w->recorded = false;
        }
        if (ws == nullptr || (ws->capacity < num_ops && w->capacity > ws->capacity)) ws = w.get();
      }
      if (ws == nullptr && count >= kMaxWorkspaces && oldest != nullptr) {
        ws = oldest;
        must_wait = true;
      }
      if (ws == nullptr) {
        all_.push_back(std::make_unique<Workspace>());
        ws = all_.back().get();
        ws->device = device;
      }
      ws->busy = true;
    }
    try {
      if (must_wait) check(cudaEventSynchronize(ws->done), "cudaEventSynchronize (waiting for a free op table)");
      if (ws->done == nullptr) check(cudaEventCreateWithFlags(&ws->done, cudaEventDisableTiming), "cudaEventCreate");
      if (ws->capacity < num_ops) {
        const size_t cap = std::max<size_t>({num_ops, 2 * ws->capacity, 4096});  // grow geometrically
        if (ws->host) check(cudaFreeHost(ws->host), "cudaFreeHost (op table)");
        ws->host = ws->host_alias = nullptr;
        ws->capacity = 0;
        check(cudaHostAlloc(reinterpret_cast<void**>(&ws->host), cap * sizeof(CopyOp),
                            cudaHostAllocMapped | cudaHostAllocPortable),
              "cudaHostAlloc (op table)");
        check(cudaHostGetDevicePointer(reinterpret_cast<void**>(&ws->host_alias), ws->host, 0),
              "cudaHostGetDevicePointer (op table)");
        ws->capacity = cap;
      }
    } catch (...) {
      release(ws);
      throw;
    }
    return ws;
  }

  // The copied-table variant's device buffer (allocated on first use only).
  CopyOp* device_table(Workspace* ws) {
    if (ws->dev_capacity < ws->capacity) {
      if (ws->dev) check(cudaFree(ws->dev), "cudaFree (op table)");
      ws->dev = nullptr;
      ws->dev_capacity = 0;
      check(cudaMalloc(reinterpret_cast<void**>(&ws->dev), ws->capacity * sizeof(CopyOp)), "cudaMalloc (op table)");
      ws->dev_capacity = ws->capacity;
    }
    return ws->dev;
  }

  // The staged route's ring of `slots` device slots of `slot_bytes` (grown, never shrunk;
  // the workspace is idle when acquired, so nothing in flight uses the old ring).
  void staging_ring(Workspace* ws, int slots, int64_t slot_bytes) {
    auto event = [](cudaEvent_t* e) {
      if (*e == nullptr) check(cudaEventCreateWithFlags(e, cudaEventDisableTiming), "cudaEventCreate (staging)");
    };
    if (ws->copy_stream == nullptr)
      check(cudaStreamCreateWithFlags(&ws->copy_stream, cudaStreamNonBlocking), "cudaStreamCreate (staging copies)");
    event(&ws->start);
    event(&ws->copies_done);
    while (static_cast<int>(ws->filled.size()) < slots) {
      cudaEvent_t filled = nullptr, drained = nullptr;
      event(&filled);
      try {
        event(&drained);
      } catch (...) {
        cudaEventDestroy(filled);
        throw;
      }
      ws->filled.push_back(filled);
      ws->drained.push_back(drained);
    }
    if (ws->staging_capacity < slots * slot_bytes) {
      if (ws->staging) check(cudaFree(ws->staging), "cudaFree (staging ring)");
      ws->staging = nullptr;
      ws->staging_capacity = 0;
      check(cudaMalloc(reinterpret_cast<void**>(&ws->staging), static_cast<size_t>(slots) * slot_bytes),
            "cudaMalloc (staging ring)");
      ws->staging_capacity = slots * slot_bytes;
    }
    ws->slot_bytes = slot_bytes;
  }

  // recorded: `done` was recorded after the workspace's last use on the stream.
  void release(Workspace* ws, bool recorded = false) {
    std::lock_guard<std::mutex> lock(mu_);
    ws->recorded = recorded || ws->recorded;
    ws->last_use = ++clock_;
    ws->busy = false;
  }

 private:
  std::mutex mu_;
  std::vector<std::unique_ptr<Workspace>> all_;
  uint64_t clock_ = 0;
};

inline WorkspacePool& pool() {
  static WorkspacePool* p = new WorkspacePool();  // never destroyed: CUDA may be gone at exit
  return *p;
}

inline int num_sms(int device) {
  static std::mutex mu;
  static std::unordered_map<int, int> cache;
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find(device);
  if (it != cache.end()) return it->second;
  int n = 0;
  check(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device), "cudaDeviceGetAttribute (SM count)");
  cache[device] = n;
  return n;
}

class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    check(cudaGetDevice(&prev_), "cudaGetDevice");
    // Always: it also binds the device's primary context to a thread that has not used CUDA
    // through this runtime yet (pointer queries see no mapping without it).
    check(cudaSetDevice(device), "cudaSetDevice");
  }
  ~DeviceGuard() {
    int now = -1;
    if (cudaGetDevice(&now) == cudaSuccess && now != prev_) cudaSetDevice(prev_);
  }

 private:
  int prev_ = 0;
};

}  // namespace cuda
}  // namespace kvconnect
