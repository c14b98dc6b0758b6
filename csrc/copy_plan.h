// Host-side planning of a CUDA transfer (no CUDA here): validation of the descriptor tables
// and their translation into copy ops, i.e. runs of rows adjacent in paged memory, split for
// load balance. Used by cuda_transfer.cu; see transfer_desc.h for the tables.
#pragma once
#include <algorithm>
#include <cstdint>
#include <functional>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "transfer_desc.h"

namespace kvconnect {
namespace copy_plan {

// ---------------------------------------------------------------------------------------
// host side: validation

// transfer_desc.h's validate_tables checks every (segment, row) pair; planes of one group
// share slot runs, so this checks each distinct slot run once (min/max) and each segment
// against it: the same rules in O(slots + segments). On any violation the reference
// validator runs to raise its exact message.
struct RunKey {
  int64_t slot_offset, num_rows;
  bool operator==(const RunKey& o) const { return slot_offset == o.slot_offset && num_rows == o.num_rows; }
};
struct RunKeyHash {
  size_t operator()(const RunKey& k) const { return std::hash<int64_t>()(k.slot_offset * 1000003 + k.num_rows); }
};

[[noreturn]] inline void reference_failure(const PlaneDesc* planes, int64_t num_planes, const SegmentDesc* segments,
                                           int64_t num_segments, const int64_t* slots, int64_t num_slots,
                                           int64_t buffer_bytes) {
  kvconnect::validate_tables(planes, num_planes, segments, num_segments, slots, num_slots, buffer_bytes);
  throw std::out_of_range("transfer tables failed validation");
}

inline void validate(const PlaneDesc* planes, int64_t num_planes, const SegmentDesc* segments, int64_t num_segments,
                     const int64_t* slots, int64_t num_slots, int64_t buffer_bytes) {
  for (int64_t p = 0; p < num_planes; ++p) {
    const PlaneDesc& d = planes[p];
    if (d.rows_per_block <= 0 || d.row_bytes <= 0 || d.num_slots < 0 || d.block_stride_bytes < 0 ||
        d.row_stride_bytes < 0 || d.row_bytes > (int64_t{1} << 40))
      throw std::invalid_argument("plane " + std::to_string(p) + ": malformed geometry");
  }
  std::unordered_map<RunKey, std::pair<int64_t, int64_t>, RunKeyHash> ranges;
  const std::pair<const RunKey, std::pair<int64_t, int64_t>>* last = nullptr;  // elements never move
  for (int64_t s = 0; s < num_segments; ++s) {
    const SegmentDesc& seg = segments[s];
    const bool ok = seg.plane >= 0 && seg.plane < num_planes && seg.num_rows >= 0 && seg.slot_offset >= 0 &&
                    seg.num_rows <= num_slots && seg.slot_offset <= num_slots - seg.num_rows &&
                    seg.buffer_offset >= 0 && seg.buffer_offset <= buffer_bytes &&
                    seg.num_rows <= (buffer_bytes - seg.buffer_offset) / planes[seg.plane].row_bytes;
    if (!ok) reference_failure(planes, num_planes, segments, num_segments, slots, num_slots, buffer_bytes);
    if (seg.num_rows == 0) continue;
    const RunKey key{seg.slot_offset, seg.num_rows};
    if (last == nullptr || !(last->first == key)) {  // else the previous segment's run (every plane of a group)
      auto it = ranges.find(key);
      if (it == ranges.end()) {
        const int64_t* run = slots + seg.slot_offset;
        int64_t lo = run[0], hi = run[0];
        for (int64_t i = 1; i < seg.num_rows; ++i) {
          lo = std::min(lo, run[i]);
          hi = std::max(hi, run[i]);
        }
        it = ranges.emplace(key, std::make_pair(lo, hi)).first;
      }
      last = &*it;
    }
    if (last->second.first < 0 || last->second.second >= planes[seg.plane].num_slots)
      reference_failure(planes, num_planes, segments, num_segments, slots, num_slots, buffer_bytes);
  }
}

// ---------------------------------------------------------------------------------------
// host side: copy ops

inline int64_t slot_offset_bytes(const PlaneDesc& p, int64_t slot) { return kvconnect::row_addr(p, slot) - p.base_addr; }

// Row runs of one slot run under one plane geometry: starts[k] is the first row of run k.
// Planes with equal geometry (all K/V planes of a model, say) share the result.
struct GeometryKey {
  int64_t slot_offset, num_rows, rows_per_block, row_stride, row_bytes, block_stride;
  bool operator==(const GeometryKey& o) const {
    return slot_offset == o.slot_offset && num_rows == o.num_rows && rows_per_block == o.rows_per_block &&
           row_stride == o.row_stride && row_bytes == o.row_bytes && block_stride == o.block_stride;
  }
};
struct GeometryKeyHash {
  size_t operator()(const GeometryKey& k) const {
    size_t h = 0;
    for (int64_t v : {k.slot_offset, k.num_rows, k.rows_per_block, k.row_stride, k.row_bytes, k.block_stride})
      h = h * 1000003 ^ std::hash<int64_t>()(v);
    return h;
  }
};

struct Plan {
  std::vector<const std::vector<int64_t>*> runs_of_segment;  // per segment, into `runs`
  std::unordered_map<GeometryKey, std::vector<int64_t>, GeometryKeyHash> runs;
  int64_t num_ops = 0;
};

inline int64_t pieces(int64_t bytes, int64_t max_op_bytes) { return (bytes + max_op_bytes - 1) / max_op_bytes; }

inline Plan plan_runs(const PlaneDesc* planes, const SegmentDesc* segments, int64_t num_segments, const int64_t* slots,
                      bool merge_rows, int64_t max_op_bytes) {
  Plan plan;
  plan.runs_of_segment.resize(num_segments, nullptr);
  const std::pair<const GeometryKey, std::vector<int64_t>>* last = nullptr;  // elements never move
  int64_t last_ops = 0;
  for (int64_t s = 0; s < num_segments; ++s) {
    const SegmentDesc& seg = segments[s];
    const PlaneDesc& p = planes[seg.plane];
    if (seg.num_rows == 0) continue;
    const GeometryKey key{seg.slot_offset, seg.num_rows, p.rows_per_block, p.row_stride_bytes, p.row_bytes,
                          p.block_stride_bytes};
    if (last == nullptr || !(last->first == key)) {  // else: the previous segment's runs (every plane of a group)
      auto it = plan.runs.find(key);
      if (it == plan.runs.end()) {
        std::vector<int64_t> starts{0};
        const int64_t* run = slots + seg.slot_offset;
        int64_t prev = slot_offset_bytes(p, run[0]);
        for (int64_t i = 1; i < seg.num_rows; ++i) {
          const int64_t cur = slot_offset_bytes(p, run[i]);
          if (!merge_rows || cur != prev + p.row_bytes) starts.push_back(i);
          prev = cur;
        }
        it = plan.runs.emplace(key, std::move(starts)).first;
      }
      last = &*it;
      last_ops = 0;  // ops of one segment with this geometry (row_bytes is part of the key)
      for (size_t k = 0; k < it->second.size(); ++k) {
        const int64_t end = k + 1 < it->second.size() ? it->second[k + 1] : seg.num_rows;
        last_ops += pieces((end - it->second[k]) * p.row_bytes, max_op_bytes);
      }
    }
    plan.runs_of_segment[s] = &last->second;
    plan.num_ops += last_ops;
  }
  return plan;
}

inline int width_log2(int64_t a, int64_t b) {
  const uint64_t x = static_cast<uint64_t>(a | b);
  return x == 0 ? 4 : std::min(4, __builtin_ctzll(x));
}

// Calls emit(paged_addr, buffer_offset, bytes) for every op, in segment order.
template <typename Emit>
void for_each_op(const PlaneDesc* planes, const SegmentDesc* segments, int64_t num_segments, const int64_t* slots,
                 const Plan& plan, int64_t max_op_bytes, Emit&& emit) {
  for (int64_t s = 0; s < num_segments; ++s) {
    const std::vector<int64_t>* starts = plan.runs_of_segment[s];
    if (starts == nullptr) continue;
    const SegmentDesc& seg = segments[s];
    const PlaneDesc& p = planes[seg.plane];
    for (size_t k = 0; k < starts->size(); ++k) {
      const int64_t first = (*starts)[k];
      const int64_t end = k + 1 < starts->size() ? (*starts)[k + 1] : seg.num_rows;
      const int64_t paged = kvconnect::row_addr(p, slots[seg.slot_offset + first]);
      const int64_t flat = seg.buffer_offset + first * p.row_bytes;
      const int64_t bytes = (end - first) * p.row_bytes;
      for (int64_t done = 0; done < bytes; done += max_op_bytes)
        emit(paged + done, flat + done, std::min(max_op_bytes, bytes - done));
    }
  }
}

}  // namespace copy_plan
}  // namespace kvconnect
