// The problems the microbenchmark times, each against the PyTorch ways of doing the same work:
//   gemm           grouped linear [B, G, Din] x [G, Dout, Din] -> [B, G, Dout]: patchgemm's one
//                  strided-batched call vs a loop of per-group GEMMs vs bmm on contiguous copies
//   gather         patchify (volume -> patch matrix) vs permute().contiguous()
//   scatter        unpatchify (patch matrix -> volume) vs permute().contiguous()
//   patch_embed    the op (gather + one GEMM, bias inside) vs torch conv (cuDNN on a GPU) vs the
//                  linear rewrite
//   patch_weight_grad  its dW and db (fused for tiny patches) vs torch's conv backward vs the
//                  linear rewrite's GEMM on a permuted copy
//   patch_unembed  its transpose vs torch conv_transpose vs the linear rewrite
#include <ATen/core/dispatch/Dispatcher.h>

#include <cmath>
#include <memory>
#include <sstream>

#include "harness.h"
#include "kernels/patch/patchify.h"

namespace microbench {
namespace {

using patchgemm::Dims3;
using patchgemm::PatchGeometry;

// Any one tensor's element count above this is refused up front (no GPU holds it).
constexpr double kMaxElements = double(int64_t{1} << 38);

std::vector<int64_t> parse_dims(const std::string& text, const std::string& spec, const char* what) {
  std::vector<int64_t> dims;
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, 'x')) {
    size_t used = 0;
    long long v = 0;
    try {
      v = std::stoll(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used == 0 || used != item.size() || v <= 0) {
      throw UsageError("bad size '" + spec + "': " + what + " must be positive integers joined by 'x', got '" +
                       text + "'");
    }
    dims.push_back(v);
  }
  if (dims.empty()) throw UsageError("bad size '" + spec + "': " + what + " is empty");
  return dims;
}

double product(const std::vector<int64_t>& v) {
  double p = 1;
  for (int64_t x : v) p *= double(x);
  return p;
}

void check_elements(const std::string& spec, const char* name, double elements) {
  if (elements > kMaxElements) {
    std::ostringstream msg;
    msg << "impossible size '" << spec << "': " << name << " would hold " << elements
        << " elements (limit 2^38)";
    throw UsageError(msg.str());
  }
}

// Allocates enough input sets to defeat the cache and hands them to every runner.
template <class Set>
std::shared_ptr<std::vector<Set>> input_sets(const std::function<Set()>& make, double bytes,
                                             at::Device device) {
  auto sets = std::make_shared<std::vector<Set>>();
  for (int64_t i = rotation_count(bytes, device); i > 0; --i) sets->push_back(make());
  return sets;
}

template <class Set>
const Set& pick(const std::shared_ptr<std::vector<Set>>& sets, int64_t i) {
  return (*sets)[static_cast<size_t>(i) % sets->size()];
}

// patch_embed / patch_unembed; levels (int[]?) std::nullopt: row-major tokens.
c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&,
                                    const std::optional<at::Tensor>&, bool, at::OptionalIntArrayRef)>
patch_op(const char* name) {
  return c10::Dispatcher::singleton()
      .findSchemaOrThrow(name, "")
      .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                        bool, at::OptionalIntArrayRef)>();
}

// ---- gemm ------------------------------------------------------------------------------------

Problem gemm_problem(const std::string& spec, at::ScalarType dtype, at::Device device) {
  const std::vector<int64_t> d = parse_dims(spec, spec, "B x G x Din x Dout");
  if (d.size() != 4) throw UsageError("bad --gemm size '" + spec + "': expected BxGxDinxDout (4 sizes)");
  const int64_t B = d[0], G = d[1], Din = d[2], Dout = d[3];
  check_elements(spec, "x", double(B) * G * Din);
  check_elements(spec, "y", double(B) * G * Dout);
  check_elements(spec, "weight", double(G) * Dout * Din);
  const double elt = c10::elementSize(dtype);

  Problem p{"gemm", dtype_name(dtype), spec, {"strided_batched", "loop", "bmm_copies"}};
  p.bytes = elt * (double(B) * G * (Din + Dout) + double(G) * Dout * Din);
  p.flops = 2.0 * B * G * Din * Dout;
  p.setup = [=, bytes = p.bytes]() -> std::vector<Runner> {
    struct Set { at::Tensor x, w, y; };
    const auto opts = at::TensorOptions().device(device).dtype(dtype);
    const auto sets = input_sets<Set>(
        [&] {
          return Set{at::randn({B, G, Din}, opts), at::randn({G, Dout, Din}, opts),
                     at::empty({B, G, Dout}, opts)};
        },
        bytes, device);
    const auto op = c10::Dispatcher::singleton()
                        .findSchemaOrThrow("patchgemm::grouped_linear", "")
                        .typed<at::Tensor(const at::Tensor&, const at::Tensor&,
                                          const std::optional<at::Tensor>&, bool)>();
    return {
        [=](int64_t i) { op.call(pick(sets, i).x, pick(sets, i).w, std::nullopt, false); },
        [=](int64_t i) {  // one GEMM per group, each writing its slice of y in place
          const Set& s = pick(sets, i);
          for (int64_t g = 0; g < G; ++g) {
            at::Tensor out = s.y.select(1, g);
            at::mm_out(out, s.x.select(1, g), s.w[g].t());
          }
        },
        [=](int64_t i) {  // [G, B, Din] copy, bmm, and a copy back to [B, G, Dout]
          const Set& s = pick(sets, i);
          at::bmm(s.x.transpose(0, 1).contiguous(), s.w.transpose(1, 2)).transpose(0, 1).contiguous();
        },
    };
  };
  return p;
}

// ---- patch problems ------------------------------------------------------------------------------

// "BxCx<spatial>/k/E": a volume [B, C, *spatial] cut into patches k (one size for every dim, or
// one per dim) and E features per token.
struct PatchSpec {
  std::string text;
  int64_t batch = 0, channels = 0, embed = 0;
  std::vector<int64_t> spatial, kernel;
  PatchGeometry g;  // the same problem as a 3-D one

  std::vector<int64_t> volume() const {
    std::vector<int64_t> v{batch, channels};
    v.insert(v.end(), spatial.begin(), spatial.end());
    return v;
  }
  std::vector<int64_t> grid_volume(int64_t features) const {  // [B, features, *grid]
    std::vector<int64_t> v{batch, features};
    for (size_t i = 0; i < spatial.size(); ++i) v.push_back(spatial[i] / kernel[i]);
    return v;
  }
  std::vector<int64_t> weight(int64_t rows, int64_t cols) const {  // [rows, cols, *kernel]
    std::vector<int64_t> v{rows, cols};
    v.insert(v.end(), kernel.begin(), kernel.end());
    return v;
  }
  std::vector<int64_t> split5() const {  // [B, C, nd, kd, nh, kh, nw, kw]
    return {batch, channels, g.grid[0], g.kernel[0], g.grid[1], g.kernel[1], g.grid[2], g.kernel[2]};
  }
  std::vector<int64_t> volume5() const {
    return {batch, channels, g.size[0], g.size[1], g.size[2]};
  }
};

PatchSpec parse_patch(const std::string& spec) {
  const size_t a = spec.find('/'), b = spec.find('/', a == std::string::npos ? a : a + 1);
  if (a == std::string::npos || b == std::string::npos) {
    throw UsageError("bad --patch size '" + spec + "': expected BxCx[Dx][Hx]W/k/E, e.g. 8x4x128x128x128/2/192");
  }
  PatchSpec s;
  s.text = spec;
  const std::vector<int64_t> vol = parse_dims(spec.substr(0, a), spec, "the volume");
  if (vol.size() < 3 || vol.size() > 5) {
    throw UsageError("bad --patch size '" + spec + "': the volume must be B x C and 1 to 3 spatial sizes");
  }
  s.batch = vol[0];
  s.channels = vol[1];
  s.spatial.assign(vol.begin() + 2, vol.end());
  s.kernel = parse_dims(spec.substr(a + 1, b - a - 1), spec, "the patch size");
  if (s.kernel.size() == 1) s.kernel.resize(s.spatial.size(), s.kernel[0]);
  if (s.kernel.size() != s.spatial.size()) {
    throw UsageError("bad --patch size '" + spec + "': the patch size needs 1 or " +
                     std::to_string(s.spatial.size()) + " values");
  }
  const std::vector<int64_t> e = parse_dims(spec.substr(b + 1), spec, "E");
  if (e.size() != 1) throw UsageError("bad --patch size '" + spec + "': E is one number");
  s.embed = e[0];

  const size_t pad = 3 - s.spatial.size();
  s.g.batch = s.batch;
  s.g.channels = s.channels;
  for (size_t i = 0; i < s.spatial.size(); ++i) {
    if (s.spatial[i] % s.kernel[i] != 0) {
      throw UsageError("impossible size '" + spec + "': spatial size " + std::to_string(s.spatial[i]) +
                       " is not divisible by the patch size " + std::to_string(s.kernel[i]));
    }
    s.g.size[pad + i] = s.spatial[i];
    s.g.kernel[pad + i] = s.kernel[i];
    s.g.grid[pad + i] = s.spatial[i] / s.kernel[i];
  }
  s.g.levels = {s.g.grid};
  check_elements(spec, "the volume", product(s.volume()));
  check_elements(spec, "the tokens", product(s.grid_volume(s.embed)));
  check_elements(spec, "the weight", product(s.weight(s.embed, s.channels)));
  return s;
}

at::Tensor patches_by_permute(const at::Tensor& x5, const PatchSpec& s) {
  return x5.view(s.split5()).permute({0, 2, 4, 6, 1, 3, 5, 7}).reshape({s.batch, s.g.tokens(), s.g.patch_size()});
}

at::Tensor volume_by_permute(const at::Tensor& q, const PatchSpec& s) {
  const Dims3& n = s.g.grid;
  const Dims3& k = s.g.kernel;
  return q.view({s.batch, n[0], n[1], n[2], s.channels, k[0], k[1], k[2]})
      .permute({0, 4, 1, 5, 2, 6, 3, 7})
      .reshape(s.volume5());
}

at::Tensor conv(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b, const PatchSpec& s,
                bool transposed) {
  const std::vector<int64_t> zeros(s.kernel.size(), 0), ones(s.kernel.size(), 1);
  return at::convolution(x, w, b, s.kernel, zeros, ones, transposed, zeros, 1);
}

std::vector<Problem> patch_problems(const PatchSpec& s, at::ScalarType dtype, at::Device device) {
  const double elt = c10::elementSize(dtype);
  const double volume = product(s.volume()), tokens = product(s.grid_volume(s.embed));
  const double weight = product(s.weight(s.embed, s.channels));
  const double flops = 2.0 * s.batch * s.g.tokens() * s.g.patch_size() * s.embed;
  const auto opts = at::TensorOptions().device(device).dtype(dtype);
  const std::string dt = dtype_name(dtype);
  std::vector<Problem> problems;

  Problem gather{"gather", dt, s.text, {"patchgemm", "permute_contiguous"}, 2 * elt * volume, 0};
  gather.setup = [=, bytes = gather.bytes]() -> std::vector<Runner> {
    const auto sets = input_sets<at::Tensor>([&] { return at::randn(s.volume5(), opts); }, bytes, device);
    return {[=](int64_t i) { patchgemm::patchify(pick(sets, i), s.g, /*ones_column=*/false); },
            [=](int64_t i) { patches_by_permute(pick(sets, i), s); }};
  };
  problems.push_back(gather);

  Problem scatter{"scatter", dt, s.text, {"patchgemm", "permute_contiguous"}, 2 * elt * volume, 0};
  scatter.setup = [=, bytes = scatter.bytes]() -> std::vector<Runner> {
    struct Set { at::Tensor q, y; };
    const auto sets = input_sets<Set>(
        [&] {
          return Set{at::randn({s.batch, s.g.tokens(), s.g.patch_size()}, opts), at::empty(s.volume5(), opts)};
        },
        bytes, device);
    return {[=](int64_t i) { patchgemm::unpatchify(pick(sets, i).q, s.g, std::nullopt, pick(sets, i).y); },
            [=](int64_t i) { volume_by_permute(pick(sets, i).q, s); }};
  };
  problems.push_back(scatter);

  struct Layer { at::Tensor x, w, b; };
  Problem embed{"patch_embed", dt, s.text, {"patchgemm", "torch_conv", "linear_rewrite"},
                elt * (volume + weight + s.embed + tokens), flops};
  embed.setup = [=, bytes = embed.bytes]() -> std::vector<Runner> {
    const auto sets = input_sets<Layer>(
        [&] {
          return Layer{at::randn(s.volume(), opts), at::randn(s.weight(s.embed, s.channels), opts),
                       at::randn({s.embed}, opts)};
        },
        bytes, device);
    const auto op = patch_op("patchgemm::patch_embed");
    return {
        [=](int64_t i) { const Layer& l = pick(sets, i); op.call(l.x, l.w, l.b, false, std::nullopt); },
        [=](int64_t i) { const Layer& l = pick(sets, i); conv(l.x, l.w, l.b, s, false); },
        [=](int64_t i) {  // patches copied out, F.linear, a permuted view back to channels-first
          const Layer& l = pick(sets, i);
          const Dims3& n = s.g.grid;
          at::linear(patches_by_permute(l.x.view(s.volume5()), s), l.w.reshape({s.embed, -1}), l.b)
              .view({s.batch, n[0], n[1], n[2], s.embed})
              .permute({0, 4, 1, 2, 3});
        },
    };
  };
  problems.push_back(embed);

  // The weight and bias gradients of patch_embed from grad_y [B, E, *grid] and x.
  Problem wgrad{"patch_weight_grad", dt, s.text, {"patchgemm", "torch_conv_backward", "linear_rewrite"},
                elt * (tokens + volume + weight + s.embed), flops};
  wgrad.setup = [=, bytes = wgrad.bytes]() -> std::vector<Runner> {
    const auto sets = input_sets<Layer>(
        [&] {
          return Layer{at::randn(s.grid_volume(s.embed), opts), at::randn(s.volume(), opts),
                       at::randn(s.weight(s.embed, s.channels), opts)};
        },
        bytes, device);
    const auto op =
        c10::Dispatcher::singleton()
            .findSchemaOrThrow("patchgemm::patch_weight_grad", "")
            .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, c10::IntArrayRef, bool,
                                                      at::OptionalIntArrayRef, bool, bool)>();
    const std::vector<int64_t> zeros(s.kernel.size(), 0), ones(s.kernel.size(), 1);
    return {
        [=](int64_t i) {
          const Layer& l = pick(sets, i);
          op.call(l.x, l.w, s.kernel, false, std::nullopt, true, false);
        },
        [=](int64_t i) {  // l.x = grad_y, l.w = x, l.b = the weight (for its shape)
          const Layer& l = pick(sets, i);
          at::convolution_backward(l.x, l.w, l.b, std::vector<int64_t>{s.embed}, s.kernel, zeros, ones, false,
                                   zeros, 1, {false, true, true});
        },
        [=](int64_t i) {  // grad_y to tokens, patches copied out, one GEMM, and the bias sum
          const Layer& l = pick(sets, i);
          const at::Tensor dy = l.x.flatten(2).transpose(1, 2).reshape({-1, s.embed});
          at::mm(dy.t(), patches_by_permute(l.w.view(s.volume5()), s).reshape({-1, s.g.patch_size()}));
          dy.sum(0);
        },
    };
  };
  problems.push_back(wgrad);

  // The transpose: [B, E, *grid] -> the volume, weight [E, C, *k] (the ConvTranspose layout).
  Problem unembed{"patch_unembed", dt, s.text, {"patchgemm", "torch_conv_transpose", "linear_rewrite"},
                  elt * (tokens + weight + s.channels + volume), flops};
  unembed.setup = [=, bytes = unembed.bytes]() -> std::vector<Runner> {
    const auto sets = input_sets<Layer>(
        [&] {
          return Layer{at::randn(s.grid_volume(s.embed), opts), at::randn(s.weight(s.embed, s.channels), opts),
                       at::randn({s.channels}, opts)};
        },
        bytes, device);
    const auto op = patch_op("patchgemm::patch_unembed");
    return {
        [=](int64_t i) { const Layer& l = pick(sets, i); op.call(l.x, l.w, l.b, false, std::nullopt); },
        [=](int64_t i) { const Layer& l = pick(sets, i); conv(l.x, l.w, l.b, s, true); },
        [=](int64_t i) {  // tokens @ W, the patches permuted out, then the bias
          const Layer& l = pick(sets, i);
          const at::Tensor q = at::matmul(l.x.flatten(2).transpose(1, 2), l.w.reshape({s.embed, -1}));
          volume_by_permute(q, s).add_(l.b.view({1, s.channels, 1, 1, 1}));
        },
    };
  };
  problems.push_back(unembed);
  return problems;
}

}  // namespace

std::vector<Problem> make_problems(const Options& opts) {
  std::vector<Problem> problems;
  for (at::ScalarType dtype : opts.dtypes) {
    for (const std::string& spec : opts.gemm_sizes) problems.push_back(gemm_problem(spec, dtype, opts.device));
  }
  for (const std::string& spec : opts.patch_sizes) {
    const PatchSpec s = parse_patch(spec);
    for (at::ScalarType dtype : opts.dtypes) {
      for (Problem& p : patch_problems(s, dtype, opts.device)) problems.push_back(std::move(p));
    }
  }
  return problems;
}

}  // namespace microbench
