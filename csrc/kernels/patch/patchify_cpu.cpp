// CPU backend of patchify / unpatchify: the gather and scatter as copies of contiguous runs.
//
// The patch matrix's index order makes the innermost run a patch's row (kw values of channels-first
// x) or kw * C values (channels-last). ATen's copy walks such views element by element through up
// to ten strided dims (2 ms for P4's 786K values at kw = 2); copying each run as a block, outer
// dims by an odometer, moves the same values at memory speed.
#include "kernels/patch/patchify.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdlib>
#include <cstdint>
#include <cstring>
#include <numeric>

namespace patchgemm {
namespace cpu {
namespace {

struct Dim {
  int64_t size, dst_stride, src_stride;  // in elements
};

// Copies `count` runs of `bytes` each, run i at dst + i * dst_step and src + i * src_step (bytes). A
// fixed size lets the compiler move short runs by one load and one store.
template <int64_t kBytes>
void copy_fixed(char* dst, const char* src, int64_t count, int64_t dst_step, int64_t src_step) {
  for (int64_t i = 0; i < count; ++i) std::memcpy(dst + i * dst_step, src + i * src_step, kBytes);
}

void copy_row_of_runs(char* dst, const char* src, int64_t count, int64_t dst_step, int64_t src_step,
                      int64_t bytes) {
  switch (bytes) {
    case 2: return copy_fixed<2>(dst, src, count, dst_step, src_step);
    case 4: return copy_fixed<4>(dst, src, count, dst_step, src_step);
    case 8: return copy_fixed<8>(dst, src, count, dst_step, src_step);
    case 16: return copy_fixed<16>(dst, src, count, dst_step, src_step);
    case 32: return copy_fixed<32>(dst, src, count, dst_step, src_step);
    default:
      for (int64_t i = 0; i < count; ++i) std::memcpy(dst + i * dst_step, src + i * src_step, bytes);
  }
}

// How many runs of `row` to copy before the odometer's next steps fill their neighbouring bytes (its
// whole length unless caches would evict them first). Runs a multiple of 64 B apart share cache
// sets: a step of s lines uses sets / gcd(s, sets) of a cache's sets. Written runs 2 KB or more
// apart fall in a few of an L1's 64 sets (its 4 KB way; 8 ways each taken); read runs, in an L2's
// (1024 sets of 16 ways, half taken), beyond which the next step re-reads them from memory.
int64_t runs_the_caches_hold(const Dim& row, int64_t elt) {
  auto lines_held = [](int64_t step, int64_t sets, int64_t ways) -> int64_t {
    if (step % 64 != 0) return INT64_MAX;
    return sets / std::gcd(step / 64, sets) * ways;
  };
  const int64_t written = std::abs(row.dst_stride) * elt, read = std::abs(row.src_stride) * elt;
  const int64_t held = std::min(written >= 2048 ? lines_held(written, 64, 8) : INT64_MAX,
                                read >= 2048 ? lines_held(read, 1024, 8) : INT64_MAX);
  return row.size <= held ? row.size : std::max<int64_t>(8, held);
}

}  // namespace

bool copy_runs(const at::Tensor& dst, const at::Tensor& src) {
  if (!dst.device().is_cpu() || !src.device().is_cpu() || dst.scalar_type() != src.scalar_type() ||
      dst.sizes() != src.sizes() || dst.dim() == 0 || dst.numel() == 0) {
    return false;
  }
  // The dims that move, innermost last, with adjacent dims merged where both views let them.
  std::vector<Dim> dims;
  for (int64_t d = 0; d < dst.dim(); ++d) {
    if (dst.size(d) == 1) continue;
    const Dim next{dst.size(d), dst.stride(d), src.stride(d)};
    if (!dims.empty() && dims.back().dst_stride == next.size * next.dst_stride &&
        dims.back().src_stride == next.size * next.src_stride) {
      dims.back() = {dims.back().size * next.size, next.dst_stride, next.src_stride};
    } else {
      dims.push_back(next);
    }
  }
  if (dims.empty()) dims.push_back({1, 1, 1});
  const Dim run = dims.back();
  if (run.dst_stride != 1 || run.src_stride != 1) return false;  // no contiguous run: ATen's copy
  dims.pop_back();
  const int64_t elt = dst.element_size(), run_bytes = run.size * elt;
  // One outer dim is a loop of runs, the others an odometer over its rows. The loop takes the dim
  // that moves least in both views among those of 8 or more (else the longest): a gather's loop
  // then reads along x's rows, not across its channels (a page apart each), and consecutive
  // odometer steps fill neighbouring bytes of the other view.
  Dim row{1, 0, 0};
  if (!dims.empty()) {
    auto reach = [](const Dim& d) { return std::max(std::abs(d.dst_stride), std::abs(d.src_stride)); };
    auto chosen = dims.end() - 1;
    for (auto d = dims.begin(); d != dims.end(); ++d) {
      const bool long_enough = d->size >= 8, chosen_long_enough = chosen->size >= 8;
      if (long_enough != chosen_long_enough ? long_enough
                                            : (long_enough ? reach(*d) < reach(*chosen) : d->size > chosen->size)) {
        chosen = d;
      }
    }
    row = *chosen;
    dims.erase(chosen);
  }
  // A row longer than the caches hold (runs_the_caches_hold) evicts the lines the next odometer step
  // would fill: it is cut into chunks they hold, the chunk index the outermost dim, so the odometer
  // completes a chunk's lines before it moves on (the last chunk may be shorter).
  const int64_t row_length = row.size;
  const int64_t chunk = runs_the_caches_hold(row, elt), chunks = (row_length + chunk - 1) / chunk;
  if (chunks > 1) {
    dims.insert(dims.begin(), Dim{chunks, chunk * row.dst_stride, chunk * row.src_stride});
    row.size = chunk;
  }
  int64_t rows = 1;
  for (const Dim& d : dims) rows *= d.size;
  char* const dst_base = static_cast<char*>(dst.data_ptr());
  const char* const src_base = static_cast<const char*>(src.const_data_ptr());
  // Threads take whole rows; a grain of about 64 KB keeps small copies on one thread.
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(1, row.size * run_bytes));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    std::vector<int64_t> index(dims.size());
    int64_t dst_off = 0, src_off = 0;
    for (int64_t d = static_cast<int64_t>(dims.size()) - 1, rest = begin; d >= 0; --d) {
      index[d] = rest % dims[d].size;
      rest /= dims[d].size;
      dst_off += index[d] * dims[d].dst_stride;
      src_off += index[d] * dims[d].src_stride;
    }
    for (int64_t r = begin; r < end; ++r) {
      const int64_t count = chunks > 1 && index[0] == chunks - 1 ? row_length - (chunks - 1) * chunk : row.size;
      copy_row_of_runs(dst_base + dst_off * elt, src_base + src_off * elt, count, row.dst_stride * elt,
                       row.src_stride * elt, run_bytes);
      for (int64_t d = static_cast<int64_t>(dims.size()) - 1; d >= 0; --d) {  // the odometer
        dst_off += dims[d].dst_stride;
        src_off += dims[d].src_stride;
        if (++index[d] < dims[d].size) break;
        dst_off -= dims[d].size * dims[d].dst_stride;
        src_off -= dims[d].size * dims[d].src_stride;
        index[d] = 0;
      }
    }
  });
  return true;
}

}  // namespace cpu
}  // namespace patchgemm
