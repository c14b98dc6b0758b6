// CPU gather/scatter between paged KV planes and chunk buffers (see transfer_desc.h).
// Built as kvconnect._cpu_kernels with pybind11; no libtorch. Multi-threaded with
// OpenMP over pieces of segments; rows whose source addresses are adjacent are merged
// into one memcpy. The GIL is released while bytes move.
// Also exposes the host planner of the CUDA staged route (staged_plan.h), which needs no
// CUDA, so that it is tested on every machine.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstring>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "staged_plan.h"
#include "transfer_desc.h"

namespace py = pybind11;
using kvconnect::PlaneDesc;
using kvconnect::SegmentDesc;

namespace {

using Int64Array = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;

struct Piece {
  int64_t segment;
  int64_t row_begin;
  int64_t row_end;
};

constexpr int64_t kPieceBytes = 256 * 1024;  // large enough to amortise, small enough to balance

std::vector<Piece> split(const PlaneDesc* planes, const SegmentDesc* segments, int64_t num_segments) {
  std::vector<Piece> pieces;
  pieces.reserve(num_segments);
  for (int64_t s = 0; s < num_segments; ++s) {
    const int64_t row_bytes = planes[segments[s].plane].row_bytes;
    const int64_t rows_per_piece = std::max<int64_t>(1, kPieceBytes / std::max<int64_t>(row_bytes, 1));
    for (int64_t r = 0; r < segments[s].num_rows; r += rows_per_piece)
      pieces.push_back({s, r, std::min(segments[s].num_rows, r + rows_per_piece)});
  }
  return pieces;
}

template <bool kToBuffer>
void run_piece(const Piece& piece, const PlaneDesc* planes, const SegmentDesc* segments,
               const int64_t* slots, char* buffer) {
  const SegmentDesc& seg = segments[piece.segment];
  const PlaneDesc& p = planes[seg.plane];
  const int64_t* seg_slots = slots + seg.slot_offset;
  int64_t i = piece.row_begin;
  while (i < piece.row_end) {
    const int64_t first = kvconnect::row_addr(p, seg_slots[i]);
    int64_t n = 1;
    while (i + n < piece.row_end && kvconnect::row_addr(p, seg_slots[i + n]) == first + n * p.row_bytes) ++n;
    char* paged = reinterpret_cast<char*>(first);
    char* flat = buffer + seg.buffer_offset + i * p.row_bytes;
    if (kToBuffer)
      std::memcpy(flat, paged, n * p.row_bytes);
    else
      std::memcpy(paged, flat, n * p.row_bytes);
    i += n;
  }
}

void check_shapes(const Int64Array& planes_arr, const Int64Array& segments_arr, const Int64Array& slots_arr) {
  if (planes_arr.ndim() != 2 || planes_arr.shape(1) != kvconnect::kPlaneCols)
    throw std::invalid_argument("planes must be an int64 array of shape [P, 6]");
  if (segments_arr.ndim() != 2 || segments_arr.shape(1) != kvconnect::kSegmentCols)
    throw std::invalid_argument("segments must be an int64 array of shape [S, 4]");
  if (slots_arr.ndim() != 1) throw std::invalid_argument("slots must be a 1-D int64 array");
}

template <bool kToBuffer>
void transfer(const Int64Array& planes_arr, const Int64Array& segments_arr, const Int64Array& slots_arr,
              int64_t buffer_addr, int64_t buffer_bytes, int num_threads) {
  check_shapes(planes_arr, segments_arr, slots_arr);
  const auto* planes = reinterpret_cast<const PlaneDesc*>(planes_arr.data());
  const auto* segments = reinterpret_cast<const SegmentDesc*>(segments_arr.data());
  const int64_t* slots = slots_arr.data();
  const int64_t num_planes = planes_arr.shape(0);
  const int64_t num_segments = segments_arr.shape(0);
  char* buffer = reinterpret_cast<char*>(buffer_addr);

  py::gil_scoped_release release;
  kvconnect::validate_tables(planes, num_planes, segments, num_segments, slots, slots_arr.shape(0), buffer_bytes);
  const std::vector<Piece> pieces = split(planes, segments, num_segments);
  const int64_t num_pieces = static_cast<int64_t>(pieces.size());
#pragma omp parallel for schedule(dynamic, 4) num_threads(std::max(1, num_threads)) if (num_pieces > 8)
  for (int64_t k = 0; k < num_pieces; ++k) run_piece<kToBuffer>(pieces[k], planes, segments, slots, buffer);
}

// The staged route's plan of these tables, as the CUDA executor receives it: ops in piece
// order (paged addresses are raw pointers), and for each piece how many ops had been emitted
// when it was reported complete. allow_streaming=False forces the whole plan.
py::dict staged_plan(const Int64Array& planes_arr, const Int64Array& segments_arr, const Int64Array& slots_arr,
                     int64_t buffer_bytes, bool to_buffer, int64_t max_op_bytes, int64_t first_piece_bytes,
                     int64_t max_piece_bytes, int64_t merge_gap_bytes, bool allow_streaming) {
  namespace sp_ns = kvconnect::staged_plan;
  check_shapes(planes_arr, segments_arr, slots_arr);
  if (max_op_bytes < 16) throw std::invalid_argument("max_op_bytes must be >= 16");
  const auto* planes = reinterpret_cast<const PlaneDesc*>(planes_arr.data());
  const auto* segments = reinterpret_cast<const SegmentDesc*>(segments_arr.data());
  const int64_t num_segments = segments_arr.shape(0);
  const int64_t* slots = slots_arr.data();
  sp_ns::StagedPlan sp;
  std::vector<sp_ns::FlatOp> scratch;
  std::vector<sp_ns::StagedOp> emitted;
  std::vector<int64_t> emitted_at_done;
  bool streamed = false;
  {
    py::gil_scoped_release release;
    kvconnect::copy_plan::validate(planes, planes_arr.shape(0), segments, num_segments, slots, slots_arr.shape(0),
                                   buffer_bytes);
    sp_ns::check_sizes(first_piece_bytes, max_piece_bytes, merge_gap_bytes);
    const auto runs = kvconnect::copy_plan::plan_runs(planes, segments, num_segments, slots, true, max_op_bytes);
    streamed = allow_streaming && sp_ns::lay_out_segments(planes, segments, num_segments, first_piece_bytes,
                                                          max_piece_bytes, merge_gap_bytes, to_buffer, sp);
    if (!streamed)
      sp_ns::plan_whole(planes, segments, num_segments, slots, runs, max_op_bytes, first_piece_bytes, max_piece_bytes,
                        merge_gap_bytes, to_buffer, scratch, sp);
    sp_ns::emit_ops(
        streamed, planes, segments, num_segments, slots, runs, max_op_bytes, sp,
        [&](const sp_ns::StagedOp& op) { emitted.push_back(op); },
        [&](size_t) { emitted_at_done.push_back(static_cast<int64_t>(emitted.size())); });
  }
  auto triples = [](const auto& rows) {
    Int64Array a({static_cast<py::ssize_t>(rows.size()), py::ssize_t{3}});
    static_assert(sizeof(rows[0]) == 3 * sizeof(int64_t), "three int64 columns");
    if (!rows.empty()) std::memcpy(a.mutable_data(), rows.data(), rows.size() * 3 * sizeof(int64_t));
    return a;
  };
  auto vector = [](const std::vector<int64_t>& v) {
    Int64Array a(static_cast<py::ssize_t>(v.size()));
    if (!v.empty()) std::memcpy(a.mutable_data(), v.data(), v.size() * sizeof(int64_t));
    return a;
  };
  py::dict out;
  out["piece_bytes"] = vector(sp.piece_bytes);
  out["ops"] = triples(emitted);  // paged, staging offset, bytes
  out["op_begin"] = vector(sp.op_begin);
  out["ops_at_done"] = vector(emitted_at_done);
  out["copies"] = triples(sp.copies);  // staging offset, buffer offset, bytes
  out["copy_begin"] = vector(sp.copy_begin);
  out["streamed"] = streamed;
  return out;
}

int max_threads() {
#ifdef _OPENMP
  return omp_get_max_threads();
#else
  return 1;
#endif
}

}  // namespace

PYBIND11_MODULE(_cpu_kernels, m) {
  m.doc() = "kvconnect CPU transfer kernels (raw pointers + int64 descriptor tables; see csrc/transfer_desc.h)";
  m.def("gather", &transfer<true>, "paged planes -> buffer", py::arg("planes"), py::arg("segments"),
        py::arg("slots"), py::arg("buffer_addr"), py::arg("buffer_bytes"), py::arg("num_threads"));
  m.def("scatter", &transfer<false>, "buffer -> paged planes", py::arg("planes"), py::arg("segments"),
        py::arg("slots"), py::arg("buffer_addr"), py::arg("buffer_bytes"), py::arg("num_threads"));
  m.def("max_threads", &max_threads);
  m.def("staged_plan", &staged_plan, "the CUDA staged route's plan of these tables (csrc/staged_plan.h)",
        py::arg("planes"), py::arg("segments"), py::arg("slots"), py::arg("buffer_bytes"), py::arg("to_buffer"),
        py::arg("max_op_bytes"), py::arg("first_piece_bytes"), py::arg("max_piece_bytes"), py::arg("merge_gap_bytes"),
        py::arg("allow_streaming") = true);
}
