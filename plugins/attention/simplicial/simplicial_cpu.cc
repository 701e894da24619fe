#include "plugins/attention/simplicial/simplicial_cpu.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

#include "plugins/attention/kernels/cpu_tile_ops.h"
#include "plugins/attention/kernels/parallel_tasks.h"

namespace loom::attention {
namespace {

using kernels::Gemm;
using torch::Tensor;

// Elements of one tile's score block [c·n1 × n2]: the scores and their gradient, two blocks,
// stay within a 1 MiB L2 in float32.
constexpr int64_t kTileScores = int64_t{1} << 16;
constexpr int64_t kMaxTileQueries = 64;

// One call: shapes, mask and the inputs of one element type, all contiguous.
template <typename T>
struct Problem {
  int64_t batch = 0, heads = 0, n = 0, d = 0, tile = 1;
  SimplicialMask mask;
  T scale = 1;
  const T* q = nullptr;                // [B, H, N, d]
  const T *k = nullptr, *v = nullptr;  // [B, H, N, 2d]: k | k', v | v'
  const int64_t* seg = nullptr;        // [B, N] or null

  // Keys [lo, hi) of one set that query i reaches by position (window w, causality).
  std::pair<int64_t, int64_t> Band(int64_t i, int64_t w) const {
    int64_t lo = 0, hi = n;
    if (w > 0) {
      lo = std::max<int64_t>(0, i - w + 1);
      hi = std::min(n, i + w);
    }
    if (mask.causal) hi = std::min(hi, i + 1);
    return {lo, hi};
  }
  // Keys a tile of c queries reaches in the worst case (the tile size is chosen from it).
  int64_t Width(int64_t c, int64_t w) const {
    if (w <= 0) return n;
    return std::min(n, (mask.causal ? w : 2 * w - 1) + c - 1);
  }
  bool Seen(int64_t b, int64_t i, int64_t j, std::pair<int64_t, int64_t> band) const {
    return j >= band.first && j < band.second &&
           (seg == nullptr || seg[b * n + i] == seg[b * n + j]);
  }
};

// The largest query tile whose score block fits kTileScores (at least one query).
template <typename T>
int64_t TileQueries(const Problem<T>& p) {
  int64_t c = std::min(p.n, kMaxTileQueries);
  while (c > 1 && c * p.Width(c, p.mask.window1) * p.Width(c, p.mask.window2) > kTileScores) {
    c = (c + 1) / 2;
  }
  return c;
}

// One tile of queries [i0, i0 + c), compacted to what they see. Rows: the pairs (query, key j
// of the first set) the mask allows, query by query (rows row_begin[qi] .. row_begin[qi + 1] − 1,
// key j_of[r]). Columns: the keys l of the second set that any of the tile's queries sees
// (l_of[u], ascending), with per query which of them it sees: sees[qi·U + u], and when that is
// one run of columns (causal and window masks without recurring segments), the run [run_lo[qi],
// run_hi[qi]) with in_run[qi] set, so the softmax skips the rest. Padding and other segments
// therefore cost nothing but the tile that straddles a boundary. Per-thread buffers, sized for
// the largest tile.
template <typename T>
struct Scratch {
  int64_t i0 = 0, c = 0, rows = 0, cols = 0;
  std::vector<int64_t> row_begin, j_of, l_of;
  std::vector<uint8_t> sees, in_run, marked;
  std::vector<int64_t> run_lo, run_hi;
  std::vector<T> w, m, dm, dw;  // [rows, d]: scale·(q ⊙ k_j), P·V', v_j ⊙ dO, dL/dW
  std::vector<T> s, ds;         // [rows, cols]: scores → probabilities; dP → dS
  std::vector<T> k2, v2, g2;    // [cols, d]: the gathered k', v'; a gradient before its scatter
  std::vector<T> z, delta;      // [c]: softmax sums (forward); dO·o (backward)
  explicit Scratch(const Problem<T>& p) {
    const int64_t n1 = p.Width(p.tile, p.mask.window1), n2 = p.Width(p.tile, p.mask.window2);
    const int64_t rows_max = p.tile * n1;
    row_begin.resize(p.tile + 1);
    j_of.resize(rows_max);
    l_of.resize(n2);
    sees.resize(p.tile * n2);
    in_run.resize(p.tile);
    run_lo.resize(p.tile);
    run_hi.resize(p.tile);
    marked.resize(p.n);
    for (auto* v : {&w, &m, &dm, &dw}) v->resize(rows_max * p.d);
    s.resize(rows_max * n2);
    ds.resize(rows_max * n2);
    for (auto* v : {&k2, &v2, &g2}) v->resize(n2 * p.d);
    z.resize(p.tile);
    delta.resize(p.tile);
  }
};

// The second set's keys the tile sees, gathered: l_of, sees, the runs, k2 and v2.
template <typename T>
void LoadColumns(const Problem<T>& p, int64_t b, const T* k, const T* v, Scratch<T>& ws) {
  const int64_t lo = p.Band(ws.i0, p.mask.window2).first;
  const int64_t hi = p.Band(ws.i0 + ws.c - 1, p.mask.window2).second;
  std::fill(ws.marked.begin() + lo, ws.marked.begin() + hi, uint8_t{0});
  for (int64_t qi = 0; qi < ws.c; ++qi) {
    const auto band = p.Band(ws.i0 + qi, p.mask.window2);
    for (int64_t l = band.first; l < band.second; ++l) {
      ws.marked[l] |= p.Seen(b, ws.i0 + qi, l, band);
    }
  }
  ws.cols = 0;
  for (int64_t l = lo; l < hi; ++l) {
    if (!ws.marked[l]) continue;
    const int64_t u = ws.cols++;
    ws.l_of[u] = l;
    std::copy(k + l * 2 * p.d + p.d, k + (l + 1) * 2 * p.d, ws.k2.data() + u * p.d);
    std::copy(v + l * 2 * p.d + p.d, v + (l + 1) * 2 * p.d, ws.v2.data() + u * p.d);
  }
  for (int64_t qi = 0; qi < ws.c; ++qi) {
    const auto band = p.Band(ws.i0 + qi, p.mask.window2);
    int64_t lo = ws.cols, hi = 0, count = 0;
    for (int64_t u = 0; u < ws.cols; ++u) {
      const uint8_t seen = p.Seen(b, ws.i0 + qi, ws.l_of[u], band);
      ws.sees[qi * ws.cols + u] = seen;
      if (!seen) continue;
      lo = std::min(lo, u);
      hi = u + 1;
      ++count;
    }
    ws.in_run[qi] = count == hi - lo;  // a query always sees its own token: count >= 1
    ws.run_lo[qi] = lo;
    ws.run_hi[qi] = hi;
  }
}

// The tile: its columns, then its rows with W = scale·(q_i ⊙ k_j).
template <typename T>
void LoadTile(const Problem<T>& p, int64_t b, const T* q, const T* k, const T* v, int64_t i0,
              Scratch<T>& ws) {
  ws.i0 = i0;
  ws.c = std::min(p.tile, p.n - i0);
  LoadColumns(p, b, k, v, ws);
  ws.rows = 0;
  for (int64_t qi = 0; qi < ws.c; ++qi) {
    const int64_t i = i0 + qi;
    const auto band = p.Band(i, p.mask.window1);
    const T* qrow = q + i * p.d;
    ws.row_begin[qi] = ws.rows;
    for (int64_t j = band.first; j < band.second; ++j) {
      if (!p.Seen(b, i, j, band)) continue;
      const int64_t r = ws.rows++;
      ws.j_of[r] = j;
      const T* krow = k + j * 2 * p.d;
      T* wrow = ws.w.data() + r * p.d;
      for (int64_t e = 0; e < p.d; ++e) wrow[e] = p.scale * qrow[e] * krow[e];
    }
  }
  ws.row_begin[ws.c] = ws.rows;
}

// Rows [first, last) of `cols` scores: exp(x − shift) over columns [lo, lo + n), 0 around them;
// returns the sum. With `find`, shift is first set to the rows' maximum there.
template <typename T>
T ExpRun(T* first, T* last, int64_t cols, int64_t lo, int64_t n, bool find, T* shift) {
  if (find) {
    for (T* row = first; row < last; row += cols) {
      *shift = std::max(*shift, kernels::RowMax(row + lo, n));
    }
  }
  T z = 0;
  for (T* row = first; row < last; row += cols) {
    z += kernels::ExpShiftSum(row + lo, n, *shift);
    std::fill(row, row + lo, T(0));
    std::fill(row + lo + n, row + cols, T(0));
  }
  return z;
}

// The same over the columns u with sees[u] (any pattern).
template <typename T>
T ExpMasked(T* first, T* last, int64_t cols, const uint8_t* sees, bool find, T* shift) {
  constexpr T kNegInf = -std::numeric_limits<T>::infinity();
  for (T* row = first; row < last; row += cols) {
    for (int64_t u = 0; u < cols; ++u) row[u] = sees[u] ? row[u] : kNegInf;
    if (find) *shift = std::max(*shift, kernels::RowMax(row, cols));
  }
  T z = 0;
  for (T* row = first; row < last; row += cols) {
    z += kernels::ExpShiftSum(row, cols, *shift);
    for (int64_t u = 0; u < cols; ++u) {  // the float exp is clamped, not 0, at −inf
      if (sees[u]) continue;
      z -= row[u];
      row[u] = 0;
    }
  }
  return z;
}

// Scores S = W·K'ᵀ, then per query exp(S − shift) over the pairs it sees, 0 elsewhere. The
// backward passes the forward's log-sum-exp as `given` (shift = lse_i: P itself); the forward
// passes none: shift = the query's maximum, the sum goes to ws.z[qi] and lse_i to lse_out.
template <typename T>
void Exponentials(const Problem<T>& p, Scratch<T>& ws, const T* given, T* lse_out) {
  const int64_t cols = ws.cols;
  Gemm<T>(false, true, ws.rows, cols, p.d, ws.w.data(), p.d, ws.k2.data(), p.d, 0, ws.s.data(),
          cols);
  for (int64_t qi = 0; qi < ws.c; ++qi) {
    T* first = ws.s.data() + ws.row_begin[qi] * cols;
    T* last = ws.s.data() + ws.row_begin[qi + 1] * cols;
    const bool find = given == nullptr;
    T shift = find ? -std::numeric_limits<T>::infinity() : given[ws.i0 + qi];
    const T z =
        ws.in_run[qi]
            ? ExpRun(first, last, cols, ws.run_lo[qi], ws.run_hi[qi] - ws.run_lo[qi], find, &shift)
            : ExpMasked(first, last, cols, ws.sees.data() + qi * cols, find, &shift);
    if (find) {
      ws.z[qi] = z;
      lse_out[ws.i0 + qi] = shift + std::log(z);
    }
  }
}

// One (batch row, head): out [N, d] and lse [N].
template <typename T>
void ForwardHead(const Problem<T>& p, int64_t b, int64_t h, Scratch<T>& ws, T* out, T* lse) {
  const int64_t bh = b * p.heads + h, d = p.d;
  const T *q = p.q + bh * p.n * d, *k = p.k + bh * p.n * 2 * d, *v = p.v + bh * p.n * 2 * d;
  for (int64_t i0 = 0; i0 < p.n; i0 += p.tile) {
    LoadTile(p, b, q, k, v, i0, ws);
    Exponentials<T>(p, ws, nullptr, lse);
    Gemm<T>(false, false, ws.rows, d, ws.cols, ws.s.data(), ws.cols, ws.v2.data(), d, 0,
            ws.m.data(), d);
    for (int64_t qi = 0; qi < ws.c; ++qi) {
      T* o = out + (i0 + qi) * d;
      std::fill(o, o + d, T(0));
      for (int64_t r = ws.row_begin[qi]; r < ws.row_begin[qi + 1]; ++r) {
        const T *vrow = v + ws.j_of[r] * 2 * d, *mrow = ws.m.data() + r * d;
        for (int64_t e = 0; e < d; ++e) o[e] += vrow[e] * mrow[e];
      }
      const T inv = T(1) / ws.z[qi];
      for (int64_t e = 0; e < d; ++e) o[e] *= inv;
    }
  }
}

// dst[l_of[u], :] += g2[u, :] over the tile's columns: the second set's half of dk or dv.
template <typename T>
void ScatterColumns(const Scratch<T>& ws, int64_t d, T* dst) {
  for (int64_t u = 0; u < ws.cols; ++u) {
    T* row = dst + ws.l_of[u] * 2 * d + d;
    const T* g = ws.g2.data() + u * d;
    for (int64_t e = 0; e < d; ++e) row[e] += g[e];
  }
}

// o_i = Σ_j v_j ⊙ M_ij: dv_j += M_ij ⊙ dO_i, dM_ij = v_j ⊙ dO_i, and rowsum(P ⊙ dP) = dO_i·o_i.
template <typename T>
void ValueGradients(const Problem<T>& p, const T* v, const T* dout, Scratch<T>& ws, T* dv) {
  const int64_t d = p.d;
  for (int64_t qi = 0; qi < ws.c; ++qi) {
    const T* g = dout + (ws.i0 + qi) * d;
    T delta = 0;
    for (int64_t r = ws.row_begin[qi]; r < ws.row_begin[qi + 1]; ++r) {
      const T *vrow = v + ws.j_of[r] * 2 * d, *mrow = ws.m.data() + r * d;
      T *dmrow = ws.dm.data() + r * d, *dvrow = dv + ws.j_of[r] * 2 * d;
      for (int64_t e = 0; e < d; ++e) {
        dmrow[e] = vrow[e] * g[e];
        dvrow[e] += mrow[e] * g[e];
        delta += dmrow[e] * mrow[e];
      }
    }
    ws.delta[qi] = delta;
  }
}

// W = scale·(q_i ⊙ k_j): dq_i += scale·Σ_j dW_ij ⊙ k_j, dk_j += scale·dW_ij ⊙ q_i.
template <typename T>
void QueryKeyGradients(const Problem<T>& p, const T* q, const T* k, Scratch<T>& ws, T* dq, T* dk) {
  const int64_t d = p.d;
  for (int64_t qi = 0; qi < ws.c; ++qi) {
    const T* qrow = q + (ws.i0 + qi) * d;
    T* dqrow = dq + (ws.i0 + qi) * d;
    for (int64_t r = ws.row_begin[qi]; r < ws.row_begin[qi + 1]; ++r) {
      const T *krow = k + ws.j_of[r] * 2 * d, *dwrow = ws.dw.data() + r * d;
      T* dkrow = dk + ws.j_of[r] * 2 * d;
      for (int64_t e = 0; e < d; ++e) {
        dqrow[e] += p.scale * dwrow[e] * krow[e];
        dkrow[e] += p.scale * dwrow[e] * qrow[e];
      }
    }
  }
}

// Gradients of one (batch row, head), accumulated into dq [N, d], dk and dv [N, 2d]; dout [N, d].
template <typename T>
void BackwardHead(const Problem<T>& p, int64_t b, int64_t h, Scratch<T>& ws, const T* dout,
                  const T* lse, T* dq, T* dk, T* dv) {
  const int64_t bh = b * p.heads + h, d = p.d;
  const T *q = p.q + bh * p.n * d, *k = p.k + bh * p.n * 2 * d, *v = p.v + bh * p.n * 2 * d;
  for (int64_t i0 = 0; i0 < p.n; i0 += p.tile) {
    LoadTile(p, b, q, k, v, i0, ws);
    const int64_t rows = ws.rows, cols = ws.cols;
    Exponentials<T>(p, ws, lse, nullptr);
    Gemm<T>(false, false, rows, d, cols, ws.s.data(), cols, ws.v2.data(), d, 0, ws.m.data(), d);
    ValueGradients(p, v, dout, ws, dv);
    Gemm<T>(false, true, rows, cols, d, ws.dm.data(), d, ws.v2.data(), d, 0, ws.ds.data(), cols);
    Gemm<T>(true, false, cols, d, rows, ws.s.data(), cols, ws.dm.data(), d, 0, ws.g2.data(), d);
    ScatterColumns(ws, d, dv);  // dV' += Pᵀ·dM
    for (int64_t qi = 0; qi < ws.c; ++qi) {
      for (int64_t r = ws.row_begin[qi]; r < ws.row_begin[qi + 1]; ++r) {
        kernels::SoftmaxGradRow(ws.s.data() + r * cols, ws.ds.data() + r * cols, cols,
                                ws.delta[qi]);
      }
    }
    Gemm<T>(false, false, rows, d, cols, ws.ds.data(), cols, ws.k2.data(), d, 0, ws.dw.data(), d);
    Gemm<T>(true, false, cols, d, rows, ws.ds.data(), cols, ws.w.data(), d, 0, ws.g2.data(), d);
    ScatterColumns(ws, d, dk);  // dK' += dSᵀ·W
    QueryKeyGradients(p, q, k, ws, dq, dk);
  }
}

template <typename T>
Problem<T> MakeProblem(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& seg,
                       const SimplicialMask& mask, double scale) {
  Problem<T> p;
  p.batch = q.size(0);
  p.heads = q.size(1);
  p.n = q.size(2);
  p.d = q.size(3);
  p.mask = mask;
  p.scale = static_cast<T>(scale);
  p.q = q.data_ptr<T>();
  p.k = k.data_ptr<T>();
  p.v = v.data_ptr<T>();
  p.seg = seg.numel() > 0 ? seg.data_ptr<int64_t>() : nullptr;
  p.tile = TileQueries(p);
  return p;
}

template <typename T>
std::pair<Tensor, Tensor> Forward(const Tensor& q, const Tensor& k, const Tensor& v,
                                  const Tensor& seg, const SimplicialMask& mask, double scale) {
  const Problem<T> p = MakeProblem<T>(q, k, v, seg, mask, scale);
  Tensor out = torch::empty_like(q), lse = torch::empty({p.batch, p.heads, p.n}, q.options());
  T *o = out.data_ptr<T>(), *l = lse.data_ptr<T>();
  kernels::ParallelTasks(
      p.batch * p.heads, [&] { return Scratch<T>(p); },
      [&](Scratch<T>& ws, int64_t task) {
        ForwardHead(p, task / p.heads, task % p.heads, ws, o + task * p.n * p.d, l + task * p.n);
      });
  return {out, lse};
}

template <typename T>
std::vector<Tensor> Backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& seg,
                             const Tensor& lse, const Tensor& dout, const SimplicialMask& mask,
                             double scale) {
  const Problem<T> p = MakeProblem<T>(q, k, v, seg, mask, scale);
  Tensor dq = torch::zeros_like(q), dk = torch::zeros_like(k), dv = torch::zeros_like(v);
  const T *g = dout.data_ptr<T>(), *l = lse.data_ptr<T>();
  T *gq = dq.data_ptr<T>(), *gk = dk.data_ptr<T>(), *gv = dv.data_ptr<T>();
  kernels::ParallelTasks(
      p.batch * p.heads, [&] { return Scratch<T>(p); },
      [&](Scratch<T>& ws, int64_t task) {
        const int64_t rows = task * p.n;
        BackwardHead(p, task / p.heads, task % p.heads, ws, g + rows * p.d, l + rows,
                     gq + rows * p.d, gk + rows * 2 * p.d, gv + rows * 2 * p.d);
      });
  return {dq, dk, dv};
}

SimplicialMask MaskOf(torch::autograd::AutogradContext* ctx) {
  SimplicialMask m;
  m.causal = ctx->saved_data["causal"].toBool();
  m.window1 = ctx->saved_data["window1"].toInt();
  m.window2 = ctx->saved_data["window2"].toInt();
  return m;
}

class SimplicialFunction : public torch::autograd::Function<SimplicialFunction> {
 public:
  static Tensor forward(torch::autograd::AutogradContext* ctx, const Tensor& q, const Tensor& k,
                        const Tensor& v, const Tensor& seg, bool causal, int64_t window1,
                        int64_t window2, double scale) {
    const SimplicialMask mask{causal, window1, window2};
    auto [out, lse] = q.scalar_type() == torch::kFloat64
                          ? Forward<double>(q, k, v, seg, mask, scale)
                          : Forward<float>(q, k, v, seg, mask, scale);
    ctx->save_for_backward({q, k, v, seg, lse});
    ctx->saved_data["causal"] = causal;
    ctx->saved_data["window1"] = window1;
    ctx->saved_data["window2"] = window2;
    ctx->saved_data["scale"] = scale;
    return out;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const double scale = ctx->saved_data["scale"].toDouble();
    const Tensor dout = grads[0].to(saved[0].scalar_type()).contiguous();
    auto g = saved[0].scalar_type() == torch::kFloat64
                 ? Backward<double>(saved[0], saved[1], saved[2], saved[3], saved[4], dout,
                                    MaskOf(ctx), scale)
                 : Backward<float>(saved[0], saved[1], saved[2], saved[3], saved[4], dout,
                                   MaskOf(ctx), scale);
    return {g[0], g[1], g[2], Tensor(), Tensor(), Tensor(), Tensor(), Tensor()};
  }
};

}  // namespace

bool SimplicialCpuSupports(const torch::Tensor& q) {
  return q.device().is_cpu() &&
         (q.scalar_type() == torch::kFloat32 || q.scalar_type() == torch::kFloat64);
}

torch::Tensor SimplicialCpu(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                            const torch::Tensor& segments, const SimplicialMask& mask,
                            double scale) {
  TORCH_CHECK(SimplicialCpuSupports(q), "simplicial fused kernel: CPU float32 or float64, got ",
              q.device(), " ", q.scalar_type());
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && k.sizes() == v.sizes() &&
                  k.size(0) == q.size(0) && k.size(1) == q.size(1) && k.size(2) == q.size(2) &&
                  k.size(3) == 2 * q.size(3),
              "simplicial fused kernel: q [B, H, N, d] and k, v [B, H, N, 2d], got ", q.sizes(),
              ", ", k.sizes(), ", ", v.sizes());
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
              "simplicial fused kernel: q, k and v of one dtype");
  Tensor seg = torch::empty({0}, q.options().dtype(torch::kInt64));
  if (segments.defined()) {
    TORCH_CHECK(
        segments.dim() == 2 && segments.size(0) == q.size(0) && segments.size(1) == q.size(2),
        "simplicial fused kernel: segments [B, N], got ", segments.sizes());
    seg = segments.to(torch::kInt64).contiguous();
  }
  return SimplicialFunction::apply(q.contiguous(), k.contiguous(), v.contiguous(), seg, mask.causal,
                                   mask.window1, mask.window2, scale);
}

}  // namespace loom::attention
