// kvconnect transfer descriptors: the contract between the Python planner and every
// compiled kernel (CPU, CUDA, NPU). Plain integers only: no torch, no engine types.
//
// A *plane* is one paged tensor. Row `r` of block `b` lives at
//     base_addr + b * block_stride_bytes + r * row_stride_bytes
// and its `row_bytes` bytes are contiguous. A block whose rows keep their fields in separate
// regions ([rows x 576 data][rows x 8 scales], vLLM DeepSeek V4) is one plane per region (a
// sub-plane): base_addr points at the region in block 0, row_stride_bytes = row_bytes = the
// field's bytes; block_stride_bytes is the block's. Kernels need nothing else for them.
// A *slot* names one row of a plane:
//     slot = block * rows_per_block + row_in_block,   0 <= slot < num_slots.
// A *segment* moves `num_rows` rows of one plane, named by slots[slot_offset ...], to or
// from a tight run of bytes at buffer_base + buffer_offset (row i at + i * row_bytes).
//
// Tables, as C-contiguous int64 arrays:
//   planes   [P, 6]: base_addr, block_stride_bytes, row_stride_bytes, row_bytes,
//                    rows_per_block, num_slots
//   segments [S, 4]: plane, num_rows, slot_offset, buffer_offset
//   slots    [N]
#pragma once
#include <cstdint>
#include <stdexcept>
#include <string>

namespace kvconnect {

constexpr int kPlaneCols = 6;
constexpr int kSegmentCols = 4;

struct PlaneDesc {
  int64_t base_addr;
  int64_t block_stride_bytes;
  int64_t row_stride_bytes;
  int64_t row_bytes;
  int64_t rows_per_block;
  int64_t num_slots;
};

struct SegmentDesc {
  int64_t plane;
  int64_t num_rows;
  int64_t slot_offset;
  int64_t buffer_offset;
};

static_assert(sizeof(PlaneDesc) == kPlaneCols * sizeof(int64_t), "PlaneDesc layout");
static_assert(sizeof(SegmentDesc) == kSegmentCols * sizeof(int64_t), "SegmentDesc layout");

#if defined(__CUDACC__)
#define KVC_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define KVC_HOST_DEVICE inline
#endif

KVC_HOST_DEVICE int64_t row_addr(const PlaneDesc& p, int64_t slot) {
  const int64_t block = slot / p.rows_per_block;
  const int64_t row = slot - block * p.rows_per_block;
  return p.base_addr + block * p.block_stride_bytes + row * p.row_stride_bytes;
}

// Checks every index a transfer will touch; throws std::out_of_range naming the first
// bad one. Runs on the host before any byte moves (the Python wrapper checks too: this is
// the last barrier before raw pointers are dereferenced).
inline void validate_tables(const PlaneDesc* planes, int64_t num_planes,
                            const SegmentDesc* segments, int64_t num_segments,
                            const int64_t* slots, int64_t num_slots_total,
                            int64_t buffer_bytes) {
  for (int64_t s = 0; s < num_segments; ++s) {
    const SegmentDesc& seg = segments[s];
    if (seg.plane < 0 || seg.plane >= num_planes)
      throw std::out_of_range("segment " + std::to_string(s) + ": plane index " +
                              std::to_string(seg.plane) + " out of range");
    const PlaneDesc& p = planes[seg.plane];
    if (seg.num_rows < 0 || seg.slot_offset < 0 || seg.slot_offset + seg.num_rows > num_slots_total)
      throw std::out_of_range("segment " + std::to_string(s) + ": slot range out of the slot table");
    if (seg.buffer_offset < 0 || seg.buffer_offset + seg.num_rows * p.row_bytes > buffer_bytes)
      throw std::out_of_range("segment " + std::to_string(s) + ": buffer range out of the buffer");
    for (int64_t i = 0; i < seg.num_rows; ++i) {
      const int64_t slot = slots[seg.slot_offset + i];
      if (slot < 0 || slot >= p.num_slots)
        throw std::out_of_range("segment " + std::to_string(s) + ": slot " + std::to_string(slot) +
                                " not in [0, " + std::to_string(p.num_slots) + ")");
    }
  }
}

}  // namespace kvconnect
