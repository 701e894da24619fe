#include "plugins/attention/kernels/fused_attention.h"

#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <type_traits>
#include <vector>

#include "base/blas_core.h"
#include "plugins/attention/kernels/cpu_tile_ops.h"
#include "plugins/attention/kernels/kernel_autograd.h"
#include "plugins/attention/kernels/parallel_tasks.h"
#include "plugins/attention/kernels/rope.h"

namespace loom::attention::kernels {
namespace {

using torch::Tensor;

enum class TileClass { kSkip, kFull, kPartial };

// A run of consecutive tiles [start, start + len) tokens, taken as one block of GEMMs.
struct Block {
  int64_t start = 0, len = 0;
  TileClass cls = TileClass::kSkip;  // kSkip: no block left
};

// Per-head rows of q, k or v: x[b, n, m, :] starts at data + b·sb + n·sn + m·sh (the last
// dimension contiguous), so [B, N, H, d] tensors and transposed [B, H, N, d] ones both pass
// without a copy.
template <typename in_t>
struct HeadRows {
  const in_t* data = nullptr;
  int64_t sb = 0, sn = 0, sh = 0;
  const in_t* At(int64_t b, int64_t n, int64_t m) const { return data + b * sb + n * sn + m * sh; }
};

// One call's shapes, masks and read-only inputs. in_t is the tensors' element type; T the
// compute type (float for float/bf16/fp16 inputs, double for double).
template <typename in_t, typename T>
struct Kernel {
  int64_t b = 0, n = 0, h = 0, p = 1, dk = 0, dv = 0, tile = 0, tiles = 0;
  int64_t block = 0;  // most tokens in one block of consecutive tiles (a multiple of tile)
  Options o;
  T scale = 1;
  HeadRows<in_t> q, k, v;  // [B, N, H, d]
  // [H(m), H(h), P]; null: no mixing (P = 1, pseudo-head h is head h: multi-head attention).
  const T *aq = nullptr, *ak = nullptr, *av = nullptr;
  const T *cos = nullptr, *sin = nullptr;  // [B|1, N·P, dk/2] by expanded index
  int64_t rope_stride = 0;                 // batch stride of the tables (0: shared)
  // Packed sequences: first and last token of each token's segment ([B|1, N]; null: none).
  const int64_t *seg_first = nullptr, *seg_last = nullptr;
  int64_t seg_stride = 0;

  int64_t TileLen(int64_t t) const { return std::min(tile, n - t * tile); }

  TileClass Classify(int64_t bi, int64_t n0, int64_t tq, int64_t t0, int64_t tk) const {
    const int64_t smin = n0 * p, smax = (n0 + tq) * p - 1;
    const int64_t tmin = t0 * p, tmax = (t0 + tk) * p - 1;
    const int64_t dmin = smin - tmax, dmax = smax - tmin;  // range of s − s'
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
    if (!any) return TileClass::kSkip;
    if (seg_first != nullptr) {
      const int64_t* first = seg_first + bi * seg_stride;
      const int64_t* last = seg_last + bi * seg_stride;
      // The query tile's segments span [first[n0], last[n0 + tq − 1]]: no key in range, no work.
      if (first[n0] > t0 + tk - 1 || last[n0 + tq - 1] < t0) return TileClass::kSkip;
      return TileClass::kPartial;
    }
    return all ? TileClass::kFull : TileClass::kPartial;
  }

  // From tile *next on, the next run of consecutive tiles with work against the fixed range
  // [f0, f0 + flen): key tiles against a query range (keys) or query tiles against a key range,
  // at most `block` tokens; *next moves past it. Sliding windows make tiles small, so one window's
  // worth of key tiles (or query tiles, in the backward pass) is one GEMM instead of several
  // small ones.
  Block NextBlock(int64_t bi, bool keys, int64_t f0, int64_t flen, int64_t* next) const {
    Block blk;
    bool full = true;
    for (; *next < tiles; ++*next) {
      const int64_t t0 = *next * tile, len = TileLen(*next);
      const TileClass c = keys ? Classify(bi, f0, flen, t0, len) : Classify(bi, t0, len, f0, flen);
      if (c == TileClass::kSkip) {
        if (blk.len > 0) break;
        continue;
      }
      if (blk.len + len > block) break;
      if (blk.len == 0) blk.start = t0;
      blk.len += len;
      full &= c == TileClass::kFull;
    }
    if (blk.len > 0) blk.cls = full ? TileClass::kFull : TileClass::kPartial;
    return blk;
  }

  // The allowed columns [lo, hi] (inclusive; lo > hi: none) of query row s in a key tile whose
  // first expanded index is base and which has cols columns. Rows and columns are token-major,
  // so every mask allows one contiguous range.
  void Range(int64_t bi, int64_t s, int64_t base, int64_t cols, int64_t* lo, int64_t* hi) const {
    int64_t a = 0, z = cols - 1;
    if (o.mask == Mask::kInterleaved) z = std::min(z, s - base);
    if (o.mask == Mask::kBlock) z = std::min(z, (s / p + 1) * p - 1 - base);
    if (o.window > 0) {
      const int64_t wp = o.window * p;
      z = std::min(z, s + wp - 1 - base);
      a = std::max(a, s - wp + 1 - base);
    }
    if (seg_first != nullptr) {  // only the token's own segment
      a = std::max(a, seg_first[bi * seg_stride + s / p] * p - base);
      z = std::min(z, (seg_last[bi * seg_stride + s / p] + 1) * p - 1 - base);
    }
    *lo = a;
    *hi = z;
  }

  // Pseudo rows of head hd for tokens [n0, n0 + len), token-major: out[(i·P + j)·d + c] =
  // Σ_m alpha[m, hd, j] · x[b, n0 + i, m, c] (without alpha: x[b, n0 + i, hd, c]). Mixed inside
  // the tile: no P-times tensor exists.
  void Mix(const HeadRows<in_t>& x, int64_t d, const T* alpha, int64_t bi, int64_t hd, int64_t n0,
           int64_t len, T* out) const {
    if (alpha == nullptr) {
      for (int64_t i = 0; i < len; ++i) {
        const in_t* src = x.At(bi, n0 + i, hd);
        for (int64_t c = 0; c < d; ++c) out[i * d + c] = static_cast<T>(src[c]);
      }
      return;
    }
    std::vector<T> converted(std::is_same_v<in_t, T> ? 0 : d);
    for (int64_t i = 0; i < len; ++i) {
      T* rows = out + i * p * d;
      std::fill(rows, rows + p * d, T(0));
      for (int64_t m = 0; m < h; ++m) {
        const T* src = Source(x.At(bi, n0 + i, m), d, converted.data());
        for (int64_t j = 0; j < p; ++j) Axpy(rows + j * d, src, d, alpha[(m * h + hd) * p + j]);
      }
    }
  }

  // x's d values in the compute type: x itself when the types agree, else converted into buf.
  static const T* Source(const in_t* x, int64_t d, T* buf) {
    if constexpr (std::is_same_v<in_t, T>) {
      return x;
    } else {
      for (int64_t c = 0; c < d; ++c) buf[c] = static_cast<T>(x[c]);
      return buf;
    }
  }

  // RoPE on count rows starting at expanded index s0 (inverse: the transposed rotation, for
  // gradients).
  void Rotate(T* rows, int64_t bi, int64_t s0, int64_t count, bool inverse) const {
    const int64_t at = bi * rope_stride + s0 * (dk / 2);
    RotateHalfRows(rows, cos + at, sin + at, count, dk, inverse);
  }

  // Pseudo-queries (rotated, scaled), pseudo-keys (rotated) and pseudo-values of one tile.
  void Queries(int64_t bi, int64_t hd, int64_t n0, int64_t len, T* out) const {
    Mix(q, dk, aq, bi, hd, n0, len, out);
    if (cos != nullptr) Rotate(out, bi, n0 * p, len * p, false);
    for (int64_t i = 0; i < len * p * dk; ++i) out[i] *= scale;
  }
  void Keys(int64_t bi, int64_t hd, int64_t n0, int64_t len, T* out) const {
    Mix(k, dk, ak, bi, hd, n0, len, out);
    if (cos != nullptr) Rotate(out, bi, n0 * p, len * p, false);
  }
  void Values(int64_t bi, int64_t hd, int64_t n0, int64_t len, T* out) const {
    Mix(v, dv, av, bi, hd, n0, len, out);
  }

  // The transpose of Mix: pseudo-row gradients g of head hd (token-major rows) into x's
  // gradient dx ([B, N, H, d] contiguous, compute type) and alpha's (dalpha [H, H, P]).
  void Unmix(const HeadRows<in_t>& x, int64_t d, const T* alpha, int64_t bi, int64_t hd, int64_t n0,
             int64_t len, const T* g, T* dx, T* dalpha) const {
    for (int64_t i = 0; i < len; ++i) {
      const int64_t token = ((bi * n + n0 + i) * h) * d;
      if (alpha == nullptr) {
        Axpy(dx + token + hd * d, g + i * d, d, T(1));
        continue;
      }
      for (int64_t m = 0; m < h; ++m) {
        const in_t* src = x.At(bi, n0 + i, m);
        T* dst = dx + token + m * d;
        for (int64_t j = 0; j < p; ++j) {
          const T* row = g + (i * p + j) * d;
          Axpy(dst, row, d, alpha[(m * h + hd) * p + j]);
          T dot = 0;
          for (int64_t c = 0; c < d; ++c) dot += static_cast<T>(src[c]) * row[c];
          dalpha[(m * h + hd) * p + j] += dot;
        }
      }
    }
  }
};

// Scratch for one task: at most rows pseudo-queries against at most cols pseudo-keys.
template <typename T>
struct Scratch {
  std::vector<T> q, k, v, s, ds, acc, m, l;
  Scratch(int64_t rows, int64_t cols, int64_t dk, int64_t dv)
      : q(rows * dk),
        k(cols * dk),
        v(cols * dv),
        s(rows * cols),
        ds(rows * cols),
        acc(rows * dv),
        m(rows),
        l(rows) {}
};

// Forward: pseudo outputs out [B, N, H, P, dv] (input type) and the log-sum-exp lse [B, H, N·P]
// (compute type). Tasks: (batch row, query tile, head), last query tiles of each row first: under
// causal masks they see the most keys, so each thread starts on its heaviest tasks and the light
// ones fill in.
template <typename in_t, typename T>
void Forward(const Kernel<in_t, T>& kn, in_t* out, T* lse) {
  const bool softmax = kn.o.score == Score::kSoftmax;
  const int64_t np = kn.n * kn.p;
  auto scratch = [&] { return Scratch<T>(kn.tile * kn.p, kn.block * kn.p, kn.dk, kn.dv); };
  ParallelTasks(kn.b * kn.tiles * kn.h, scratch, [&](Scratch<T>& ws, int64_t task) {
    const int64_t bi = task / (kn.tiles * kn.h), hd = task % kn.h;
    const int64_t qi = kn.tiles - 1 - (task / kn.h) % kn.tiles;
    const int64_t n0 = qi * kn.tile, tq = kn.TileLen(qi), rows = kn.p * tq;
    kn.Queries(bi, hd, n0, tq, ws.q.data());
    std::fill(ws.acc.begin(), ws.acc.end(), T(0));
    std::fill(ws.m.begin(), ws.m.end(), -std::numeric_limits<T>::infinity());
    std::fill(ws.l.begin(), ws.l.end(), T(0));
    for (int64_t next = 0;;) {
      const Block blk = kn.NextBlock(bi, /*keys=*/true, n0, tq, &next);
      const TileClass cls = blk.cls;
      if (cls == TileClass::kSkip) break;
      const int64_t t0 = blk.start, tk = blk.len, cols = kn.p * tk;
      kn.Keys(bi, hd, t0, tk, ws.k.data());
      kn.Values(bi, hd, t0, tk, ws.v.data());
      T* s = ws.s.data();
      Gemm<T>(false, true, rows, cols, kn.dk, ws.q.data(), kn.dk, ws.k.data(), kn.dk, 0, s, cols);
      for (int64_t r = 0; r < rows; ++r) {
        T* row = s + r * cols;
        int64_t lo = 0, hi = cols - 1;
        if (cls == TileClass::kPartial) kn.Range(bi, n0 * kn.p + r, t0 * kn.p, cols, &lo, &hi);
        if (lo > hi) {
          std::fill(row, row + cols, T(0));
          continue;
        }
        std::fill(row, row + lo, T(0));
        std::fill(row + hi + 1, row + cols, T(0));
        if (!softmax) continue;
        const T m_new = std::max(ws.m[r], RowMax(row + lo, hi - lo + 1));
        const T correction = std::exp(ws.m[r] - m_new);  // 0 while the row had no key yet
        const T sum = ExpShiftSum(row + lo, hi - lo + 1, m_new);
        ws.l[r] = ws.l[r] * correction + sum;
        if (correction != T(1)) {
          T* acc = ws.acc.data() + r * kn.dv;
          for (int64_t c = 0; c < kn.dv; ++c) acc[c] *= correction;
        }
        ws.m[r] = m_new;
      }
      Gemm<T>(false, false, rows, kn.dv, cols, s, cols, ws.v.data(), kn.dv, 1, ws.acc.data(),
              kn.dv);
    }
    T* lse_rows = lse + (bi * kn.h + hd) * np + n0 * kn.p;
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t i = r / kn.p, j = r % kn.p;
      in_t* dst = out + (((bi * kn.n + n0 + i) * kn.h + hd) * kn.p + j) * kn.dv;
      const T* acc = ws.acc.data() + r * kn.dv;
      T inv = 1;
      if (softmax) {
        // Every mask lets a pseudo-token see itself, so l > 0; guard anyway (no NaN, no grad).
        inv = ws.l[r] > 0 ? T(1) / ws.l[r] : T(0);
        lse_rows[r] =
            ws.l[r] > 0 ? ws.m[r] + std::log(ws.l[r]) : std::numeric_limits<T>::infinity();
      } else {
        lse_rows[r] = 0;
      }
      for (int64_t c = 0; c < kn.dv; ++c) dst[c] = static_cast<in_t>(acc[c] * inv);
    }
  });
}

// Backward by recomputation (FlashAttention-2), one pass: a task owns one (batch row, head)
// and walks key tiles × allowed query tiles, so it owns the pseudo gradients dQ̃, dK̃, dṼ of
// that head outright (no atomics, no per-thread copies); a second parallel pass over (batch
// row, token tile) un-mixes them into dq, dk, dv and the alpha gradients.
//   go, delta: the upstream gradient heads-major [B, H, N·P, dv] and rowsum(dO ∘ O) [B, H, N·P].
//   dq_pseudo, dk_pseudo [B, H, N·P, dk], dv_pseudo [B, H, N·P, dv]: zeroed outputs.
template <typename in_t, typename T>
void BackwardPseudo(const Kernel<in_t, T>& kn, const T* go, const T* lse, const T* delta,
                    T* dq_pseudo, T* dk_pseudo, T* dv_pseudo) {
  const bool softmax = kn.o.score == Score::kSoftmax;
  const int64_t np = kn.n * kn.p;
  auto scratch = [&] { return Scratch<T>(kn.block * kn.p, kn.tile * kn.p, kn.dk, kn.dv); };
  ParallelTasks(kn.b * kn.h, scratch, [&](Scratch<T>& ws, int64_t task) {
    const int64_t bi = task / kn.h, hd = task % kn.h;
    const int64_t head = (bi * kn.h + hd) * np;  // first row of this head's pseudo sequence
    for (int64_t ki = 0; ki < kn.tiles; ++ki) {
      const int64_t t0 = ki * kn.tile, tk = kn.TileLen(ki), cols = kn.p * tk;
      kn.Keys(bi, hd, t0, tk, ws.k.data());
      kn.Values(bi, hd, t0, tk, ws.v.data());
      T* dk = dk_pseudo + (head + t0 * kn.p) * kn.dk;
      T* dv = dv_pseudo + (head + t0 * kn.p) * kn.dv;
      for (int64_t next = 0;;) {
        const Block blk = kn.NextBlock(bi, /*keys=*/false, t0, tk, &next);
        const TileClass cls = blk.cls;
        if (cls == TileClass::kSkip) break;
        const int64_t n0 = blk.start, tq = blk.len, rows = kn.p * tq;
        kn.Queries(bi, hd, n0, tq, ws.q.data());
        const T* dout = go + (head + n0 * kn.p) * kn.dv;
        const T* lse_rows = lse + head + n0 * kn.p;
        const T* delta_rows = delta + head + n0 * kn.p;
        T *s = ws.s.data(), *ds = ws.ds.data();
        // Probabilities (or linear coefficients), zero outside the mask.
        Gemm<T>(false, true, rows, cols, kn.dk, ws.q.data(), kn.dk, ws.k.data(), kn.dk, 0, s, cols);
        std::vector<std::pair<int64_t, int64_t>> ranges(rows, {0, cols - 1});
        for (int64_t r = 0; r < rows; ++r) {
          auto& [lo, hi] = ranges[r];
          if (cls == TileClass::kPartial) kn.Range(bi, n0 * kn.p + r, t0 * kn.p, cols, &lo, &hi);
          T* row = s + r * cols;
          if (lo > hi) {
            std::fill(row, row + cols, T(0));
            continue;
          }
          std::fill(row, row + lo, T(0));
          std::fill(row + hi + 1, row + cols, T(0));
          if (softmax) ExpShift(row + lo, hi - lo + 1, lse_rows[r]);
        }
        Gemm<T>(true, false, cols, kn.dv, rows, s, cols, dout, kn.dv, 1, dv, kn.dv);  // dV
        Gemm<T>(false, true, rows, cols, kn.dv, dout, kn.dv, ws.v.data(), kn.dv, 0, ds,
                cols);  // dP = dO · Vᵀ
        for (int64_t r = 0; r < rows; ++r) {
          const auto [lo, hi] = ranges[r];
          T* row = ds + r * cols;
          if (lo > hi) {
            std::fill(row, row + cols, T(0));
            continue;
          }
          if (softmax) {
            SoftmaxGradRow(s + r * cols + lo, row + lo, hi - lo + 1, delta_rows[r]);
          }
          std::fill(row, row + lo, T(0));
          std::fill(row + hi + 1, row + cols, T(0));
        }
        Gemm<T>(true, false, cols, kn.dk, rows, ds, cols, ws.q.data(), kn.dk, 1, dk,
                kn.dk);  // dK̃ += dSᵀ · Q̃ (Q̃ carries the scale)
        Gemm<T>(false, false, rows, kn.dk, cols, ds, cols, ws.k.data(), kn.dk, 1,
                dq_pseudo + (head + n0 * kn.p) * kn.dk, kn.dk);  // dQ̃ += dS · K̃
      }
      if (kn.cos != nullptr) kn.Rotate(dk, bi, t0 * kn.p, cols, true);
    }
    // dQ̃ so far is with respect to the scaled, rotated pseudo-queries.
    T* dq = dq_pseudo + head * kn.dk;
    for (int64_t i = 0; i < np * kn.dk; ++i) dq[i] *= kn.scale;
    if (kn.cos != nullptr) kn.Rotate(dq, bi, 0, np, true);
  });
}

template <typename in_t, typename T>
void Unmix(const Kernel<in_t, T>& kn, const T* dq_pseudo, const T* dk_pseudo, const T* dv_pseudo,
           T* dq, T* dk, T* dv, T* daq, T* dak, T* dav) {
  const int64_t np = kn.n * kn.p, per_task = kn.h * kn.h * kn.p;
  ParallelTasks(
      kn.b * kn.tiles, [] { return 0; },
      [&](int, int64_t task) {
        const int64_t bi = task / kn.tiles, ti = task % kn.tiles;
        const int64_t n0 = ti * kn.tile, len = kn.TileLen(ti);
        for (int64_t hd = 0; hd < kn.h; ++hd) {
          const int64_t row = (bi * kn.h + hd) * np + n0 * kn.p;
          kn.Unmix(kn.q, kn.dk, kn.aq, bi, hd, n0, len, dq_pseudo + row * kn.dk, dq,
                   daq + task * per_task);
          kn.Unmix(kn.k, kn.dk, kn.ak, bi, hd, n0, len, dk_pseudo + row * kn.dk, dk,
                   dak + task * per_task);
          kn.Unmix(kn.v, kn.dv, kn.av, bi, hd, n0, len, dv_pseudo + row * kn.dv, dv,
                   dav + task * per_task);
        }
      });
}

// The tensors of one call, prepared for a Kernel.
struct Prepared {
  Tensor q, k, v, aq, ak, av, cos, sin, seg_first, seg_last;
  Options o;
  int64_t tile = 0, block = 0;
};

Prepared Prepare(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& alpha_q,
                 const Tensor& alpha_k, const Tensor& alpha_v, const Tensor& cos, const Tensor& sin,
                 const Tensor& segments, const Options& o, int64_t tile, int64_t block) {
  Prepared pr;
  const auto compute = q.scalar_type() == torch::kFloat64 ? torch::kFloat64 : torch::kFloat32;
  auto rows = [](const Tensor& x) { return x.stride(3) == 1 ? x : x.contiguous(); };
  pr.q = rows(q);
  pr.k = rows(k);
  pr.v = rows(v);
  if (alpha_q.numel() > 0) {  // else multi-head attention: no mixing
    pr.aq = alpha_q.to(compute).contiguous();
    pr.ak = alpha_k.to(compute).contiguous();
    pr.av = alpha_v.to(compute).contiguous();
  }
  if (cos.numel() > 0) {
    pr.cos = cos.to(compute).contiguous();
    pr.sin = sin.to(compute).contiguous();
  }
  if (segments.numel() > 0) {
    // First and last token of each token's segment run, per row.
    Tensor seg = segments.to(torch::kCPU, torch::kInt64).contiguous();
    pr.seg_first = torch::empty_like(seg);
    pr.seg_last = torch::empty_like(seg);
    for (int64_t r = 0; r < seg.size(0); ++r) {
      const int64_t* id = seg[r].data_ptr<int64_t>();
      int64_t* first = pr.seg_first[r].data_ptr<int64_t>();
      int64_t* last = pr.seg_last[r].data_ptr<int64_t>();
      const int64_t n = seg.size(1);
      for (int64_t i = 0; i < n; ++i) first[i] = (i > 0 && id[i] == id[i - 1]) ? first[i - 1] : i;
      for (int64_t i = n - 1; i >= 0; --i)
        last[i] = (i + 1 < n && id[i] == id[i + 1]) ? last[i + 1] : i;
    }
  }
  pr.o = o;
  pr.tile = tile;
  pr.block = block;
  return pr;
}

template <typename in_t, typename T>
Kernel<in_t, T> MakeKernel(const Prepared& pr) {
  Kernel<in_t, T> kn;
  kn.b = pr.q.size(0);
  kn.n = pr.q.size(1);
  kn.h = pr.q.size(2);
  kn.dk = pr.q.size(3);
  kn.dv = pr.v.size(3);
  kn.p = pr.o.p;
  kn.o = pr.o;
  kn.scale =
      static_cast<T>(pr.o.scale > 0 ? pr.o.scale : 1.0 / std::sqrt(static_cast<double>(kn.dk)));
  kn.tile = pr.tile;
  kn.tiles = (kn.n + pr.tile - 1) / pr.tile;
  kn.block = std::max<int64_t>(1, pr.block / pr.tile) * pr.tile;
  auto rows = [](const Tensor& x) {
    return HeadRows<in_t>{x.data_ptr<in_t>(), x.stride(0), x.stride(1), x.stride(2)};
  };
  kn.q = rows(pr.q);
  kn.k = rows(pr.k);
  kn.v = rows(pr.v);
  if (pr.aq.defined()) {
    kn.aq = pr.aq.data_ptr<T>();
    kn.ak = pr.ak.data_ptr<T>();
    kn.av = pr.av.data_ptr<T>();
  }
  if (pr.cos.defined()) {
    kn.cos = pr.cos.data_ptr<T>();
    kn.sin = pr.sin.data_ptr<T>();
    kn.rope_stride = pr.cos.size(0) == 1 ? 0 : pr.cos.stride(0);
  }
  if (pr.seg_first.defined()) {
    kn.seg_first = pr.seg_first.data_ptr<int64_t>();
    kn.seg_last = pr.seg_last.data_ptr<int64_t>();
    kn.seg_stride = pr.seg_first.size(0) == 1 ? 0 : pr.seg_first.stride(0);
  }
  return kn;
}

// Calls fn.template operator()<in_t, T>() for the input's element type.
template <typename Fn>
auto Dispatch(torch::ScalarType type, Fn&& fn) {
  switch (type) {
    case torch::kFloat64:
      return fn(double{}, double{});
    case torch::kFloat32:
      return fn(float{}, float{});
    case torch::kBFloat16:
      return fn(c10::BFloat16{}, float{});
    case torch::kHalf:
      return fn(c10::Half{}, float{});
    default:
      TORCH_CHECK(false, "iha fused kernel: unsupported dtype ", type,
                  " (float64, float32, bfloat16, float16)");
  }
}

std::pair<Tensor, Tensor> RunForward(const Prepared& pr, bool poison) {
  const int64_t b = pr.q.size(0), n = pr.q.size(1), h = pr.q.size(2), p = pr.o.p, dv = pr.v.size(3);
  const auto compute = pr.q.scalar_type() == torch::kFloat64 ? torch::kFloat64 : torch::kFloat32;
  Tensor out = torch::empty({b, n, h, p, dv}, pr.q.options());
  Tensor lse = torch::empty({b, h, n * p}, pr.q.options().dtype(compute));
  if (poison) {
    out.fill_(std::numeric_limits<double>::quiet_NaN());
    lse.fill_(std::numeric_limits<double>::quiet_NaN());
  }
  Dispatch(pr.q.scalar_type(), [&](auto in, auto acc) {
    using in_t = decltype(in);
    using T = decltype(acc);
    Forward(MakeKernel<in_t, T>(pr), out.data_ptr<in_t>(), lse.data_ptr<T>());
  });
  return {out, lse};
}

struct Grads {
  Tensor dq, dk, dv, daq, dak, dav;
};

Grads RunBackward(const Prepared& pr, const Tensor& grad_out, const Tensor& out,
                  const Tensor& lse) {
  const int64_t b = pr.q.size(0), n = pr.q.size(1), h = pr.q.size(2), p = pr.o.p, dk = pr.q.size(3),
                dv = pr.v.size(3);
  const auto compute = lse.scalar_type();
  auto opts = pr.q.options().dtype(compute);
  // Heads-major upstream gradient and rowsum(dO ∘ O), in the compute type.
  Tensor go = grad_out.to(compute).permute({0, 2, 1, 3, 4}).reshape({b, h, n * p, dv}).contiguous();
  Tensor delta = PseudoRowDelta(grad_out, out, compute);
  Tensor dq_pseudo = torch::zeros({b, h, n * p, dk}, opts),
         dk_pseudo = torch::zeros_like(dq_pseudo),
         dv_pseudo = torch::zeros({b, h, n * p, dv}, opts);
  const bool mixing = pr.aq.defined();
  Tensor dq, dkx, dvx, daq, dak, dav;
  if (mixing) {
    dq = torch::zeros({b, n, h, dk}, opts);
    dkx = torch::zeros_like(dq);
    dvx = torch::zeros({b, n, h, dv}, opts);
    // Alpha gradients per Unmix task, summed after.
    daq = torch::zeros({b * ((n + pr.tile - 1) / pr.tile), h, h, p}, opts);
    dak = torch::zeros_like(daq);
    dav = torch::zeros_like(daq);
  }
  Dispatch(pr.q.scalar_type(), [&](auto in, auto acc) {
    using in_t = decltype(in);
    using T = decltype(acc);
    const Kernel<in_t, T> kn = MakeKernel<in_t, T>(pr);
    BackwardPseudo(kn, go.data_ptr<T>(), lse.data_ptr<T>(), delta.data_ptr<T>(),
                   dq_pseudo.data_ptr<T>(), dk_pseudo.data_ptr<T>(), dv_pseudo.data_ptr<T>());
    if (mixing) {
      Unmix(kn, dq_pseudo.data_ptr<T>(), dk_pseudo.data_ptr<T>(), dv_pseudo.data_ptr<T>(),
            dq.data_ptr<T>(), dkx.data_ptr<T>(), dvx.data_ptr<T>(), daq.data_ptr<T>(),
            dak.data_ptr<T>(), dav.data_ptr<T>());
    }
  });
  Grads g;
  const auto type = pr.q.scalar_type();
  if (!mixing) {  // P = 1 and head h is pseudo-head h: the gradients are the pseudo ones
    g.dq = dq_pseudo.transpose(1, 2).to(type);
    g.dk = dk_pseudo.transpose(1, 2).to(type);
    g.dv = dv_pseudo.transpose(1, 2).to(type);
    return g;
  }
  g.dq = dq.to(type);
  g.dk = dkx.to(type);
  g.dv = dvx.to(type);
  g.daq = daq.sum(0);
  g.dak = dak.sum(0);
  g.dav = dav.sum(0);
  return g;
}

class FusedAttentionFunction : public torch::autograd::Function<FusedAttentionFunction> {
 public:
  static constexpr size_t kInputs = 17;  // the arguments of forward() after ctx

  static Tensor forward(torch::autograd::AutogradContext* ctx, Tensor q, Tensor k, Tensor v,
                        Tensor alpha_q, Tensor alpha_k, Tensor alpha_v, Tensor cos, Tensor sin,
                        Tensor segments, int64_t mask, int64_t window, int64_t p, int64_t score,
                        double scale, int64_t tile, int64_t block, bool poison) {
    RECORD_USER_SCOPE("loom::fused_attention_forward");  // autograd Functions are no ops
    const Options o = KernelOptions(p, mask, window, score, scale);
    Prepared pr = Prepare(q, k, v, alpha_q, alpha_k, alpha_v, cos, sin, segments, o, tile, block);
    auto [out, lse] = RunForward(pr, poison);
    ctx->save_for_backward({q, k, v, alpha_q, alpha_k, alpha_v, cos, sin, segments, out, lse});
    SaveKernelOptions(ctx, o);
    ctx->saved_data["tile"] = tile;
    ctx->saved_data["block"] = block;
    return out;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto s = ctx->get_saved_variables();
    Prepared pr =
        Prepare(s[0], s[1], s[2], s[3], s[4], s[5], s[6], s[7], s[8], SavedKernelOptions(ctx),
                ctx->saved_data["tile"].toInt(), ctx->saved_data["block"].toInt());
    Grads g = RunBackward(pr, grads[0], s[9], s[10]);
    if (!g.daq.defined()) return LeadingGrads({g.dq, g.dk, g.dv}, kInputs);
    return LeadingGrads({g.dq, g.dk, g.dv, g.daq.to(s[3].scalar_type()),
                         g.dak.to(s[4].scalar_type()), g.dav.to(s[5].scalar_type())},
                        kInputs);
  }
};

}  // namespace

int64_t DefaultTileTokens(int64_t p, int64_t window) {
  // About 256 pseudo-tokens per tile: GEMMs large enough to run near the BLAS rate, small enough
  // for the score tile (256² floats) to stay in L2. A sliding window of W tokens makes a query
  // tile of T tokens compute about W + T keys per row for W useful ones, so windowed layers take
  // T = W/4 (80% useful) — but at least min(W, 32) tokens: below that the tile GEMMs are so small
  // that OpenBLAS's per-call overhead (and its buffer lock, which serialises threads) costs more
  // than the wasted keys (measured at W = 32–64 in docs/benchmarks.md).
  int64_t tile = std::max<int64_t>(8, 256 / std::max<int64_t>(1, p));
  if (window > 0) {
    tile = std::min(tile, std::max<int64_t>({8, window / 4, std::min<int64_t>(window, 32)}));
  }
  return tile;
}

int64_t DefaultBlockTokens(int64_t p, int64_t window, int64_t tile) {
  // Windowed layers: consecutive tiles up to a global tile's ~256 pseudo-tokens are one block
  // (tiles stay small so that few masked keys are computed; blocks make their GEMMs large enough
  // to run near the BLAS rate and to scale across threads). Global layers: one tile per block.
  return window > 0 ? std::max(tile, DefaultTileTokens(p, 0)) : tile;
}

namespace {

// Tokens per tile of a call over n tokens: FusedOptions' choice or the default, at most n.
int64_t TileTokens(const FusedOptions& fused, const Options& o, int64_t n) {
  const int64_t tile = fused.tile_tokens > 0 ? fused.tile_tokens : DefaultTileTokens(o.p, o.window);
  return std::min<int64_t>(tile, std::max<int64_t>(1, n));
}

int64_t BlockTokens(const FusedOptions& fused, const Options& o, int64_t tile) {
  return fused.block_tokens > 0 ? fused.block_tokens : DefaultBlockTokens(o.p, o.window, tile);
}

}  // namespace

torch::Tensor FusedPseudoOutputs(const torch::Tensor& q, const torch::Tensor& k,
                                 const torch::Tensor& v, const torch::Tensor& alpha_q,
                                 const torch::Tensor& alpha_k, const torch::Tensor& alpha_v,
                                 const torch::Tensor& positions, const Options& o,
                                 const FusedOptions& fused) {
  CheckKernelInputs(q, k, v, alpha_q, alpha_k, alpha_v, o);
  TORCH_CHECK(q.is_cpu() && k.is_cpu() && v.is_cpu(),
              "iha fused kernel: CPU tensors only (CUDA tensors take the CUDA kernels)");
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
              "iha fused kernel: q, k and v must share one dtype");
  const int64_t tile = TileTokens(fused, o, q.size(1));
  const auto compute = q.scalar_type() == torch::kFloat64 ? torch::kFloat64 : torch::kFloat32;
  auto [cos, sin] = ExpandedRopeTables(q, positions, o, compute);
  torch::Tensor segments = KernelSegments(o, q.size(0), q.size(1), torch::kCPU);
  return FusedAttentionFunction::apply(q, k, v, alpha_q, alpha_k, alpha_v, cos, sin, segments,
                                       static_cast<int64_t>(o.mask), o.window, o.p,
                                       static_cast<int64_t>(o.score), o.scale, tile,
                                       BlockTokens(fused, o, tile), fused.poison_output);
}

torch::Tensor FusedHeadAttention(const torch::Tensor& q, const torch::Tensor& k,
                                 const torch::Tensor& v, const torch::Tensor& positions,
                                 const Options& o, const FusedOptions& fused) {
  TORCH_CHECK(o.p == 1 && o.mask != Mask::kBlock,
              "fused multi-head attention: P = 1, causal or no mask");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && q.sizes() == k.sizes() &&
                  v.size(0) == q.size(0) && v.size(1) == q.size(1) && v.size(2) == q.size(2),
              "fused multi-head attention: q, k [B, N, H, dk] and v [B, N, H, dv], got ", q.sizes(),
              ", ", k.sizes(), ", ", v.sizes());
  TORCH_CHECK(q.is_cpu() && k.is_cpu() && v.is_cpu(), "fused multi-head attention: CPU tensors");
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
              "fused multi-head attention: q, k and v must share one dtype");
  const int64_t tile = TileTokens(fused, o, q.size(1));
  // Empty alpha tensors: no mixing (autograd's apply needs defined tensors).
  torch::Tensor none = torch::empty({0}, q.options());
  const auto compute = q.scalar_type() == torch::kFloat64 ? torch::kFloat64 : torch::kFloat32;
  auto [cos, sin] = ExpandedRopeTables(q, positions, o, compute);
  torch::Tensor segments = KernelSegments(o, q.size(0), q.size(1), torch::kCPU);
  return FusedAttentionFunction::apply(q, k, v, none, none, none, cos, sin, segments,
                                       static_cast<int64_t>(o.mask), o.window, o.p,
                                       static_cast<int64_t>(o.score), o.scale, tile,
                                       BlockTokens(fused, o, tile), fused.poison_output)
      .squeeze(3);
}

}  // namespace loom::attention::kernels
