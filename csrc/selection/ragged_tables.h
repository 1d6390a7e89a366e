// The ragged grouped linear selection table's entry points (ragged_tables.cpp):
// the implementation each call runs.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <string>
#include <vector>

#include "problems/ragged.h"

namespace patchgemm {

at::Tensor select_ragged_gemm(const RaggedProblem& p);

// The groups' row bounds [0, offsets[0], ..., offsets[G-1]], read on the host (a sync for GPU
// offsets) and checked: non-decreasing from 0, ending at `rows`. The op checks CPU offsets with it,
// the candidates that need the sizes on the host read GPU offsets with it (ragged_tables.cpp).
std::vector<int64_t> ragged_bounds(const char* op, const at::Tensor& offsets, int64_t rows);

// Each group's sizes on `device` ([G], int64), from offsets anywhere, without a host sync.
at::Tensor ragged_sizes(const at::Tensor& offsets, at::Device device);

// Where the sizes are, against what the moment allows ("" where the candidate may run), for every
// table over ragged groups (this one, scaled_ragged_mm's):
// a candidate that reads GPU sizes on the host declines where a sync is forbidden (CUDA-graph
// capture, or sync debug mode "error");
std::string ragged_host_sizes_allowed(const at::Tensor& offsets);
// one that reads them on a's device declines for host sizes while a graph is captured (their copy);
std::string ragged_offsets_reach_device(const at::Tensor& offsets, const at::Tensor& a);
// and the sync-free ones slower than the host readers are ruled in only where a sync is forbidden.
std::string ragged_only_where_sync_forbidden(const at::Tensor& offsets);

}  // namespace patchgemm
