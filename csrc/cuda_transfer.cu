// CUDA gather/scatter between paged KV planes in device memory and a flat chunk buffer in
// pinned host memory (see transfer_desc.h for the descriptor contract). Built as
// kvconnect._cuda_kernels with pybind11 and the CUDA runtime only (no libtorch).
//
// One call = one kernel launch for the whole batch (every plane, layer, group and chunk):
//   1. the host validates every index (transfer_desc.h's rules) before a pointer is used;
//   2. it turns segments into copy ops: a run of rows whose paged addresses are adjacent is
//      one op (whole blocks for tight planes), split at max_op_bytes for load balance;
//   3. one launch moves the bytes: a persistent grid of warps reads the op table zero-copy
//      from mapped pinned memory; each warp takes whole ops, copying 16/8/4/2/1-byte units
//      (the widest both start addresses allow; a tail under 16 bytes goes byte by byte)
//      with four loads in flight per lane, and reads or writes the host buffer zero-copy
//      through its mapped device address (identical to the host address under UVA);
//   4. an event is recorded on the caller's stream; the synchronous form waits on it.
// The staged route (Options::staged, staged_plan.h) replaces step 3 for a pinned buffer: the
// batch goes through a ring of device slots, a kernel per piece on the caller's stream and
// the copy engines on a side stream, so PCIe carries large DMA copies whatever the layout.
// The GIL is released throughout; every CUDA status becomes a CudaError naming the call.
#include <cuda_runtime.h>
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "copy_plan.h"
#include "cuda_resources.h"
#include "staged_plan.h"
#include "transfer_desc.h"

namespace py = pybind11;
using kvconnect::PlaneDesc;
using kvconnect::SegmentDesc;
using kvconnect::copy_plan::for_each_op;
using kvconnect::copy_plan::Plan;
using kvconnect::copy_plan::plan_runs;
using kvconnect::copy_plan::validate;
using kvconnect::copy_plan::width_log2;
using kvconnect::cuda::check;
using kvconnect::cuda::CopyOp;
using kvconnect::cuda::CudaError;
using kvconnect::cuda::DeviceGuard;
using kvconnect::cuda::num_sms;
using kvconnect::cuda::pool;
using kvconnect::cuda::Workspace;
using kvconnect::staged_plan::StagedPlan;

namespace {

// ---------------------------------------------------------------------------------------
// device side

template <typename V>
__device__ __forceinline__ V load_once(const V* p) {
  return __ldcs(p);  // every byte is read exactly once: do not keep it in cache
}
template <typename V>
__device__ __forceinline__ void store_once(V* p, const V& v) {
  __stcs(p, v);
}

// The 32 lanes of a warp copy n units of type V; kUnroll loads are in flight per lane before
// the first store (PCIe round trips take ~1-2 us: the loads must overlap to fill the link).
template <typename V, int kUnroll>
__device__ __forceinline__ void copy_units(char* dst, const char* src, int n, int lane) {
  constexpr int width = 32;
  const V* s = reinterpret_cast<const V*>(src);
  V* d = reinterpret_cast<V*>(dst);
  int i = lane;
  for (; i + (kUnroll - 1) * width < n; i += kUnroll * width) {
    V r[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) r[u] = load_once(s + i + u * width);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) store_once(d + i + u * width, r[u]);
  }
  for (; i < n; i += width) store_once(d + i, load_once(s + i));
}

// Threads per block at most, and blocks of that size one SM must hold at once: this caps the
// kernel at 32 registers, so a store and a load kernel (2 blocks of 512 per SM each) can be
// resident together and use both directions of the link.
constexpr int kMaxThreads = 512;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
constexpr int kMinBlocksPerSM = 2;  // sm_75 holds 1024 threads per SM
#else
constexpr int kMinBlocksPerSM = 4;
#endif

// Persistent grid of warps: warp w takes ops w, w + num_warps, ... so neighbouring warps write
// neighbouring buffer bytes. The op table may live in mapped host memory (24 bytes per op).
// (Groups of 128 or 512 threads per op were measured no faster; docs/gpu.md.)
template <int kUnroll>
__global__ void __launch_bounds__(kMaxThreads, kMinBlocksPerSM)
    copy_ops_kernel(const CopyOp* __restrict__ ops, int64_t num_ops, char* __restrict__ buffer, int to_buffer) {
  const int lane = threadIdx.x & 31;
  const int64_t warps_per_block = blockDim.x >> 5;
  const int64_t num_warps = gridDim.x * warps_per_block;
  for (int64_t w = blockIdx.x * warps_per_block + (threadIdx.x >> 5); w < num_ops; w += num_warps) {
    const CopyOp op = ops[w];
    char* paged = reinterpret_cast<char*>(op.paged);
    char* flat = buffer + op.flat;
    char* dst = to_buffer ? flat : paged;
    const char* src = to_buffer ? paged : flat;
    const int units = op.bytes >> op.width_log2;
    switch (op.width_log2) {
      case 4: copy_units<uint4, kUnroll>(dst, src, units, lane); break;
      case 3: copy_units<uint2, kUnroll>(dst, src, units, lane); break;
      case 2: copy_units<unsigned int, kUnroll>(dst, src, units, lane); break;
      case 1: copy_units<unsigned short, kUnroll>(dst, src, units, lane); break;
      default: copy_units<unsigned char, kUnroll>(dst, src, units, lane); break;
    }
    const int body = units << op.width_log2;
    if (lane < op.bytes - body)
      store_once(reinterpret_cast<unsigned char*>(dst) + body + lane,
                 load_once(reinterpret_cast<const unsigned char*>(src) + body + lane));
  }
}

// ---------------------------------------------------------------------------------------
// host side: buffers and launches (per-device resources: cuda_resources.h)

// Device address of buffer bytes [addr, addr + bytes): mapped pinned host memory (its
// device alias, equal to addr under UVA) or device memory of `device`. Pageable memory
// cannot be reached by a kernel and is refused before anything moves.
struct BufferAddress {
  int64_t device_addr;
  bool host;  // pinned host memory (else device memory)
};

BufferAddress buffer_device_address(int64_t addr, int64_t bytes, int device) {
  bool host = false;
  auto resolve = [device, &host](int64_t a, const char* which) -> int64_t {
    cudaPointerAttributes attr{};
    check(cudaPointerGetAttributes(&attr, reinterpret_cast<void*>(a)), "cudaPointerGetAttributes (buffer)");
    if (attr.type == cudaMemoryTypeHost) {
      host = true;
      if (attr.devicePointer == nullptr)
        throw std::invalid_argument(std::string("the buffer's ") + which + " byte is pinned but not mapped into the device");
      return reinterpret_cast<int64_t>(attr.devicePointer);
    }
    if (attr.type == cudaMemoryTypeDevice || attr.type == cudaMemoryTypeManaged) {
      if (attr.device != device)
        throw std::invalid_argument("the buffer is on CUDA device " + std::to_string(attr.device) + ", the planes on " +
                                    std::to_string(device));
      return a;
    }
    throw std::invalid_argument(std::string("the buffer's ") + which +
                                " byte is pageable host memory; the CUDA kernel needs a pinned buffer (pin_memory=True)");
  };
  const int64_t first = resolve(addr, "first");
  const bool first_host = host;
  if (bytes > 1 && (resolve(addr + bytes - 1, "last") != first + bytes - 1 || host != first_host))
    throw std::invalid_argument("the buffer spans more than one pinned allocation");
  return {first, host};
}

// ---------------------------------------------------------------------------------------
// the entry point

using Int64Array = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;

struct Options {
  int threads_per_block;  // multiple of 32, <= kMaxThreads
  int blocks_per_sm;      // persistent grid size = SMs * blocks_per_sm (capped by the work)
  int64_t max_op_bytes;   // ops longer than this are split (load balance)
  int unroll;             // loads in flight per lane: 2 or 4
  bool copy_op_table;     // copy the op table to device memory first (else read it zero-copy)
  bool merge_rows;        // merge runs of adjacent rows into one op
  bool use_dma;           // copy engines (cudaMemcpyBatchAsync per run) instead of the kernel
  bool staged;            // the staged route (pinned buffers; device buffers take the kernel)
  int staging_slots;      // ring slots, >= 2
  int64_t first_piece_bytes, max_piece_bytes, merge_gap_bytes;  // staged_plan.h
};

void launch_kernel(const Options& o, const CopyOp* ops, int64_t num_ops, char* buffer, bool to_buffer, int device,
                   cudaStream_t stream) {
  const int warps_per_block = o.threads_per_block / 32;
  const int64_t wanted = (num_ops + warps_per_block - 1) / warps_per_block;
  const int blocks = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(wanted, int64_t{num_sms(device)} * o.blocks_per_sm)));
  const int tpb = o.threads_per_block;
  switch (o.unroll) {
    case 2: copy_ops_kernel<2><<<blocks, tpb, 0, stream>>>(ops, num_ops, buffer, to_buffer); break;
    default: copy_ops_kernel<4><<<blocks, tpb, 0, stream>>>(ops, num_ops, buffer, to_buffer); break;
  }
  check(cudaGetLastError(), "launch of the transfer kernel");
}

void launch_dma(const PlaneDesc* planes, const SegmentDesc* segments, int64_t num_segments, const int64_t* slots,
                const Plan& plan, int64_t buffer_dev, bool to_buffer, cudaStream_t stream) {
  std::vector<void*> dsts, srcs;
  std::vector<size_t> sizes;
  for_each_op(planes, segments, num_segments, slots, plan, int64_t{1} << 40, [&](int64_t paged, int64_t flat, int64_t bytes) {
    void* p = reinterpret_cast<void*>(paged);
    void* f = reinterpret_cast<void*>(buffer_dev + flat);
    dsts.push_back(to_buffer ? f : p);
    srcs.push_back(to_buffer ? p : f);
    sizes.push_back(static_cast<size_t>(bytes));
  });
#if CUDART_VERSION >= 12080
  cudaMemcpyAttributes attr{};
  attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
  size_t attr_index = 0;
  constexpr size_t kBatch = 4096;
  for (size_t i = 0; i < sizes.size(); i += kBatch) {
    const size_t n = std::min(kBatch, sizes.size() - i);
#if CUDART_VERSION >= 13000
    check(cudaMemcpyBatchAsync(dsts.data() + i, srcs.data() + i, sizes.data() + i, n, &attr, &attr_index, 1, stream),
          "cudaMemcpyBatchAsync");
#else
    size_t fail = 0;
    check(cudaMemcpyBatchAsync(dsts.data() + i, srcs.data() + i, sizes.data() + i, n, &attr, &attr_index, 1, &fail,
                               stream),
          "cudaMemcpyBatchAsync");
#endif
  }
#else
  for (size_t i = 0; i < sizes.size(); ++i)
    check(cudaMemcpyAsync(dsts[i], srcs[i], sizes[i], cudaMemcpyDefault, stream), "cudaMemcpyAsync");
#endif
}

// The staged route on `stream` (S) and the ring's copy stream (C). Piece k uses slot k % K;
// a store queues, per piece: S waits until slot's previous copies drained, kernel gathers
// into the slot, S records filled; C waits filled, copies slot -> buffer, records drained.
// A load: C waits drained (the slot's previous scatter), copies buffer -> slot, records
// filled; S waits filled, kernel scatters, records drained. Each wait sees the latest record
// queued before it, so events are reused per slot. C starts after S's earlier work, and S
// continues only after C's last copy, so the caller sees one ordered operation on S.
// Pieces are queued as the plan completes them (streamed: while later ops are still being
// planned, so a synchronous call does not wait for the whole plan before its first copy).
void run_staged(bool streamed, const PlaneDesc* planes, const SegmentDesc* segments, int64_t num_segments,
                const int64_t* slots, const Plan& runs, StagedPlan& sp, Workspace* ws, const Options& o,
                int64_t buffer_host, bool to_buffer, int device, cudaStream_t stream) {
  pool().staging_ring(ws, o.staging_slots, o.max_piece_bytes);
  cudaStream_t copies = ws->copy_stream;
  check(cudaEventRecord(ws->start, stream), "cudaEventRecord (staged start)");
  check(cudaStreamWaitEvent(copies, ws->start, 0), "cudaStreamWaitEvent (staged start)");
  const cudaMemcpyKind kind = to_buffer ? cudaMemcpyDeviceToHost : cudaMemcpyHostToDevice;
  auto queue_piece = [&](size_t k) {
    const int slot = static_cast<int>(k % o.staging_slots);
    char* ring = ws->staging + slot * ws->slot_bytes;
    const bool reused = k >= static_cast<size_t>(o.staging_slots);
    auto run_kernel = [&] {
      const int64_t n = sp.op_begin[k + 1] - sp.op_begin[k];
      if (n > 0) launch_kernel(o, ws->host_alias + sp.op_begin[k], n, ring, to_buffer, device, stream);
    };
    auto run_copies = [&] {
      for (int64_t c = sp.copy_begin[k]; c < sp.copy_begin[k + 1]; ++c) {
        const auto& cp = sp.copies[c];
        void* host = reinterpret_cast<void*>(buffer_host + cp.flat);
        void* dev = ring + cp.staging;
        check(cudaMemcpyAsync(to_buffer ? host : dev, to_buffer ? dev : host, cp.bytes, kind, copies),
              "cudaMemcpyAsync (staged copy)");
      }
    };
    if (to_buffer) {
      if (reused) check(cudaStreamWaitEvent(stream, ws->drained[slot], 0), "cudaStreamWaitEvent (slot drained)");
      run_kernel();
      check(cudaEventRecord(ws->filled[slot], stream), "cudaEventRecord (slot filled)");
      check(cudaStreamWaitEvent(copies, ws->filled[slot], 0), "cudaStreamWaitEvent (slot filled)");
      run_copies();
      check(cudaEventRecord(ws->drained[slot], copies), "cudaEventRecord (slot drained)");
    } else {
      if (reused) check(cudaStreamWaitEvent(copies, ws->drained[slot], 0), "cudaStreamWaitEvent (slot drained)");
      run_copies();
      check(cudaEventRecord(ws->filled[slot], copies), "cudaEventRecord (slot filled)");
      check(cudaStreamWaitEvent(stream, ws->filled[slot], 0), "cudaStreamWaitEvent (slot filled)");
      run_kernel();
      check(cudaEventRecord(ws->drained[slot], stream), "cudaEventRecord (slot drained)");
    }
  };
  CopyOp* out = ws->host;  // slot bases are 256-aligned: an op's alignment is its offset's
  CopyOp* const end = ws->host + ws->capacity;
  kvconnect::staged_plan::emit_ops(
      streamed, planes, segments, num_segments, slots, runs, o.max_op_bytes, sp,
      [&](const kvconnect::staged_plan::StagedOp& op) {
        if (out == end) throw std::logic_error("kvconnect staged route: more ops than planned for");
        *out++ = CopyOp{op.paged, op.staging, static_cast<int32_t>(op.bytes), width_log2(op.paged, op.staging)};
      },
      queue_piece);
  check(cudaEventRecord(ws->copies_done, copies), "cudaEventRecord (staged copies done)");
  check(cudaStreamWaitEvent(stream, ws->copies_done, 0), "cudaStreamWaitEvent (staged copies done)");
}

// After a failure part-way: S waits for everything queued on C, so recording `done` on S
// covers the whole call. False if even that failed (the workspace must then be leaked).
bool join_copy_stream(Workspace* ws, cudaStream_t stream) {
  if (ws->copy_stream == nullptr || ws->copies_done == nullptr) return true;
  return cudaEventRecord(ws->copies_done, ws->copy_stream) == cudaSuccess &&
         cudaStreamWaitEvent(stream, ws->copies_done, 0) == cudaSuccess;
}

// Returns the number of copy ops (runs, after splitting) the launch moved.
int64_t transfer(bool to_buffer, const Int64Array& planes_arr, const Int64Array& segments_arr, const Int64Array& slots_arr,
                 int64_t buffer_addr, int64_t buffer_bytes, int device, int64_t stream_handle, bool synchronize,
                 const Options& o) {
  if (planes_arr.ndim() != 2 || planes_arr.shape(1) != kvconnect::kPlaneCols)
    throw std::invalid_argument("planes must be an int64 array of shape [P, 6]");
  if (segments_arr.ndim() != 2 || segments_arr.shape(1) != kvconnect::kSegmentCols)
    throw std::invalid_argument("segments must be an int64 array of shape [S, 4]");
  if (slots_arr.ndim() != 1) throw std::invalid_argument("slots must be a 1-D int64 array");
  if (o.threads_per_block < 32 || o.threads_per_block > kMaxThreads || o.threads_per_block % 32)
    throw std::invalid_argument("threads_per_block must be a multiple of 32 in [32, 512]");
  if (o.blocks_per_sm < 1 || o.blocks_per_sm > 64) throw std::invalid_argument("blocks_per_sm must be in [1, 64]");
  if (o.max_op_bytes < 16 || o.max_op_bytes > (int64_t{1} << 30) || (o.max_op_bytes & (o.max_op_bytes - 1)))
    throw std::invalid_argument("max_op_bytes must be a power of two in [16, 2**30]");
  if (o.unroll != 2 && o.unroll != 4) throw std::invalid_argument("unroll must be 2 or 4");
  if (o.staged) {
    kvconnect::staged_plan::check_sizes(o.first_piece_bytes, o.max_piece_bytes, o.merge_gap_bytes);
    if (o.staging_slots < 2 || o.staging_slots > 16) throw std::invalid_argument("staging_slots must be in [2, 16]");
  }
  if (buffer_bytes < 0) throw std::invalid_argument("buffer_bytes must be >= 0");
  const auto* planes = reinterpret_cast<const PlaneDesc*>(planes_arr.data());
  const auto* segments = reinterpret_cast<const SegmentDesc*>(segments_arr.data());
  const int64_t* slots = slots_arr.data();
  const int64_t num_planes = planes_arr.shape(0);
  const int64_t num_segments = segments_arr.shape(0);
  const int64_t num_slots = slots_arr.shape(0);
  auto stream = reinterpret_cast<cudaStream_t>(stream_handle);

  py::gil_scoped_release release;
  validate(planes, num_planes, segments, num_segments, slots, num_slots, buffer_bytes);
  const Plan plan = plan_runs(planes, segments, num_segments, slots, o.merge_rows, o.max_op_bytes);
  if (plan.num_ops == 0) return 0;

  DeviceGuard guard(device);
  const BufferAddress buffer = buffer_device_address(buffer_addr, buffer_bytes, device);
  const int64_t buffer_dev = buffer.device_addr;
  if (o.use_dma) {
    launch_dma(planes, segments, num_segments, slots, plan, buffer_dev, to_buffer, stream);
    if (synchronize) check(cudaStreamSynchronize(stream), "cudaStreamSynchronize (DMA transfer)");
    return plan.num_ops;
  }
  const bool staged = o.staged && buffer.host;  // a device buffer gains nothing from staging
  thread_local StagedPlan sp;  // reused: its memory stays mapped between calls
  thread_local std::vector<kvconnect::staged_plan::FlatOp> flat_ops;
  bool streamed = false;
  int64_t num_ops = plan.num_ops;  // op table entries to reserve
  if (staged) {
    streamed = kvconnect::staged_plan::lay_out_segments(planes, segments, num_segments, o.first_piece_bytes,
                                                        o.max_piece_bytes, o.merge_gap_bytes, to_buffer, sp);
    if (!streamed)
      kvconnect::staged_plan::plan_whole(planes, segments, num_segments, slots, plan, o.max_op_bytes,
                                         o.first_piece_bytes, o.max_piece_bytes, o.merge_gap_bytes, to_buffer,
                                         flat_ops, sp);
    // cutting at piece edges adds at most one op per edge
    num_ops = streamed ? plan.num_ops + static_cast<int64_t>(sp.num_pieces()) : static_cast<int64_t>(sp.ops.size());
  }

  Workspace* ws = pool().acquire(device, static_cast<size_t>(num_ops));
  bool recorded = false;
  try {
    if (staged) {
      run_staged(streamed, planes, segments, num_segments, slots, plan, sp, ws, o, buffer_addr, to_buffer, device, stream);
    } else {
      CopyOp* out = ws->host;
      for_each_op(planes, segments, num_segments, slots, plan, o.max_op_bytes, [&](int64_t paged, int64_t flat, int64_t bytes) {
        *out++ = CopyOp{paged, flat, static_cast<int32_t>(bytes), width_log2(paged, buffer_dev + flat)};
      });
      const CopyOp* table = ws->host_alias;
      if (o.copy_op_table) {
        CopyOp* dev = pool().device_table(ws);
        check(cudaMemcpyAsync(dev, ws->host, plan.num_ops * sizeof(CopyOp), cudaMemcpyHostToDevice, stream),
              "cudaMemcpyAsync (op table to device)");
        table = dev;
      }
      launch_kernel(o, table, plan.num_ops, reinterpret_cast<char*>(buffer_dev), to_buffer, device, stream);
    }
    check(cudaEventRecord(ws->done, stream), "cudaEventRecord (transfer done)");
    recorded = true;
    if (synchronize) check(cudaEventSynchronize(ws->done), "cudaEventSynchronize (waiting for the transfer)");
  } catch (...) {
    // Work may already be queued: keep the workspace until the stream (and, staged, the copy
    // stream) pass it.
    if (!recorded && (!staged || join_copy_stream(ws, stream)) && cudaEventRecord(ws->done, stream) == cudaSuccess)
      recorded = true;
    if (recorded) pool().release(ws, true);  // else leak it: it may still be read
    throw;
  }
  pool().release(ws, true);
  return staged ? sp.op_begin.back() : plan.num_ops;
}

int64_t device_pointer(int64_t host_addr) {
  py::gil_scoped_release release;
  void* dev = nullptr;
  check(cudaHostGetDevicePointer(&dev, reinterpret_cast<void*>(host_addr), 0), "cudaHostGetDevicePointer");
  return reinterpret_cast<int64_t>(dev);
}

bool unified_addressing(int device) {
  int v = 0;
  check(cudaDeviceGetAttribute(&v, cudaDevAttrUnifiedAddressing, device), "cudaDeviceGetAttribute (unified addressing)");
  return v != 0;
}

int device_count() {
  int n = 0;
  const cudaError_t status = cudaGetDeviceCount(&n);
  if (status == cudaErrorNoDevice || status == cudaErrorInsufficientDriver) {
    cudaGetLastError();
    return 0;
  }
  check(status, "cudaGetDeviceCount");
  return n;
}

}  // namespace

PYBIND11_MODULE(_cuda_kernels, m) {
  m.doc() =
      "kvconnect CUDA transfer kernels (raw pointers + int64 descriptor tables; see csrc/transfer_desc.h). "
      "Built against the CUDA runtime only (no libtorch).";
  py::register_exception<CudaError>(m, "CudaError", PyExc_RuntimeError);
  auto bind = [&m](const char* name, bool to_buffer, const char* doc) {
    m.def(
        name,
        [to_buffer](const Int64Array& planes, const Int64Array& segments, const Int64Array& slots, int64_t buffer_addr,
                    int64_t buffer_bytes, int device, int64_t stream, bool synchronize, int threads_per_block,
                    int blocks_per_sm, int64_t max_op_bytes, int unroll, bool copy_op_table,
                    bool merge_rows, bool use_dma, bool staged, int staging_slots, int64_t first_piece_bytes,
                    int64_t max_piece_bytes, int64_t merge_gap_bytes) {
          const Options o{threads_per_block, blocks_per_sm, max_op_bytes, unroll, copy_op_table, merge_rows, use_dma,
                          staged, staging_slots, first_piece_bytes, max_piece_bytes, merge_gap_bytes};
          return transfer(to_buffer, planes, segments, slots, buffer_addr, buffer_bytes, device, stream, synchronize, o);
        },
        doc, py::arg("planes"), py::arg("segments"), py::arg("slots"), py::arg("buffer_addr"), py::arg("buffer_bytes"),
        py::arg("device"), py::arg("stream"), py::arg("synchronize"), py::arg("threads_per_block") = 512,
        py::arg("blocks_per_sm") = 2, py::arg("max_op_bytes") = 32768, py::arg("unroll") = 4,
        py::arg("copy_op_table") = false, py::arg("merge_rows") = true,
        py::arg("use_dma") = false, py::arg("staged") = false, py::arg("staging_slots") = 2,
        py::arg("first_piece_bytes") = 1 << 20, py::arg("max_piece_bytes") = 8 << 20,
        py::arg("merge_gap_bytes") = 64 << 10);
  };
  bind("gather", true, "paged planes -> buffer on `stream`; returns the number of copy ops");
  bind("scatter", false, "buffer -> paged planes on `stream`; returns the number of copy ops");
  m.def("device_pointer", &device_pointer, "device alias of a pinned host address", py::arg("host_addr"));
  m.def("unified_addressing", &unified_addressing, py::arg("device"));
  m.def("device_count", &device_count, "CUDA devices visible to this runtime (0 without a driver or GPU)");
  m.attr("cuda_runtime_version") = CUDART_VERSION;
}
