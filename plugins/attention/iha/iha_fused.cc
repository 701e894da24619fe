#include "iha_fused.h"

#include <ATen/Parallel.h>

#include <cmath>
#include <limits>

#include "attention_common.h"

// OpenBLAS's own thread pool, when LibTorch uses OpenBLAS (Debian's libtorch does): tile GEMMs
// run inside our parallel tasks and must not each fan out to every core. Weak, so builds against
// MKL or other BLAS libraries simply do not find it.
extern "C" {
void openblas_set_num_threads(int) __attribute__((weak));
int openblas_get_num_threads() __attribute__((weak));
}

namespace loom::attention::iha {
namespace {

using torch::Tensor;

enum class TileClass { kSkip, kFull, kPartial };

// Everything a task needs, shared read-only between tasks.
struct Plan {
  int64_t b = 0, n = 0, h = 0, p = 1, dk = 0, dv = 0, tile = 0, tiles = 0;
  Options o;
  double scale = 1;
  Tensor qt, kt, vt;  // [B, H, N, d]: heads-major copies, so a tile of one head is one GEMM operand
  Tensor aq, ak, av;  // [H(m), H(h), P]
  Tensor cos, sin;    // [B|1, N·P, d/2] RoPE tables by expanded index (undefined without RoPE)
  // Packed sequences: for each token, the first and last token of its segment ([B|1, N] int64
  // on the CPU; undefined without segments). Segments are contiguous runs.
  Tensor seg_first, seg_last, segments;

  int64_t TileLen(int64_t t) const { return std::min(tile, n - t * tile); }

  TileClass Classify(int64_t bi, int64_t n0, int64_t tq, int64_t t0, int64_t tk) const {
    TileClass c = ClassifyMask(n0, tq, t0, tk);
    if (c == TileClass::kSkip || !seg_first.defined()) return c;
    const int64_t row = seg_first.size(0) == 1 ? 0 : bi;
    const int64_t* first = seg_first[row].data_ptr<int64_t>();
    const int64_t* last = seg_last[row].data_ptr<int64_t>();
    // The query tile's segments span [first[n0], last[n0 + tq - 1]]: no key in range, no work.
    if (first[n0] > t0 + tk - 1 || last[n0 + tq - 1] < t0) return TileClass::kSkip;
    return TileClass::kPartial;
  }

  TileClass ClassifyMask(int64_t n0, int64_t tq, int64_t t0, int64_t tk) const {
    const int64_t smin = n0 * p, smax = (n0 + tq) * p - 1;
    const int64_t tmin = t0 * p, tmax = (t0 + tk) * p - 1;
    const int64_t dmin = smin - tmax, dmax = smax - tmin;  // range of s - s'
    bool any = true, all = true;
    if (o.mask == Mask::kInterleaved) {
      any &= dmax >= 0;
      all &= dmin >= 0;
    } else if (o.mask == Mask::kBlock) {
      any &= (n0 + tq - 1) - t0 >= 0;
      all &= n0 - (t0 + tk - 1) >= 0;
    }
    if (o.window > 0) {
      const int64_t wp = o.window * p;
      any &= dmin < wp && dmax > -wp;
      all &= dmax < wp && dmin > -wp;
    }
    return !any ? TileClass::kSkip : (all ? TileClass::kFull : TileClass::kPartial);
  }

  bool Allowed(int64_t s, int64_t t) const {
    if (o.mask == Mask::kInterleaved && t > s) return false;
    if (o.mask == Mask::kBlock && t / p > s / p) return false;
    if (o.window > 0 && std::abs(s - t) >= o.window * p) return false;
    return true;
  }

  // Disallowed entries of a [tq·P, tk·P] score tile := fill. Rows and columns are token-major,
  // so row r is expanded index s = n0·P + r, column c is t = t0·P + c, and every mask allows one
  // contiguous column range per row: two fills per row.
  void Mask(Tensor& scores, int64_t bi, int64_t n0, int64_t tq, int64_t t0, int64_t tk,
            double fill) const {
    if (!scores.is_cpu()) {
      // Other devices: the same rule as tensor ops (no host access to device memory).
      auto idx = torch::TensorOptions().dtype(torch::kInt64).device(scores.device());
      Tensor s = (torch::arange(tq * p, idx) + n0 * p).unsqueeze(1);
      Tensor t = (torch::arange(tk * p, idx) + t0 * p).unsqueeze(0);
      Tensor allowed = torch::ones({tq * p, tk * p}, idx.dtype(torch::kBool));
      if (o.mask == Mask::kInterleaved) allowed &= t <= s;
      if (o.mask == Mask::kBlock) allowed &= torch::div(t, p, "floor") <= torch::div(s, p, "floor");
      if (o.window > 0) allowed &= (s - t).abs() < o.window * p;
      if (segments.defined()) {
        Tensor seg = segments[segments.size(0) == 1 ? 0 : bi].to(scores.device());
        allowed &= seg.index_select(0, torch::div(s.squeeze(1), p, "floor")).unsqueeze(1) ==
                   seg.index_select(0, torch::div(t.squeeze(0), p, "floor")).unsqueeze(0);
      }
      scores.masked_fill_(allowed.logical_not(), fill);
      return;
    }
    AT_DISPATCH_FLOATING_TYPES(scores.scalar_type(), "iha_fused_mask", [&] {
      scalar_t* data = scores.data_ptr<scalar_t>();
      const int64_t cols = tk * p, base = t0 * p, wp = o.window * p;
      const int64_t seg_row = seg_first.defined() && seg_first.size(0) > 1 ? bi : 0;
      const int64_t* first = seg_first.defined() ? seg_first[seg_row].data_ptr<int64_t>() : nullptr;
      const int64_t* last = seg_first.defined() ? seg_last[seg_row].data_ptr<int64_t>() : nullptr;
      const auto f = static_cast<scalar_t>(fill);
      for (int64_t r = 0; r < tq * p; ++r) {
        const int64_t s = n0 * p + r;
        int64_t lo = 0, hi = cols - 1;  // allowed columns, inclusive
        if (o.mask == Mask::kInterleaved) hi = std::min(hi, s - base);
        if (o.mask == Mask::kBlock) hi = std::min(hi, (s / p + 1) * p - 1 - base);
        if (o.window > 0) {
          hi = std::min(hi, s + wp - 1 - base);
          lo = std::max(lo, s - wp + 1 - base);
        }
        if (first != nullptr) {  // only the token's own segment
          lo = std::max(lo, first[s / p] * p - base);
          hi = std::min(hi, (last[s / p] + 1) * p - 1 - base);
        }
        scalar_t* row = data + r * cols;
        if (lo > hi) {
          std::fill(row, row + cols, f);
          continue;
        }
        std::fill(row, row + lo, f);
        std::fill(row + hi + 1, row + cols, f);
      }
    });
  }

  // Pseudo rows of head h for tokens [n0, n0 + len): alpha[:, h, :]ᵀ · x[b, :, n0:n0+len, :] as
  // one GEMM ([P, H] x [H, len·d]), then token-major: [len·P, d], row i·P + j.
  Tensor Mix(const Tensor& xt, const Tensor& alpha, int64_t bi, int64_t hi, int64_t n0,
             int64_t len) const {
    const int64_t d = xt.size(3);
    Tensor src = xt[bi].narrow(1, n0, len).view({h, len * d});
    return alpha.select(1, hi).t().mm(src).view({p, len, d}).transpose(0, 1).reshape({len * p, d});
  }

  // RoPE tables for a tile: [P·len, d/2].
  std::pair<Tensor, Tensor> Rope(int64_t bi, int64_t n0, int64_t len) const {
    const int64_t row = cos.size(0) == 1 ? 0 : bi;
    return {cos[row].narrow(0, n0 * p, len * p), sin[row].narrow(0, n0 * p, len * p)};
  }

  static Tensor RotateForward(const Tensor& x, const std::pair<Tensor, Tensor>& cs) {
    const int64_t half = x.size(1) / 2;
    Tensor x1 = x.narrow(1, 0, half), x2 = x.narrow(1, half, half);
    return torch::cat({x1 * cs.first - x2 * cs.second, x2 * cs.first + x1 * cs.second}, 1);
  }
  static Tensor RotateBackward(const Tensor& g, const std::pair<Tensor, Tensor>& cs) {
    const int64_t half = g.size(1) / 2;
    Tensor g1 = g.narrow(1, 0, half), g2 = g.narrow(1, half, half);
    return torch::cat({g1 * cs.first + g2 * cs.second, g2 * cs.first - g1 * cs.second}, 1);
  }

  // Pseudo-queries (scaled, rotated), pseudo-keys (rotated) and pseudo-values of one tile.
  Tensor Queries(int64_t bi, int64_t hi, int64_t n0, int64_t len) const {
    Tensor q = Mix(qt, aq, bi, hi, n0, len);
    if (cos.defined()) q = RotateForward(q, Rope(bi, n0, len));
    return q.mul_(scale);
  }
  Tensor Keys(int64_t bi, int64_t hi, int64_t n0, int64_t len) const {
    Tensor k = Mix(kt, ak, bi, hi, n0, len);
    return cos.defined() ? RotateForward(k, Rope(bi, n0, len)) : k;
  }
  Tensor Values(int64_t bi, int64_t hi, int64_t n0, int64_t len) const {
    return Mix(vt, av, bi, hi, n0, len);
  }

  // Probabilities (softmax, from the saved log-sum-exp) or masked coefficients (linear).
  Tensor Probabilities(const Tensor& q, const Tensor& k, const Tensor& lse_rows, TileClass cls,
                       int64_t bi, int64_t n0, int64_t tq, int64_t t0, int64_t tk) const {
    Tensor s = q.mm(k.t());
    const bool softmax = o.score == Score::kSoftmax;
    if (cls == TileClass::kPartial) {
      Mask(s, bi, n0, tq, t0, tk, softmax ? -std::numeric_limits<double>::infinity() : 0.0);
    }
    if (softmax) s.sub_(lse_rows.unsqueeze(1)).exp_();
    return s;
  }
};

Plan MakePlan(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& alpha_q,
              const Tensor& alpha_k, const Tensor& alpha_v, const Tensor& cos, const Tensor& sin,
              const Tensor& segments, const Options& o, int64_t tile) {
  Plan pl;
  pl.b = q.size(0);
  pl.n = q.size(1);
  pl.h = q.size(2);
  pl.dk = q.size(3);
  pl.dv = v.size(3);
  pl.p = o.p;
  pl.o = o;
  pl.scale = o.scale > 0 ? o.scale : 1.0 / std::sqrt(static_cast<double>(pl.dk));
  pl.tile = tile;
  pl.tiles = (pl.n + tile - 1) / tile;
  pl.qt = q.permute({0, 2, 1, 3}).contiguous();
  pl.kt = k.permute({0, 2, 1, 3}).contiguous();
  pl.vt = v.permute({0, 2, 1, 3}).contiguous();
  pl.aq = alpha_q.to(q.scalar_type()).contiguous();
  pl.ak = alpha_k.to(q.scalar_type()).contiguous();
  pl.av = alpha_v.to(q.scalar_type()).contiguous();
  if (cos.numel() > 0) {
    pl.cos = cos;
    pl.sin = sin;
  }
  if (segments.numel() > 0) {
    // First and last token of each token's segment run, per row.
    pl.segments = segments;
    Tensor seg = segments.to(torch::kCPU, torch::kInt64).contiguous();
    pl.seg_first = torch::empty_like(seg);
    pl.seg_last = torch::empty_like(seg);
    for (int64_t r = 0; r < seg.size(0); ++r) {
      const int64_t* id = seg[r].data_ptr<int64_t>();
      int64_t* first = pl.seg_first[r].data_ptr<int64_t>();
      int64_t* last = pl.seg_last[r].data_ptr<int64_t>();
      const int64_t n = seg.size(1);
      for (int64_t i = 0; i < n; ++i) first[i] = (i > 0 && id[i] == id[i - 1]) ? first[i - 1] : i;
      for (int64_t i = n - 1; i >= 0; --i)
        last[i] = (i + 1 < n && id[i] == id[i + 1]) ? last[i + 1] : i;
    }
  }
  return pl;
}

// Runs fn(batch row, tile index) for every pair, in parallel, with autograd off in each thread.
template <typename Fn>
void ForEachTile(const Plan& pl, Fn fn) {
  const bool pin_blas = openblas_set_num_threads != nullptr &&
                        openblas_get_num_threads != nullptr && at::get_num_threads() > 1 &&
                        !at::in_parallel_region();
  const int blas_threads = pin_blas ? openblas_get_num_threads() : 0;
  if (pin_blas) openblas_set_num_threads(1);
  // Causal and windowed masks make tiles unequal; threads take tasks round-robin in a zigzag
  // order (t, T-1-t, ...) so heavy and light tiles spread evenly over threads.
  const int64_t tasks = pl.b * pl.tiles;
  std::vector<int64_t> order;
  order.reserve(tasks);
  for (int64_t lo = 0, hi = pl.tiles - 1; lo <= hi; ++lo, --hi) {
    order.push_back(lo);
    if (hi != lo) order.push_back(hi);
  }
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), tasks));
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    torch::NoGradGuard no_grad;
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t i = t; i < tasks; i += threads) fn(i / pl.tiles, order[i % pl.tiles]);
    }
  });
  if (pin_blas) openblas_set_num_threads(blas_threads);
}

// Forward: pseudo outputs [B, N, H, P, dv] and log-sum-exp [B, H, P, N].
std::pair<Tensor, Tensor> Forward(const Plan& pl, bool poison) {
  auto opts = pl.qt.options();
  Tensor out = torch::empty({pl.b, pl.n, pl.h, pl.p, pl.dv}, opts);
  Tensor lse = torch::empty({pl.b, pl.h, pl.n * pl.p}, opts);
  if (poison) {
    out.fill_(std::numeric_limits<double>::quiet_NaN());
    lse.fill_(std::numeric_limits<double>::quiet_NaN());
  }
  const bool softmax = pl.o.score == Score::kSoftmax;
  const double neg_inf = -std::numeric_limits<double>::infinity();
  ForEachTile(pl, [&](int64_t bi, int64_t qi) {
    const int64_t n0 = qi * pl.tile, tq = pl.TileLen(qi), rows = pl.p * tq;
    for (int64_t hi = 0; hi < pl.h; ++hi) {
      Tensor q = pl.Queries(bi, hi, n0, tq);
      Tensor acc = torch::zeros({rows, pl.dv}, opts);
      Tensor m = torch::full({rows}, neg_inf, opts);
      Tensor l = torch::zeros({rows}, opts);
      for (int64_t ki = 0; ki < pl.tiles; ++ki) {
        const int64_t t0 = ki * pl.tile, tk = pl.TileLen(ki);
        const TileClass cls = pl.Classify(bi, n0, tq, t0, tk);
        if (cls == TileClass::kSkip) continue;
        Tensor k = pl.Keys(bi, hi, t0, tk);
        Tensor v = pl.Values(bi, hi, t0, tk);
        Tensor s = q.mm(k.t());
        if (cls == TileClass::kPartial) pl.Mask(s, bi, n0, tq, t0, tk, softmax ? neg_inf : 0.0);
        if (!softmax) {
          acc.addmm_(s, v);
          continue;
        }
        Tensor m_new = torch::maximum(m, std::get<0>(s.max(1)));
        // A row with no allowed key yet keeps -inf: shift it by 0 so exp gives 0, not NaN.
        Tensor shift = m_new.masked_fill(m_new.isinf(), 0.0);
        s.sub_(shift.unsqueeze(1)).exp_();
        Tensor correction = (m - shift).exp_();
        l.mul_(correction).add_(s.sum(1));
        acc.mul_(correction.unsqueeze(1)).addmm_(s, v);
        m = m_new;
      }
      if (softmax) {
        acc.div_(l.unsqueeze(1));
        lse[bi][hi].narrow(0, n0 * pl.p, rows).copy_(m + l.log());
      } else {
        lse[bi][hi].narrow(0, n0 * pl.p, rows).zero_();
      }
      out[bi].narrow(0, n0, tq).select(1, hi).copy_(acc.view({tq, pl.p, pl.dv}));
    }
  });
  return {out, lse};
}

struct Grads {
  Tensor dq, dk, dv, daq, dak, dav;
};

// Backward by recomputation: grad_out [B, N, H, P, dv].
Grads Backward(const Plan& pl, const Tensor& grad_out, const Tensor& out, const Tensor& lse) {
  auto opts = pl.qt.options();
  const bool softmax = pl.o.score == Score::kSoftmax;
  // Heads-major copies, so a tile of one head is a contiguous block of expanded rows.
  Tensor go = grad_out.permute({0, 2, 1, 3, 4}).reshape({pl.b, pl.h, pl.n * pl.p, pl.dv});
  Tensor delta = (grad_out * out).sum(-1).permute({0, 2, 1, 3}).reshape({pl.b, pl.h, pl.n * pl.p});
  Tensor dqt = torch::zeros_like(pl.qt), dkt = torch::zeros_like(pl.kt),
         dvt = torch::zeros_like(pl.vt);
  const int64_t tasks = pl.b * pl.tiles;
  Tensor daq = torch::zeros({tasks, pl.h, pl.h, pl.p}, opts);
  Tensor dak = torch::zeros_like(daq), dav = torch::zeros_like(daq);
  auto rows_of = [&](const Tensor& t, int64_t bi, int64_t hi, int64_t n0, int64_t len) {
    return t[bi][hi].narrow(0, n0 * pl.p, len * pl.p);
  };
  auto grad_rows = [&](int64_t bi, int64_t hi, int64_t n0, int64_t len) {
    return go[bi][hi].narrow(0, n0 * pl.p, len * pl.p);
  };
  // dS from probabilities and dP = dO · Vᵀ.
  auto score_grad = [&](Tensor& prob, const Tensor& dp, const Tensor& delta_rows, TileClass cls,
                        int64_t bi, int64_t n0, int64_t tq, int64_t t0, int64_t tk) {
    if (softmax) return prob * (dp - delta_rows.unsqueeze(1));
    Tensor ds = dp.clone();
    if (cls == TileClass::kPartial) pl.Mask(ds, bi, n0, tq, t0, tk, 0.0);
    return ds;
  };
  // Un-mix a pseudo-row gradient of head h into x's gradient and alpha's gradient.
  auto unmix = [&](const Tensor& xt, const Tensor& alpha, Tensor& dxt, Tensor& dalpha, int64_t bi,
                   int64_t hi, int64_t n0, int64_t len, const Tensor& g) {
    const int64_t d = xt.size(3);
    Tensor gv = g.view({len, pl.p, d}).transpose(0, 1).reshape({pl.p, len * d});
    Tensor src = xt[bi].narrow(1, n0, len).view({pl.h, len * d});
    dxt[bi].narrow(1, n0, len).view({pl.h, len * d}).addmm_(alpha.select(1, hi), gv);
    dalpha.select(1, hi).addmm_(src, gv.t());
  };

  // Pass 1: per key tile, dK and dV (and alpha_k, alpha_v gradients).
  ForEachTile(pl, [&](int64_t bi, int64_t ki) {
    const int64_t t0 = ki * pl.tile, tk = pl.TileLen(ki);
    Tensor dak_task = dak[bi * pl.tiles + ki], dav_task = dav[bi * pl.tiles + ki];
    for (int64_t hi = 0; hi < pl.h; ++hi) {
      Tensor k = pl.Keys(bi, hi, t0, tk), v = pl.Values(bi, hi, t0, tk);
      Tensor dk = torch::zeros({pl.p * tk, pl.dk}, opts),
             dv = torch::zeros({pl.p * tk, pl.dv}, opts);
      for (int64_t qi = 0; qi < pl.tiles; ++qi) {
        const int64_t n0 = qi * pl.tile, tq = pl.TileLen(qi);
        const TileClass cls = pl.Classify(bi, n0, tq, t0, tk);
        if (cls == TileClass::kSkip) continue;
        Tensor q = pl.Queries(bi, hi, n0, tq);
        Tensor prob = pl.Probabilities(q, k, rows_of(lse, bi, hi, n0, tq), cls, bi, n0, tq, t0, tk);
        Tensor dout = grad_rows(bi, hi, n0, tq);
        dv.addmm_(prob.t(), dout);
        Tensor ds = score_grad(prob, dout.mm(v.t()), rows_of(delta, bi, hi, n0, tq), cls, bi, n0,
                               tq, t0, tk);
        dk.addmm_(ds.t(), q);
      }
      if (pl.cos.defined()) dk = Plan::RotateBackward(dk, pl.Rope(bi, t0, tk));
      unmix(pl.kt, pl.ak, dkt, dak_task, bi, hi, t0, tk, dk);
      unmix(pl.vt, pl.av, dvt, dav_task, bi, hi, t0, tk, dv);
    }
  });
  // Pass 2: per query tile, dQ (and alpha_q's gradient).
  ForEachTile(pl, [&](int64_t bi, int64_t qi) {
    const int64_t n0 = qi * pl.tile, tq = pl.TileLen(qi);
    Tensor daq_task = daq[bi * pl.tiles + qi];
    for (int64_t hi = 0; hi < pl.h; ++hi) {
      Tensor q = pl.Queries(bi, hi, n0, tq);
      Tensor lse_rows = rows_of(lse, bi, hi, n0, tq), delta_rows = rows_of(delta, bi, hi, n0, tq);
      Tensor dout = grad_rows(bi, hi, n0, tq);
      Tensor dq = torch::zeros({pl.p * tq, pl.dk}, opts);
      for (int64_t ki = 0; ki < pl.tiles; ++ki) {
        const int64_t t0 = ki * pl.tile, tk = pl.TileLen(ki);
        const TileClass cls = pl.Classify(bi, n0, tq, t0, tk);
        if (cls == TileClass::kSkip) continue;
        Tensor k = pl.Keys(bi, hi, t0, tk), v = pl.Values(bi, hi, t0, tk);
        Tensor prob = pl.Probabilities(q, k, lse_rows, cls, bi, n0, tq, t0, tk);
        Tensor ds = score_grad(prob, dout.mm(v.t()), delta_rows, cls, bi, n0, tq, t0, tk);
        dq.addmm_(ds, k);
      }
      dq.mul_(pl.scale);
      if (pl.cos.defined()) dq = Plan::RotateBackward(dq, pl.Rope(bi, n0, tq));
      unmix(pl.qt, pl.aq, dqt, daq_task, bi, hi, n0, tq, dq);
    }
  });
  Grads g;
  g.dq = dqt.permute({0, 2, 1, 3});
  g.dk = dkt.permute({0, 2, 1, 3});
  g.dv = dvt.permute({0, 2, 1, 3});
  g.daq = daq.sum(0);
  g.dak = dak.sum(0);
  g.dav = dav.sum(0);
  return g;
}

class IhaFusedFunction : public torch::autograd::Function<IhaFusedFunction> {
 public:
  static Tensor forward(torch::autograd::AutogradContext* ctx, Tensor q, Tensor k, Tensor v,
                        Tensor alpha_q, Tensor alpha_k, Tensor alpha_v, Tensor cos, Tensor sin,
                        Tensor segments, int64_t mask, int64_t window, int64_t p, int64_t score,
                        double scale, int64_t tile, bool poison) {
    Options o;
    o.p = p;
    o.mask = static_cast<Mask>(mask);
    o.window = window;
    o.score = static_cast<Score>(score);
    o.scale = scale;
    Plan pl = MakePlan(q, k, v, alpha_q, alpha_k, alpha_v, cos, sin, segments, o, tile);
    auto [out, lse] = Forward(pl, poison);
    ctx->save_for_backward({q, k, v, alpha_q, alpha_k, alpha_v, cos, sin, segments, out, lse});
    ctx->saved_data["mask"] = mask;
    ctx->saved_data["window"] = window;
    ctx->saved_data["p"] = p;
    ctx->saved_data["score"] = score;
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["tile"] = tile;
    return out;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto s = ctx->get_saved_variables();
    Options o;
    o.p = ctx->saved_data["p"].toInt();
    o.mask = static_cast<Mask>(ctx->saved_data["mask"].toInt());
    o.window = ctx->saved_data["window"].toInt();
    o.score = static_cast<Score>(ctx->saved_data["score"].toInt());
    o.scale = ctx->saved_data["scale"].toDouble();
    Plan pl = MakePlan(s[0], s[1], s[2], s[3], s[4], s[5], s[6], s[7], s[8], o,
                       ctx->saved_data["tile"].toInt());
    Grads g = Backward(pl, grads[0].contiguous(), s[9], s[10]);
    return {g.dq,
            g.dk,
            g.dv,
            g.daq.to(s[3].scalar_type()),
            g.dak.to(s[4].scalar_type()),
            g.dav.to(s[5].scalar_type()),
            Tensor(),
            Tensor(),
            Tensor(),
            Tensor(),
            Tensor(),
            Tensor(),
            Tensor(),
            Tensor(),
            Tensor(),
            Tensor()};
  }
};

}  // namespace

torch::Tensor FusedPseudoOutputs(const torch::Tensor& q, const torch::Tensor& k,
                                 const torch::Tensor& v, const torch::Tensor& alpha_q,
                                 const torch::Tensor& alpha_k, const torch::Tensor& alpha_v,
                                 const torch::Tensor& positions, const Options& o,
                                 const FusedOptions& fused) {
  TORCH_CHECK(q.dim() == 4 && k.sizes() == q.sizes(), "iha: q and k must be [B, N, H, d] alike");
  TORCH_CHECK(
      v.dim() == 4 && v.size(0) == q.size(0) && v.size(1) == q.size(1) && v.size(2) == q.size(2),
      "iha: v must be [B, N, H, dv] matching q");
  const int64_t h = q.size(2);
  for (const torch::Tensor* a : {&alpha_q, &alpha_k, &alpha_v}) {
    TORCH_CHECK(a->dim() == 3 && a->size(0) == h && a->size(1) == h && a->size(2) == o.p,
                "iha: alpha must be [H, H, P] = [", h, ", ", h, ", ", o.p, "], got ", a->sizes());
  }
  TORCH_CHECK(o.p >= 1 && o.window >= 0, "iha: bad p or window");
  int64_t tile = fused.tile_tokens;
  if (tile <= 0) tile = std::max<int64_t>(8, 256 / o.p);  // ~256 pseudo-tokens per tile
  tile = std::min<int64_t>(tile, std::max<int64_t>(1, q.size(1)));
  torch::Tensor cos = torch::empty({0}, q.options()), sin = cos;
  if (o.rope_theta > 0) {
    // RoPE tables [B|1, N·P, d/2] for the expanded positions (iha_core.h).
    torch::NoGradGuard no_grad;
    const int64_t d = q.size(3);
    TORCH_CHECK(d % 2 == 0, "iha: RoPE needs an even head width, got ", d);
    torch::Tensor pos = CheckedPositions(positions, q.size(0), q.size(1), q.device());
    torch::Tensor expanded =
        ExpandedPositions(pos, o.p, o.rope_phase).to(torch::kFloat64);  // [B|1, N·P]
    auto f64 = torch::TensorOptions().dtype(torch::kFloat64).device(q.device());
    torch::Tensor inv_freq =
        torch::pow(o.rope_theta, -torch::arange(0, d / 2, f64) * 2.0 / static_cast<double>(d));
    torch::Tensor angles = expanded.unsqueeze(-1) * inv_freq;  // [B|1, N·P, d/2]
    cos = angles.cos().to(q.scalar_type()).contiguous();
    sin = angles.sin().to(q.scalar_type()).contiguous();
  }
  torch::Tensor segments = torch::empty({0}, torch::kInt64);
  if (o.segments.defined()) {
    segments = o.segments.to(torch::kInt64);
    if (segments.dim() == 1) segments = segments.unsqueeze(0);
    TORCH_CHECK(segments.dim() == 2 && (segments.size(0) == 1 || segments.size(0) == q.size(0)) &&
                    segments.size(1) == q.size(1),
                "iha: segments must be [B, N] = [", q.size(0), ", ", q.size(1), "], got ",
                o.segments.sizes());
    segments = segments.contiguous();
  }
  return IhaFusedFunction::apply(q, k, v, alpha_q, alpha_k, alpha_v, cos, sin, segments,
                                 static_cast<int64_t>(o.mask), o.window, o.p,
                                 static_cast<int64_t>(o.score), o.scale, tile, fused.poison_output);
}

torch::Tensor FusedForward(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                           const torch::Tensor& alpha_q, const torch::Tensor& alpha_k,
                           const torch::Tensor& alpha_v, const torch::Tensor& collapse,
                           const torch::Tensor& positions, const Options& options,
                           const FusedOptions& fused) {
  return Collapse(FusedPseudoOutputs(q, k, v, alpha_q, alpha_k, alpha_v, positions, options, fused),
                  collapse);
}

}  // namespace loom::attention::iha
