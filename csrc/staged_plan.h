// Host-side planning of the staged CUDA route (no CUDA here; the CPU extension exposes it
// to tests, the CUDA extension executes it).
//
// The zero-copy kernel moves every byte over PCIe with SM loads and stores, which tops out
// a few percent below the copy engines (docs/performance.md). The staged route leaves the
// PCIe side to the copy engines, in large copies, whatever the layout:
//
//   store: kernel gathers piece k's rows (HBM speed) -> device slot k % K -> one
//          cudaMemcpyAsync per contiguous extent part -> pinned buffer; the kernel of piece
//          k + 1 runs while piece k is on the link. K slots form a ring (not sized by the batch).
//   load:  the reverse: copy engine -> slot, then a kernel scatters the slot into the pages.
//
// The plan, from the copy ops of copy_plan.h (paged address, buffer offset, bytes):
//   extents  the union of the ops' buffer ranges in buffer order. A load joins ranges less
//            than merge_gap_bytes apart (reading a few unused bytes is cheaper than another
//            copy); a store never does (bytes between ops belong to someone else: a chunk
//            header, another chunk).
//   staging  extents end to end, each placed at a position congruent to its buffer offset
//            mod 16, so an op's staging address keeps the alignment of its buffer address
//            (the kernel keeps its vector width) and every piece edge is 16-aligned.
//   pieces   the staging space cut at first_piece_bytes, doubling up to max_piece_bytes.
//            A store grows from the start (the copy engines start after a small gather); a
//            load grows from the end (the last scatter, after the last copy, is small).
//   per piece: its ops split at piece edges (offset in the slot) and its copies (extent parts).
//
// Two ways to build it. Streamed, when the segments come in buffer order without overlap (the
// engine's tables): extents, pieces and copies follow from the segments alone, and ops are
// cut into pieces as copy_plan.h produces them, each piece reported complete as soon as the
// next one starts, so the executor launches it while the rest is still being planned. Else
// whole: every op is listed, sorted, and grouped by piece (a counting sort, which also covers
// overlapping loads, whose parts do not come in piece order).
#pragma once
#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "copy_plan.h"

namespace kvconnect {
namespace staged_plan {

constexpr int64_t kAlign = 16;

struct FlatOp {  // one run of copy_plan.h: paged address, buffer offset, bytes
  int64_t paged, flat, bytes;
};
struct StagedOp {  // the kernel's part: paged address <-> offset in the piece's slot
  int64_t paged, staging, bytes;
};
struct StagedCopy {  // the copy engine's part: offset in the slot <-> buffer offset
  int64_t staging, flat, bytes;
};
struct Extent {  // a run of buffer bytes and its position in the staging space
  int64_t flat, bytes, stage;
};

// A plan kept between calls reuses its vectors' memory (plan() clears them): fresh pages
// cost more than the planning itself on a large batch.
struct StagedPlan {
  std::vector<int64_t> piece_bytes;  // staging bytes of piece k (<= max_piece_bytes)
  std::vector<int64_t> piece_start;  // its start in the staging space
  std::vector<StagedOp> ops;         // piece k: ops[op_begin[k], op_begin[k + 1])
  std::vector<int64_t> op_begin;
  std::vector<StagedCopy> copies;    // piece k: copies[copy_begin[k], copy_begin[k + 1])
  std::vector<int64_t> copy_begin;
  std::vector<Extent> extents;
  std::vector<int64_t> cursor;  // scratch
  size_t num_pieces() const { return piece_bytes.size(); }
};

inline void check_sizes(int64_t first_piece_bytes, int64_t max_piece_bytes, int64_t merge_gap_bytes) {
  if (first_piece_bytes < kAlign || first_piece_bytes % kAlign || max_piece_bytes % kAlign ||
      first_piece_bytes > max_piece_bytes || max_piece_bytes > (int64_t{1} << 30))
    throw std::invalid_argument("staging pieces must be multiples of 16 bytes with 16 <= first <= max <= 2**30");
  if (merge_gap_bytes < 0 || merge_gap_bytes > (int64_t{1} << 30))
    throw std::invalid_argument("merge_gap_bytes must be in [0, 2**30]");
}

// Sizes summing to total (a multiple of 16): first, 2 * first, ... up to max, the last cut
// short; reversed when small_last.
inline void piece_sizes(int64_t total, int64_t first, int64_t max, bool small_last, std::vector<int64_t>& sizes) {
  sizes.clear();
  for (int64_t done = 0, size = first; done < total; size = std::min(max, 2 * size)) {
    sizes.push_back(std::min(size, total - done));
    done += sizes.back();
  }
  if (small_last) std::reverse(sizes.begin(), sizes.end());
}

// Calls part(piece, offset in the piece, bytes before this part, part bytes) for each part of
// the staging range [stage, stage + bytes) cut at piece edges. `k` is the piece of the
// previous call: ranges come in staging order, so the search walks forward from it.
template <typename Part>
void split(const StagedPlan& p, int64_t stage, int64_t bytes, size_t& k, Part&& part) {
  if (stage < p.piece_start[k])  // an overlapping op starts before the previous one's piece
    k = static_cast<size_t>(std::upper_bound(p.piece_start.begin(), p.piece_start.end(), stage) -
                            p.piece_start.begin()) - 1;
  for (int64_t done = 0; done < bytes;) {
    const int64_t u = stage + done;
    while (u >= p.piece_start[k] + p.piece_bytes[k]) ++k;
    const int64_t n = std::min(bytes - done, p.piece_start[k] + p.piece_bytes[k] - u);
    part(k, u - p.piece_start[k], done, n);
    done += n;
  }
}

// Rows grouped by piece (a counting sort: rows keep their order within a piece, which also
// covers overlapping ops, whose parts do not come in piece order). for_each(emit) calls
// emit(piece, row) for every row, the same way both times.
template <typename Row, typename ForEach>
void place(StagedPlan& p, std::vector<Row>& rows, std::vector<int64_t>& begin, ForEach&& for_each) {
  begin.assign(p.num_pieces() + 1, 0);
  for_each([&](size_t k, const Row&) { ++begin[k + 1]; });
  for (size_t k = 0; k < p.num_pieces(); ++k) begin[k + 1] += begin[k];
  rows.resize(static_cast<size_t>(begin.back()));
  p.cursor.assign(begin.begin(), begin.end() - 1);
  for_each([&](size_t k, const Row& row) { rows[p.cursor[k]++] = row; });
}

// Adds the buffer range [flat, flat + bytes) to extents built in buffer order.
inline void extend(std::vector<Extent>& extents, int64_t flat, int64_t bytes, int64_t gap) {
  if (extents.empty() || flat > extents.back().flat + extents.back().bytes + gap) {
    const int64_t cursor = extents.empty() ? 0 : extents.back().stage + extents.back().bytes;
    const int64_t pad = ((flat - cursor) % kAlign + kAlign) % kAlign;
    extents.push_back({flat, 0, cursor + pad});
  }
  Extent& e = extents.back();
  e.bytes = std::max(e.bytes, flat + bytes - e.flat);
}

// Pieces over the extents' staging space, and the copies of each piece (extents are in
// staging order, so their parts come in piece order).
inline void lay_out(StagedPlan& p, int64_t first_piece_bytes, int64_t max_piece_bytes, bool to_buffer) {
  const int64_t used = p.extents.empty() ? 0 : p.extents.back().stage + p.extents.back().bytes;
  piece_sizes((used + kAlign - 1) / kAlign * kAlign, first_piece_bytes, max_piece_bytes, !to_buffer, p.piece_bytes);
  p.piece_start.assign(p.piece_bytes.size(), 0);
  for (size_t k = 1; k < p.piece_bytes.size(); ++k) p.piece_start[k] = p.piece_start[k - 1] + p.piece_bytes[k - 1];
  place(p, p.copies, p.copy_begin, [&](auto&& emit) {
    size_t piece = 0;
    for (const Extent& x : p.extents)
      split(p, x.stage, x.bytes, piece, [&](size_t k, int64_t off, int64_t done, int64_t n) {
        emit(k, StagedCopy{off, x.flat + done, n});
      });
  });
}

// True (and the plan's extents, pieces and copies laid out) when the segments are in buffer
// order without overlap, so that their ops can be streamed.
inline bool lay_out_segments(const PlaneDesc* planes, const SegmentDesc* segments, int64_t num_segments,
                             int64_t first_piece_bytes, int64_t max_piece_bytes, int64_t merge_gap_bytes, bool to_buffer,
                             StagedPlan& p) {
  check_sizes(first_piece_bytes, max_piece_bytes, merge_gap_bytes);
  p.extents.clear();
  int64_t end = 0;
  for (int64_t s = 0; s < num_segments; ++s) {
    const SegmentDesc& seg = segments[s];
    const int64_t bytes = seg.num_rows * planes[seg.plane].row_bytes;
    if (bytes == 0) continue;
    if (seg.buffer_offset < end) return false;
    extend(p.extents, seg.buffer_offset, bytes, to_buffer ? 0 : merge_gap_bytes);
    end = seg.buffer_offset + bytes;
  }
  lay_out(p, first_piece_bytes, max_piece_bytes, to_buffer);
  return true;
}

// Cuts ops arriving in buffer order (from lay_out_segments' segments) into pieces: sink(op)
// receives each part in piece order; done(k) is called as soon as piece k is complete, with
// p.op_begin[k + 1] set. finish() completes the rest.
class OpStream {
 public:
  explicit OpStream(StagedPlan& p) : p_(p) { p_.op_begin.assign(1, 0); }

  template <typename Sink, typename Done>
  void add(const FlatOp& op, Sink&& sink, Done&& done) {
    while (op.flat >= p_.extents[extent_].flat + p_.extents[extent_].bytes) ++extent_;
    const Extent& x = p_.extents[extent_];
    split(p_, x.stage + (op.flat - x.flat), op.bytes, cut_, [&](size_t k, int64_t off, int64_t before, int64_t n) {
      close_until(k, done);
      sink(StagedOp{op.paged + before, off, n});
      ++count_;
    });
  }
  template <typename Done>
  void finish(Done&& done) {
    close_until(p_.num_pieces(), done);
  }

 private:
  template <typename Done>
  void close_until(size_t k, Done&& done) {
    for (; open_ < k; ++open_) {
      p_.op_begin.push_back(count_);
      done(open_);
    }
  }
  StagedPlan& p_;
  size_t extent_ = 0, cut_ = 0, open_ = 0;
  int64_t count_ = 0;
};

// The whole plan from copy ops in any order; `ops` is sorted by buffer offset in place.
inline void plan(std::vector<FlatOp>& ops, int64_t first_piece_bytes, int64_t max_piece_bytes, int64_t merge_gap_bytes,
                 bool to_buffer, StagedPlan& out) {
  check_sizes(first_piece_bytes, max_piece_bytes, merge_gap_bytes);
  auto by_flat = [](const FlatOp& a, const FlatOp& b) { return a.flat < b.flat; };
  if (!std::is_sorted(ops.begin(), ops.end(), by_flat)) std::stable_sort(ops.begin(), ops.end(), by_flat);
  out.extents.clear();
  for (const FlatOp& op : ops) extend(out.extents, op.flat, op.bytes, to_buffer ? 0 : merge_gap_bytes);
  lay_out(out, first_piece_bytes, max_piece_bytes, to_buffer);
  place(out, out.ops, out.op_begin, [&](auto&& emit) {
    size_t e = 0, piece = 0;  // the extent holding the op's first byte (ops and extents both in buffer order)
    for (const FlatOp& op : ops) {
      while (op.flat >= out.extents[e].flat + out.extents[e].bytes) ++e;
      const Extent& x = out.extents[e];
      split(out, x.stage + (op.flat - x.flat), op.bytes, piece, [&](size_t k, int64_t off, int64_t done, int64_t n) {
        emit(k, StagedOp{op.paged + done, off, n});
      });
    }
  });
}

// The whole plan of validated descriptor tables from their runs of rows (copy_plan.h's
// plan_runs, split at max_op_bytes for the kernel's load balance); `ops` is scratch.
inline void plan_whole(const PlaneDesc* planes, const SegmentDesc* segments, int64_t num_segments, const int64_t* slots,
                       const copy_plan::Plan& runs, int64_t max_op_bytes, int64_t first_piece_bytes,
                       int64_t max_piece_bytes, int64_t merge_gap_bytes, bool to_buffer, std::vector<FlatOp>& ops,
                       StagedPlan& out) {
  ops.clear();
  ops.reserve(static_cast<size_t>(runs.num_ops));
  copy_plan::for_each_op(planes, segments, num_segments, slots, runs, max_op_bytes,
                         [&](int64_t paged, int64_t flat, int64_t bytes) { ops.push_back({paged, flat, bytes}); });
  plan(ops, first_piece_bytes, max_piece_bytes, merge_gap_bytes, to_buffer, out);
}

// The plan's ops, piece by piece: sink(op) receives them in piece order and done(k) is called
// once piece k is complete (op_begin[k + 1] set). streamed: after lay_out_segments, the ops
// are cut as copy_plan.h produces them; else from plan_whole's ops.
template <typename Sink, typename Done>
void emit_ops(bool streamed, const PlaneDesc* planes, const SegmentDesc* segments, int64_t num_segments,
              const int64_t* slots, const copy_plan::Plan& runs, int64_t max_op_bytes, StagedPlan& p, Sink&& sink,
              Done&& done) {
  if (streamed) {
    OpStream stream(p);
    copy_plan::for_each_op(planes, segments, num_segments, slots, runs, max_op_bytes,
                           [&](int64_t paged, int64_t flat, int64_t bytes) { stream.add({paged, flat, bytes}, sink, done); });
    stream.finish(done);
    return;
  }
  for (size_t k = 0; k < p.num_pieces(); ++k) {
    for (int64_t i = p.op_begin[k]; i < p.op_begin[k + 1]; ++i) sink(p.ops[i]);
    done(k);
  }
}

}  // namespace staged_plan
}  // namespace kvconnect
