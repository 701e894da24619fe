// The CUDA IHA kernels' block programs (FlashAttention-style, iha_cuda.h), written once in plain
// C++ so that both nvcc (iha_cuda_kernels.cu) and the host compiler (the CPU emulator behind
// CudaOptions::emulate, iha_cuda_emulation_test) run the very same code. No LibTorch, no CUDA
// headers.
//
// A block owns one tile of T pseudo rows (T = blockDim.x threads, one row per thread) of one
// (batch row b, head h). Expanded index s = n·P + j is pseudo-token j of token n (iha_core.h).
// Each block program is a sequence of phases; `run(phase)` calls phase(thread) for every thread
// of the block and then waits for all of them (on the GPU: phase(threadIdx.x); __syncthreads()).
// A phase writes only the shared-memory rows its thread owns and reads other threads' rows only
// when they were written in an earlier phase, so the serial emulation is exact.
//
// Shared memory rows have an odd stride (d | 1) so that threads reading "their" rows hit
// different banks. Everything is computed and accumulated in float; inputs are float, bf16 or
// fp16 (IhaBf16 / IhaHalf, bit-compatible with at::BFloat16 / at::Half).
#ifndef LOOM_PLUGINS_ATTENTION_IHA_CUDA_IHA_CUDA_TILES_H_
#define LOOM_PLUGINS_ATTENTION_IHA_CUDA_IHA_CUDA_TILES_H_

#include <math.h>
#include <stdint.h>
#include <string.h>

#ifdef __CUDACC__
#define LOOM_HD __host__ __device__
#else
#define LOOM_HD
#endif

namespace loom::attention::iha::cuda {

// Largest head widths (dk and dv) the kernels take; the glue falls back above it.
constexpr int kMaxHeadDim = 128;

enum IhaMaskKind : int { kIhaMaskInterleaved = 0, kIhaMaskBlock = 1, kIhaMaskNone = 2 };

// ---- element types ------------------------------------------------------------------------

struct IhaBf16 {
  uint16_t bits;
};
struct IhaHalf {
  uint16_t bits;
};

LOOM_HD inline uint32_t IhaFloatBits(float f) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(f);
#else
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  return u;
#endif
}
LOOM_HD inline float IhaBitsFloat(uint32_t u) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(u);
#else
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
#endif
}

LOOM_HD inline float IhaToFloat(float x) { return x; }
LOOM_HD inline float IhaToFloat(IhaBf16 x) {
  return IhaBitsFloat(static_cast<uint32_t>(x.bits) << 16);
}
LOOM_HD inline float IhaToFloat(IhaHalf x) {
  const uint32_t h = x.bits;
  const uint32_t sign = (h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
  if (exp == 0x1f) return IhaBitsFloat(sign | 0x7f800000u | (mant << 13));  // inf, NaN
  if (exp == 0) {
    if (mant == 0) return IhaBitsFloat(sign);
    int e = -1;  // subnormal: normalise
    do {
      ++e;
      mant <<= 1;
    } while ((mant & 0x400u) == 0);
    return IhaBitsFloat(sign | (static_cast<uint32_t>(112 - e) << 23) | ((mant & 0x3ffu) << 13));
  }
  return IhaBitsFloat(sign | ((exp + 112) << 23) | (mant << 13));
}

template <typename T>
LOOM_HD inline T IhaFromFloat(float x);
template <>
LOOM_HD inline float IhaFromFloat<float>(float x) {
  return x;
}
// Round to nearest even, as at::BFloat16 does.
template <>
LOOM_HD inline IhaBf16 IhaFromFloat<IhaBf16>(float x) {
  const uint32_t u = IhaFloatBits(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return IhaBf16{0x7fc0};
  const uint32_t bias = 0x7fffu + ((u >> 16) & 1u);
  return IhaBf16{static_cast<uint16_t>((u + bias) >> 16)};
}
// Round to nearest even, overflow to infinity, subnormals kept (as at::Half).
template <>
LOOM_HD inline IhaHalf IhaFromFloat<IhaHalf>(float x) {
  const uint32_t u = IhaFloatBits(x);
  const uint32_t sign = (u >> 16) & 0x8000u, a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return IhaHalf{static_cast<uint16_t>(sign | 0x7e00u)};   // NaN
  if (a >= 0x47800000u) return IhaHalf{static_cast<uint16_t>(sign | 0x7c00u)};  // >= 2^16: inf
  if (a < 0x38800000u) {  // below 2^-14: a half subnormal (units of 2^-24) or zero
    if (a < 0x33000000u) return IhaHalf{static_cast<uint16_t>(sign)};  // <= 2^-25: zero
    const uint32_t e = a >> 23, m = (a & 0x7fffffu) | 0x800000u, shift = 126 - e;
    uint32_t r = m >> shift;
    const uint32_t rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
    if (rem > half || (rem == half && (r & 1u))) ++r;
    return IhaHalf{static_cast<uint16_t>(sign | r)};
  }
  uint32_t h = (((a >> 23) - 112) << 10) | ((a >> 13) & 0x3ffu);
  const uint32_t rem = a & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;  // a carry may reach inf: correct
  return IhaHalf{static_cast<uint16_t>(sign | h)};
}

// ---- parameters ---------------------------------------------------------------------------

// Raw views of one call. q, k: [B, N, H, dk], v: [B, N, H, dv] with element strides (the last
// dimension contiguous); out, grad_out: contiguous [B, N, H, P, dv]; pseudo-row tensors
// (lse, delta: [B, H, N·P]; dq/dk/dv_pseudo: [B, H, N·P, d]) contiguous float.
struct IhaCudaParams {
  int64_t b = 0, n = 0, h = 0, p = 1, dk = 0, dv = 0;
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  int64_t q_stride_b = 0, q_stride_n = 0, q_stride_h = 0;
  int64_t k_stride_b = 0, k_stride_n = 0, k_stride_h = 0;
  int64_t v_stride_b = 0, v_stride_n = 0, v_stride_h = 0;
  const float* alpha_q = nullptr;  // [H(m), H(h), P], contiguous
  const float* alpha_k = nullptr;
  const float* alpha_v = nullptr;
  // RoPE (null: none): cos/sin [B|1, N·P, dk/2] by expanded index; batch stride 0 = broadcast.
  const float* cos = nullptr;
  const float* sin = nullptr;
  int64_t rope_stride_b = 0;
  // Packed sequences (null: none): segment ids [B|1, N]; batch stride 0 = broadcast.
  const int64_t* segments = nullptr;
  int64_t segments_stride_b = 0;
  int mask = kIhaMaskInterleaved;
  int64_t window = 0;  // tokens; > 0 keeps |s - t| < window·P
  float scale = 1;     // applied to the (rotated) pseudo-queries
  // Forward outputs.
  void* out = nullptr;   // element type of q
  float* lse = nullptr;  // log-sum-exp per pseudo-query; +inf for a row with no allowed key
  // Backward inputs and outputs.
  const float* grad_out = nullptr;  // [B, N, H, P, dv]
  const float* delta = nullptr;     // rowsum(grad_out · out) [B, H, N·P]
  float* dq_pseudo = nullptr;       // gradient of the pseudo-queries before RoPE and scale
  float* dk_pseudo = nullptr;       // gradient of the pseudo-keys before RoPE
  float* dv_pseudo = nullptr;       // gradient of the pseudo-values

  LOOM_HD int64_t Len() const { return n * p; }
  LOOM_HD int64_t Tiles(int tile) const { return (Len() + tile - 1) / tile; }
};

// ---- masks and tile ranges ----------------------------------------------------------------

LOOM_HD inline bool IhaAllowed(const IhaCudaParams& pr, int64_t bi, int64_t s, int64_t t) {
  if (pr.mask == kIhaMaskInterleaved && t > s) return false;
  if (pr.mask == kIhaMaskBlock && t / pr.p > s / pr.p) return false;
  if (pr.window > 0) {
    const int64_t d = s - t;
    if ((d < 0 ? -d : d) >= pr.window * pr.p) return false;
  }
  if (pr.segments != nullptr) {
    const int64_t* seg = pr.segments + bi * pr.segments_stride_b;
    if (seg[s / pr.p] != seg[t / pr.p]) return false;
  }
  return true;
}

// Inclusive expanded-index range [lo, hi] of keys any query of [s0, s1] may see (lo > hi: none).
LOOM_HD inline void IhaKeyRange(const IhaCudaParams& pr, int64_t s0, int64_t s1, int64_t* lo,
                                int64_t* hi) {
  int64_t a = 0, z = pr.Len() - 1;
  if (pr.mask == kIhaMaskInterleaved && s1 < z) z = s1;
  if (pr.mask == kIhaMaskBlock && (s1 / pr.p + 1) * pr.p - 1 < z) z = (s1 / pr.p + 1) * pr.p - 1;
  if (pr.window > 0) {
    const int64_t wp = pr.window * pr.p;
    if (s0 - wp + 1 > a) a = s0 - wp + 1;
    if (s1 + wp - 1 < z) z = s1 + wp - 1;
  }
  *lo = a;
  *hi = z;
}

// Inclusive range of queries that may see any key of [t0, t1].
LOOM_HD inline void IhaQueryRange(const IhaCudaParams& pr, int64_t t0, int64_t t1, int64_t* lo,
                                  int64_t* hi) {
  int64_t a = 0, z = pr.Len() - 1;
  if (pr.mask == kIhaMaskInterleaved && t0 > a) a = t0;
  if (pr.mask == kIhaMaskBlock && (t0 / pr.p) * pr.p > a) a = (t0 / pr.p) * pr.p;
  if (pr.window > 0) {
    const int64_t wp = pr.window * pr.p;
    if (t0 - wp + 1 > a) a = t0 - wp + 1;
    if (t1 + wp - 1 < z) z = t1 + wp - 1;
  }
  *lo = a;
  *hi = z;
}

// ---- mixing and RoPE ----------------------------------------------------------------------

LOOM_HD inline int IhaRowStride(int64_t d) { return static_cast<int>(d | 1); }

// dst[0:d] = sum_m alpha[m, h, j] · x[b, n, m, 0:d] for expanded row s = n·P + j.
template <typename T>
LOOM_HD inline void IhaMixRow(const IhaCudaParams& pr, const void* x_raw, int64_t sb, int64_t sn,
                              int64_t sh, const float* alpha, int64_t d, int64_t bi, int64_t hi,
                              int64_t s, float* dst) {
  const T* x = static_cast<const T*>(x_raw);
  const int64_t n = s / pr.p, j = s % pr.p;
  for (int64_t c = 0; c < d; ++c) dst[c] = 0.f;
  for (int64_t m = 0; m < pr.h; ++m) {
    const float a = alpha[(m * pr.h + hi) * pr.p + j];
    const T* row = x + bi * sb + n * sn + m * sh;
    for (int64_t c = 0; c < d; ++c) dst[c] += a * IhaToFloat(row[c]);
  }
}

// In place: rotate-half RoPE of row s (forward: x·R; backward: g·Rᵀ). The one RoPE on the GPU:
// the device twin of RotateHalfRows, on the tables of ExpandedRopeTables (kernels/rope.h).
LOOM_HD inline void IhaRope(const IhaCudaParams& pr, int64_t bi, int64_t s, float* x,
                            bool backward) {
  if (pr.cos == nullptr) return;
  const int64_t half = pr.dk / 2;
  const float* cs = pr.cos + bi * pr.rope_stride_b + s * half;
  const float* sn = pr.sin + bi * pr.rope_stride_b + s * half;
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = x[i], x2 = x[i + half], c = cs[i], si = backward ? -sn[i] : sn[i];
    x[i] = x1 * c - x2 * si;
    x[i + half] = x2 * c + x1 * si;
  }
}

// ---- shared memory layouts ----------------------------------------------------------------

// Offsets (in floats) of one block's shared arrays; all sized for a tile of T rows.
struct IhaSmem {
  int sdk = 0, sdv = 0, tile = 0;
  int64_t q = 0, k = 0, v = 0, acc = 0, acc2 = 0, dout = 0, scores = 0, m = 0, l = 0, total = 0;
};

// kind 0: forward; 1: backward dK/dV; 2: backward dQ.
LOOM_HD inline IhaSmem IhaSmemLayout(int kind, int64_t dk, int64_t dv, int tile) {
  IhaSmem s;
  s.sdk = IhaRowStride(dk);
  s.sdv = IhaRowStride(dv);
  s.tile = tile;
  int64_t at = 0;
  auto take = [&at](int64_t floats) {
    const int64_t here = at;
    at += floats;
    return here;
  };
  s.q = take(int64_t{tile} * s.sdk);
  s.k = take(int64_t{tile} * s.sdk);
  s.v = take(int64_t{tile} * s.sdv);
  s.m = take(tile);
  s.l = take(tile);
  if (kind == 0) {
    s.acc = take(int64_t{tile} * s.sdv);          // output accumulator
    s.scores = take(int64_t{tile} * (tile + 1));  // one score row per query
  } else if (kind == 1) {
    s.acc = take(int64_t{tile} * s.sdk);   // dK
    s.acc2 = take(int64_t{tile} * s.sdv);  // dV
    s.dout = take(int64_t{tile} * s.sdv);
  } else {
    s.acc = take(int64_t{tile} * s.sdk);  // dQ
    s.dout = take(int64_t{tile} * s.sdv);
  }
  s.total = at;
  return s;
}

LOOM_HD inline int64_t IhaSmemBytes(int kind, int64_t dk, int64_t dv, int tile) {
  return IhaSmemLayout(kind, dk, dv, tile).total * static_cast<int64_t>(sizeof(float));
}

// ---- phases shared by the kernels ---------------------------------------------------------

// Thread r: pseudo-query row s0 + r, mixed, rotated and scaled, into q[r].
template <typename T>
LOOM_HD inline void IhaPhaseLoadQuery(const IhaCudaParams& pr, int64_t bi, int64_t hi, int64_t s0,
                                      float* smem, const IhaSmem& L, int r) {
  const int64_t s = s0 + r;
  if (s >= pr.Len()) return;
  float* q = smem + L.q + int64_t{r} * L.sdk;
  IhaMixRow<T>(pr, pr.q, pr.q_stride_b, pr.q_stride_n, pr.q_stride_h, pr.alpha_q, pr.dk, bi, hi, s,
               q);
  IhaRope(pr, bi, s, q, false);
  for (int64_t c = 0; c < pr.dk; ++c) q[c] *= pr.scale;
}

// Thread t: pseudo-key (rotated) and pseudo-value rows t0 + t into k[t], v[t].
template <typename T>
LOOM_HD inline void IhaPhaseLoadKeyValue(const IhaCudaParams& pr, int64_t bi, int64_t hi,
                                         int64_t t0, float* smem, const IhaSmem& L, int t) {
  const int64_t s = t0 + t;
  if (s >= pr.Len()) return;
  float* k = smem + L.k + int64_t{t} * L.sdk;
  float* v = smem + L.v + int64_t{t} * L.sdv;
  IhaMixRow<T>(pr, pr.k, pr.k_stride_b, pr.k_stride_n, pr.k_stride_h, pr.alpha_k, pr.dk, bi, hi, s,
               k);
  IhaRope(pr, bi, s, k, false);
  IhaMixRow<T>(pr, pr.v, pr.v_stride_b, pr.v_stride_n, pr.v_stride_h, pr.alpha_v, pr.dv, bi, hi, s,
               v);
}

// Thread r: the upstream gradient of output row s0 + r, its lse and delta.
LOOM_HD inline void IhaPhaseLoadGrad(const IhaCudaParams& pr, int64_t bi, int64_t hi, int64_t s0,
                                     float* smem, const IhaSmem& L, int r) {
  const int64_t s = s0 + r;
  if (s >= pr.Len()) return;
  const int64_t n = s / pr.p, j = s % pr.p;
  const float* g = pr.grad_out + (((bi * pr.n + n) * pr.h + hi) * pr.p + j) * pr.dv;
  float* dst = smem + L.dout + int64_t{r} * L.sdv;
  for (int64_t c = 0; c < pr.dv; ++c) dst[c] = g[c];
  const int64_t row = (bi * pr.h + hi) * pr.Len() + s;
  smem[L.m + r] = pr.lse[row];
  smem[L.l + r] = pr.delta[row];
}

LOOM_HD inline float IhaDot(const float* a, const float* b, int64_t d) {
  float acc = 0.f;
  for (int64_t c = 0; c < d; ++c) acc += a[c] * b[c];
  return acc;
}

// ---- forward ------------------------------------------------------------------------------

// Thread r: scores of its query against the key tile at t0, masked, online softmax update of
// (m, l, acc).
LOOM_HD inline void IhaPhaseScoreAndAccumulate(const IhaCudaParams& pr, int64_t bi, int64_t s0,
                                               int64_t t0, float* smem, const IhaSmem& L, int r) {
  const int64_t s = s0 + r;
  if (s >= pr.Len()) return;
  const float* q = smem + L.q + int64_t{r} * L.sdk;
  float* sc = smem + L.scores + int64_t{r} * (L.tile + 1);
  float tile_max = -INFINITY;
  int count = 0;
  for (int c = 0; c < L.tile; ++c) {
    const int64_t t = t0 + c;
    if (t >= pr.Len() || !IhaAllowed(pr, bi, s, t)) {
      sc[c] = -INFINITY;
      continue;
    }
    const float x = IhaDot(q, smem + L.k + int64_t{c} * L.sdk, pr.dk);
    sc[c] = x;
    tile_max = fmaxf(tile_max, x);
    ++count;
  }
  if (count == 0) return;
  const float m_old = smem[L.m + r], m_new = fmaxf(m_old, tile_max);
  const float correction = expf(m_old - m_new);  // m_old = -inf: 0
  float* acc = smem + L.acc + int64_t{r} * L.sdv;
  float sum = 0.f;
  for (int64_t c = 0; c < pr.dv; ++c) acc[c] *= correction;
  for (int c = 0; c < L.tile; ++c) {
    if (sc[c] == -INFINITY) continue;
    const float w = expf(sc[c] - m_new);
    sum += w;
    const float* v = smem + L.v + int64_t{c} * L.sdv;
    for (int64_t e = 0; e < pr.dv; ++e) acc[e] += w * v[e];
  }
  smem[L.l + r] = smem[L.l + r] * correction + sum;
  smem[L.m + r] = m_new;
}

LOOM_HD inline void IhaPhaseInitForward(const IhaSmem& L, float* smem, int r) {
  smem[L.m + r] = -INFINITY;
  smem[L.l + r] = 0.f;
  float* acc = smem + L.acc + int64_t{r} * L.sdv;
  for (int c = 0; c < L.sdv; ++c) acc[c] = 0.f;
}

template <typename T>
LOOM_HD inline void IhaPhaseWriteForward(const IhaCudaParams& pr, int64_t bi, int64_t hi,
                                         int64_t s0, float* smem, const IhaSmem& L, int r) {
  const int64_t s = s0 + r;
  if (s >= pr.Len()) return;
  const float l = smem[L.l + r];
  const float inv = l > 0.f ? 1.f / l : 0.f;
  const float* acc = smem + L.acc + int64_t{r} * L.sdv;
  const int64_t n = s / pr.p, j = s % pr.p;
  T* out = static_cast<T*>(pr.out) + (((bi * pr.n + n) * pr.h + hi) * pr.p + j) * pr.dv;
  for (int64_t c = 0; c < pr.dv; ++c) out[c] = IhaFromFloat<T>(acc[c] * inv);
  pr.lse[(bi * pr.h + hi) * pr.Len() + s] = l > 0.f ? smem[L.m + r] + logf(l) : INFINITY;
}

// Block (query tile qt, batch·head bh) of the forward kernel: out and lse.
template <typename T, typename Run>
LOOM_HD inline void IhaForwardBlock(const IhaCudaParams& pr, int64_t qt, int64_t bh, float* smem,
                                    const IhaSmem& L, const Run& run) {
  const int64_t bi = bh / pr.h, hi = bh % pr.h, s0 = qt * L.tile;
  const int64_t s1 = s0 + L.tile - 1 < pr.Len() - 1 ? s0 + L.tile - 1 : pr.Len() - 1;
  run([&](int r) {
    IhaPhaseInitForward(L, smem, r);
    IhaPhaseLoadQuery<T>(pr, bi, hi, s0, smem, L, r);
  });
  int64_t lo, hi_key;
  IhaKeyRange(pr, s0, s1, &lo, &hi_key);
  if (lo <= hi_key) {
    for (int64_t kt = lo / L.tile; kt <= hi_key / L.tile; ++kt) {
      const int64_t t0 = kt * L.tile;
      run([&](int t) { IhaPhaseLoadKeyValue<T>(pr, bi, hi, t0, smem, L, t); });
      run([&](int r) { IhaPhaseScoreAndAccumulate(pr, bi, s0, t0, smem, L, r); });
    }
  }
  run([&](int r) { IhaPhaseWriteForward<T>(pr, bi, hi, s0, smem, L, r); });
}

// ---- backward: dK and dV ------------------------------------------------------------------

// Thread t (key row t0 + t): for every query of the tile at s0, recompute p = exp(s - lse),
// dV += p·dO, dK += dS·q with dS = p·(dO·v - delta).
LOOM_HD inline void IhaPhaseAccumulateKeyGrads(const IhaCudaParams& pr, int64_t bi, int64_t s0,
                                               int64_t t0, float* smem, const IhaSmem& L, int t) {
  const int64_t key = t0 + t;
  if (key >= pr.Len()) return;
  const float* k = smem + L.k + int64_t{t} * L.sdk;
  const float* v = smem + L.v + int64_t{t} * L.sdv;
  float* dk = smem + L.acc + int64_t{t} * L.sdk;
  float* dv = smem + L.acc2 + int64_t{t} * L.sdv;
  for (int r = 0; r < L.tile; ++r) {
    const int64_t s = s0 + r;
    if (s >= pr.Len()) break;
    if (!IhaAllowed(pr, bi, s, key)) continue;
    const float* q = smem + L.q + int64_t{r} * L.sdk;
    const float* dout = smem + L.dout + int64_t{r} * L.sdv;
    const float w = expf(IhaDot(q, k, pr.dk) - smem[L.m + r]);
    const float ds = w * (IhaDot(dout, v, pr.dv) - smem[L.l + r]);
    for (int64_t c = 0; c < pr.dv; ++c) dv[c] += w * dout[c];
    for (int64_t c = 0; c < pr.dk; ++c) dk[c] += ds * q[c];
  }
}

template <typename T, typename Run>
LOOM_HD inline void IhaBackwardKeyBlock(const IhaCudaParams& pr, int64_t kt, int64_t bh,
                                        float* smem, const IhaSmem& L, const Run& run) {
  const int64_t bi = bh / pr.h, hi = bh % pr.h, t0 = kt * L.tile;
  const int64_t t1 = t0 + L.tile - 1 < pr.Len() - 1 ? t0 + L.tile - 1 : pr.Len() - 1;
  run([&](int t) {
    IhaPhaseLoadKeyValue<T>(pr, bi, hi, t0, smem, L, t);
    float* dk = smem + L.acc + int64_t{t} * L.sdk;
    float* dv = smem + L.acc2 + int64_t{t} * L.sdv;
    for (int c = 0; c < L.sdk; ++c) dk[c] = 0.f;
    for (int c = 0; c < L.sdv; ++c) dv[c] = 0.f;
  });
  int64_t lo, hi_query;
  IhaQueryRange(pr, t0, t1, &lo, &hi_query);
  if (lo <= hi_query) {
    for (int64_t qt = lo / L.tile; qt <= hi_query / L.tile; ++qt) {
      const int64_t s0 = qt * L.tile;
      run([&](int r) {
        IhaPhaseLoadQuery<T>(pr, bi, hi, s0, smem, L, r);
        IhaPhaseLoadGrad(pr, bi, hi, s0, smem, L, r);
      });
      run([&](int t) { IhaPhaseAccumulateKeyGrads(pr, bi, s0, t0, smem, L, t); });
    }
  }
  run([&](int t) {
    const int64_t key = t0 + t;
    if (key >= pr.Len()) return;
    float* dk = smem + L.acc + int64_t{t} * L.sdk;
    const float* dv = smem + L.acc2 + int64_t{t} * L.sdv;
    IhaRope(pr, bi, key, dk, true);
    const int64_t row = (bi * pr.h + hi) * pr.Len() + key;
    for (int64_t c = 0; c < pr.dk; ++c) pr.dk_pseudo[row * pr.dk + c] = dk[c];
    for (int64_t c = 0; c < pr.dv; ++c) pr.dv_pseudo[row * pr.dv + c] = dv[c];
  });
}

// ---- backward: dQ -------------------------------------------------------------------------

// Thread r (query row s0 + r): dQ += dS·k over the key tile at t0.
LOOM_HD inline void IhaPhaseAccumulateQueryGrads(const IhaCudaParams& pr, int64_t bi, int64_t s0,
                                                 int64_t t0, float* smem, const IhaSmem& L, int r) {
  const int64_t s = s0 + r;
  if (s >= pr.Len()) return;
  const float* q = smem + L.q + int64_t{r} * L.sdk;
  const float* dout = smem + L.dout + int64_t{r} * L.sdv;
  float* dq = smem + L.acc + int64_t{r} * L.sdk;
  const float lse = smem[L.m + r], delta = smem[L.l + r];
  for (int c = 0; c < L.tile; ++c) {
    const int64_t t = t0 + c;
    if (t >= pr.Len()) break;
    if (!IhaAllowed(pr, bi, s, t)) continue;
    const float* k = smem + L.k + int64_t{c} * L.sdk;
    const float* v = smem + L.v + int64_t{c} * L.sdv;
    const float w = expf(IhaDot(q, k, pr.dk) - lse);
    const float ds = w * (IhaDot(dout, v, pr.dv) - delta);
    for (int64_t e = 0; e < pr.dk; ++e) dq[e] += ds * k[e];
  }
}

template <typename T, typename Run>
LOOM_HD inline void IhaBackwardQueryBlock(const IhaCudaParams& pr, int64_t qt, int64_t bh,
                                          float* smem, const IhaSmem& L, const Run& run) {
  const int64_t bi = bh / pr.h, hi = bh % pr.h, s0 = qt * L.tile;
  const int64_t s1 = s0 + L.tile - 1 < pr.Len() - 1 ? s0 + L.tile - 1 : pr.Len() - 1;
  run([&](int r) {
    IhaPhaseLoadQuery<T>(pr, bi, hi, s0, smem, L, r);
    IhaPhaseLoadGrad(pr, bi, hi, s0, smem, L, r);
    float* dq = smem + L.acc + int64_t{r} * L.sdk;
    for (int c = 0; c < L.sdk; ++c) dq[c] = 0.f;
  });
  int64_t lo, hi_key;
  IhaKeyRange(pr, s0, s1, &lo, &hi_key);
  if (lo <= hi_key) {
    for (int64_t kt = lo / L.tile; kt <= hi_key / L.tile; ++kt) {
      const int64_t t0 = kt * L.tile;
      run([&](int t) { IhaPhaseLoadKeyValue<T>(pr, bi, hi, t0, smem, L, t); });
      run([&](int r) { IhaPhaseAccumulateQueryGrads(pr, bi, s0, t0, smem, L, r); });
    }
  }
  run([&](int r) {
    const int64_t s = s0 + r;
    if (s >= pr.Len()) return;
    float* dq = smem + L.acc + int64_t{r} * L.sdk;
    for (int64_t c = 0; c < pr.dk; ++c) dq[c] *= pr.scale;
    IhaRope(pr, bi, s, dq, true);
    const int64_t row = (bi * pr.h + hi) * pr.Len() + s;
    for (int64_t c = 0; c < pr.dk; ++c) pr.dq_pseudo[row * pr.dk + c] = dq[c];
  });
}

}  // namespace loom::attention::iha::cuda

#endif  // LOOM_PLUGINS_ATTENTION_IHA_CUDA_IHA_CUDA_TILES_H_
