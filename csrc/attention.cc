// Training self-attention over packed rows without the score matrix: flash attention's blocking
// on CPU, forward and backward.
//
// q (B, T, H, D), k and v (B, T, KV, D), f32 or bf16, H a multiple of KV (GQA); positions (B, T)
// and segment ids (B, T) int32. Query t sees key s when 0 <= pos[s] <= pos[t] (and
// pos[t] - pos[s] < window on sliding layers) and, with segments, seg[s] == seg[t] or seg[s] is the
// shared prefix of seg[t]'s group: seg[t] > 0 and seg[s] == -(seg[t] >> 16) - 1 (PrefixOf), the rule
// of ops/attention.py's attention_mask. Scores are
// (q . k) * scale, soft-capped as tanh(s / cap) * cap when cap > 0, softmaxed in f32. A query that
// sees no key averages every value uniformly, as the reference's softmax over equal scores does.
//
// Work runs in tiles: kQTile queries (times the group's H / KV heads, as rows) against kKBlock
// keys; a (tile, block) pair with no visible (query, key) pair is skipped, which is most of them
// for packed rows, whose examples never see each other. The forward keeps a running max and sum
// per row (online softmax) and returns the output and each row's log-sum-exp. The backward
// recomputes the probabilities from the log-sum-exp, once per key block (dK, dV) and once per
// query tile (dQ), so no task writes where another does. Positions and segment ids are only ever
// compared, never used as indices. The products run on the shared f32 GEMM; the per-row work
// (visibility bits, masked max, exp and sums, the softmax gradient) has scalar, AVX2 and AVX-512
// versions. Queries are pre-scaled, so the scores are q' . k with q' = q * scale.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "cpu_features.h"
#include "ffi_common.h"
#include "gemm_f32.h"
#include "parallel.h"

#include "isa.h"

namespace tunix_rt {
namespace {

constexpr int64_t kQTile = 32;   // queries per tile
constexpr int64_t kKBlock = 64;  // keys per block
constexpr float kInf = std::numeric_limits<float>::infinity();

struct Shape {
  int64_t b, t, h, kv, d;
  int64_t g() const { return h / kv; }
};

struct MaskRule {
  const int32_t* pos;
  const int32_t* seg;  // nullptr: no segment rule
  int64_t window;      // 0: none
};

// ---- row kernels per ISA tier -------------------------------------------------------------------
// A key block's visibility for one query is a 64-bit word (bit j: key j of the block), so rows
// need no byte masks and the SIMD tiers turn 16 (or 8) bits straight into lane masks. Score rows
// are kKBlock floats wide: kernels may touch all of them, the bits say which count.

struct RowKernels {
  // bits of keys [k0, k0 + ns) (flat indices) visible to query qi
  uint64_t (*visible)(const MaskRule& m, int64_t qi, int64_t k0, int64_t ns);
  float (*masked_max)(const float* s, uint64_t bits);
  // s[j] = exp(s[j] - sub) where bit j is set, else 0; returns their sum
  float (*exp_sum)(float* s, uint64_t bits, float sub);
  // p[j] = exp(p[j] - lse) where bit j is set, else 0; ds[j] = p[j] * (ds[j] - dsum)
  void (*softmax_grad)(float* p, float* ds, uint64_t bits, float lse, float dsum);
};

// The segment id of the shared prefix a positive segment's group sees: group seg >> 16 has prefix -(group + 1).
inline int32_t PrefixOf(int32_t seg) { return -(seg >> 16) - 1; }

bool VisibleScalar(const MaskRule& m, int64_t qi, int64_t ki) {
  const int32_t qp = m.pos[qi], kp = m.pos[ki];
  if (kp < 0 || kp > qp) return false;
  if (m.window > 0 && static_cast<int64_t>(qp) - kp >= m.window) return false;
  if (m.seg == nullptr) return true;
  const int32_t sq = m.seg[qi], sk = m.seg[ki];
  return sq == sk || (sq > 0 && sk == PrefixOf(sq));
}

uint64_t VisibleBitsScalar(const MaskRule& m, int64_t qi, int64_t k0, int64_t ns) {
  uint64_t bits = 0;
  for (int64_t j = 0; j < ns; ++j) bits |= static_cast<uint64_t>(VisibleScalar(m, qi, k0 + j)) << j;
  return bits;
}

float MaskedMaxScalar(const float* s, uint64_t bits) {
  float m = -kInf;
  for (int j = 0; j < kKBlock; ++j)
    if (bits >> j & 1) m = std::max(m, s[j]);
  return m;
}

float ExpSumScalar(float* s, uint64_t bits, float sub) {
  float sum = 0.0f;
  for (int j = 0; j < kKBlock; ++j) {
    s[j] = bits >> j & 1 ? std::exp(s[j] - sub) : 0.0f;
    sum += s[j];
  }
  return sum;
}

void SoftmaxGradScalar(float* p, float* ds, uint64_t bits, float lse, float dsum) {
  for (int j = 0; j < kKBlock; ++j) {
    p[j] = bits >> j & 1 ? std::exp(p[j] - lse) : 0.0f;
    ds[j] = p[j] * (ds[j] - dsum);
  }
}

#ifdef TUNIX_RT_X86

// 8 bits as an all-ones / zero lane mask
AVX2_FN inline __m256 LaneMask8(uint64_t bits) {
  const __m256i lanes = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  const __m256i b = _mm256_set1_epi32(static_cast<int>(bits & 0xff));
  return _mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_and_si256(b, lanes), lanes));
}

AVX2_FN float MaskedMaxAvx2(const float* s, uint64_t bits) {
  __m256 m = _mm256_set1_ps(-kInf);
  for (int j = 0; j < kKBlock; j += 8)
    m = _mm256_max_ps(m, _mm256_blendv_ps(_mm256_set1_ps(-kInf), _mm256_loadu_ps(s + j), LaneMask8(bits >> j)));
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_max_ss(h, _mm_shuffle_ps(h, h, 1)));
}

AVX2_FN float ExpSumAvx2(float* s, uint64_t bits, float sub) {
  __m256 sum = _mm256_setzero_ps();
  for (int j = 0; j < kKBlock; j += 8) {
    const __m256 e = _mm256_and_ps(Exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), _mm256_set1_ps(sub))),
                                   LaneMask8(bits >> j));
    _mm256_storeu_ps(s + j, e);
    sum = _mm256_add_ps(sum, e);
  }
  return HSum8(sum);
}

AVX2_FN void SoftmaxGradAvx2(float* p, float* ds, uint64_t bits, float lse, float dsum) {
  for (int j = 0; j < kKBlock; j += 8) {
    const __m256 e = _mm256_and_ps(Exp8(_mm256_sub_ps(_mm256_loadu_ps(p + j), _mm256_set1_ps(lse))),
                                   LaneMask8(bits >> j));
    _mm256_storeu_ps(p + j, e);
    _mm256_storeu_ps(ds + j, _mm256_mul_ps(e, _mm256_sub_ps(_mm256_loadu_ps(ds + j), _mm256_set1_ps(dsum))));
  }
}

AVX512_FN uint64_t VisibleBitsAvx512(const MaskRule& m, int64_t qi, int64_t k0, int64_t ns) {
  const __m512i qp = _mm512_set1_epi32(m.pos[qi]), zero = _mm512_setzero_si512();
  const int32_t sq_id = m.seg != nullptr ? m.seg[qi] : 0;
  const __m512i sq = _mm512_set1_epi32(sq_id), prefix = _mm512_set1_epi32(PrefixOf(sq_id));
  uint64_t bits = 0;
  for (int64_t j = 0; j < ns; j += 16) {
    const __mmask16 live = static_cast<__mmask16>(ns - j >= 16 ? 0xffff : (1u << (ns - j)) - 1);
    const __m512i kp = _mm512_maskz_loadu_epi32(live, m.pos + k0 + j);
    __mmask16 v = live & _mm512_cmpge_epi32_mask(kp, zero) & _mm512_cmple_epi32_mask(kp, qp);
    if (m.window > 0 && m.window <= INT32_MAX)  // 0 <= kp <= qp: qp - kp cannot overflow where it counts
      v &= _mm512_cmplt_epi32_mask(_mm512_sub_epi32(qp, kp), _mm512_set1_epi32(static_cast<int32_t>(m.window)));
    if (m.seg != nullptr) {
      const __m512i sk = _mm512_maskz_loadu_epi32(live, m.seg + k0 + j);
      __mmask16 same = _mm512_cmpeq_epi32_mask(sk, sq);
      if (sq_id > 0) same |= _mm512_cmpeq_epi32_mask(sk, prefix);
      v &= same;
    }
    bits |= static_cast<uint64_t>(v) << j;
  }
  return bits;
}

AVX512_FN float MaskedMaxAvx512(const float* s, uint64_t bits) {
  __m512 m = _mm512_set1_ps(-kInf);
  for (int j = 0; j < kKBlock; j += 16)
    m = _mm512_mask_max_ps(m, static_cast<__mmask16>(bits >> j), m, _mm512_loadu_ps(s + j));
  return _mm512_reduce_max_ps(m);
}

AVX512_FN float ExpSumAvx512(float* s, uint64_t bits, float sub) {
  __m512 sum = _mm512_setzero_ps();
  for (int j = 0; j < kKBlock; j += 16) {
    const __m512 e = _mm512_maskz_mov_ps(static_cast<__mmask16>(bits >> j),
                                         Exp16(_mm512_sub_ps(_mm512_loadu_ps(s + j), _mm512_set1_ps(sub))));
    _mm512_storeu_ps(s + j, e);
    sum = _mm512_add_ps(sum, e);
  }
  return _mm512_reduce_add_ps(sum);
}

AVX512_FN void SoftmaxGradAvx512(float* p, float* ds, uint64_t bits, float lse, float dsum) {
  for (int j = 0; j < kKBlock; j += 16) {
    const __m512 e = _mm512_maskz_mov_ps(static_cast<__mmask16>(bits >> j),
                                         Exp16(_mm512_sub_ps(_mm512_loadu_ps(p + j), _mm512_set1_ps(lse))));
    _mm512_storeu_ps(p + j, e);
    _mm512_storeu_ps(ds + j, _mm512_mul_ps(e, _mm512_sub_ps(_mm512_loadu_ps(ds + j), _mm512_set1_ps(dsum))));
  }
}
#endif

const RowKernels& Rows() {
  static const RowKernels kernels = [] {
#ifdef TUNIX_RT_X86
    if (isa_level() >= IsaLevel::kAvx512)
      return RowKernels{VisibleBitsAvx512, MaskedMaxAvx512, ExpSumAvx512, SoftmaxGradAvx512};
    if (isa_level() >= IsaLevel::kAvx2)
      return RowKernels{VisibleBitsScalar, MaskedMaxAvx2, ExpSumAvx2, SoftmaxGradAvx2};
#endif
    return RowKernels{VisibleBitsScalar, MaskedMaxScalar, ExpSumScalar, SoftmaxGradScalar};
  }();
  return kernels;
}

// The visibility of queries [t0, t0 + nq) against keys [s0, s0 + ns) of batch row b, one word per
// query; returns whether any pair is visible.
bool TileMask(const MaskRule& m, const Shape& sh, int64_t b, int64_t t0, int64_t nq, int64_t s0, int64_t ns,
              uint64_t* vis) {
  const RowKernels& rk = Rows();
  uint64_t any = 0;
  for (int64_t i = 0; i < nq; ++i) any |= vis[i] = rk.visible(m, b * sh.t + t0 + i, b * sh.t + s0, ns);
  return any != 0;
}

// Element (b, t, head, :) of a (B, T, heads, D) buffer, widened to f32 into out[0, D).
void LoadRow(const void* data, bool bf16, const Shape& sh, int64_t heads, int64_t b, int64_t t, int64_t head,
             float* out) {
  const int64_t at = ((b * sh.t + t) * heads + head) * sh.d;
  if (!bf16) {
    std::copy_n(static_cast<const float*>(data) + at, sh.d, out);
    return;
  }
  const uint16_t* src = static_cast<const uint16_t*>(data) + at;
  for (int64_t i = 0; i < sh.d; ++i) out[i] = Bf16ToF32(src[i]);
}

void StoreRow(void* data, bool bf16, const Shape& sh, int64_t heads, int64_t b, int64_t t, int64_t head,
              const float* in) {
  const int64_t at = ((b * sh.t + t) * heads + head) * sh.d;
  if (!bf16) {
    std::copy_n(in, sh.d, static_cast<float*>(data) + at);
    return;
  }
  uint16_t* dst = static_cast<uint16_t*>(data) + at;
  for (int64_t i = 0; i < sh.d; ++i) dst[i] = F32ToBf16(in[i]);
}

// Rows of a query tile: row r = gi * nq + i is query t0 + i of head kvh * G + gi.
void LoadTile(const void* data, bool bf16, const Shape& sh, int64_t b, int64_t kvh, int64_t t0, int64_t nq,
              float* out) {
  const int64_t g = sh.g();
  for (int64_t gi = 0; gi < g; ++gi)
    for (int64_t i = 0; i < nq; ++i) LoadRow(data, bf16, sh, sh.h, b, t0 + i, kvh * g + gi, out + (gi * nq + i) * sh.d);
}

// Keys [s0, s0 + ns) of kv head kvh, row-major (ns, D).
void LoadBlock(const void* data, bool bf16, const Shape& sh, int64_t b, int64_t kvh, int64_t s0, int64_t ns,
               float* out) {
  for (int64_t j = 0; j < ns; ++j) LoadRow(data, bf16, sh, sh.kv, b, s0 + j, kvh, out + j * sh.d);
}

struct Params {
  float scale, softcap;
};

// Rows of a query tile times `scale` (see LoadTile).
void LoadScaledTile(const void* data, bool bf16, const Shape& sh, int64_t b, int64_t kvh, int64_t t0, int64_t nq,
                    float scale, float* out) {
  LoadTile(data, bf16, sh, b, kvh, t0, nq, out);
  for (int64_t i = 0; i < sh.g() * nq * sh.d; ++i) out[i] *= scale;
}

// s (rows x ns, row stride kKBlock) = q' @ k_block^T, soft-capped when cap > 0 (the backward reads
// tanh(x / cap) back as s / cap).
void Scores(const Params& p, const float* qt, int64_t rows, const float* kb, int64_t ns, int64_t d, float* s) {
  for (int64_t r = 0; r < rows; ++r) std::fill_n(s + r * kKBlock, ns, 0.0f);
  GemmAccumulate({qt, d, 1}, {kb, 1, d}, rows, ns, d, s, kKBlock);
  if (p.softcap > 0)
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t j = 0; j < ns; ++j) s[r * kKBlock + j] = std::tanh(s[r * kKBlock + j] / p.softcap) * p.softcap;
}

struct Buffers {
  const void *q, *k, *v;
  bool q_bf16, kv_bf16;
};

int64_t Tiles(const Shape& sh) { return (sh.t + kQTile - 1) / kQTile; }
int64_t Blocks(const Shape& sh) { return (sh.t + kKBlock - 1) / kKBlock; }

// ---- forward ------------------------------------------------------------------------------------

ffi::Error ForwardTile(const Buffers& in, const MaskRule& mask, const Params& p, const Shape& sh, int64_t task,
                       void* out, bool out_bf16, float* lse) {
  const RowKernels& rk = Rows();
  const int64_t b = task / (sh.kv * Tiles(sh)), kvh = task / Tiles(sh) % sh.kv, t0 = task % Tiles(sh) * kQTile;
  const int64_t nq = std::min(kQTile, sh.t - t0), g = sh.g(), rows = g * nq, d = sh.d;
  std::vector<float> qt(rows * d), kb(kKBlock * d), vb(kKBlock * d), s(rows * kKBlock), acc(rows * d, 0.0f);
  std::vector<float> mx(rows, -kInf), sum(rows, 0.0f);
  uint64_t vis[kQTile], seen[kQTile] = {};  // seen: the keys a query row saw at all (not sum > 0: NaN)
  LoadScaledTile(in.q, in.q_bf16, sh, b, kvh, t0, nq, p.scale, qt.data());
  for (int64_t s0 = 0; s0 < sh.t; s0 += kKBlock) {
    const int64_t ns = std::min(kKBlock, sh.t - s0);
    if (!TileMask(mask, sh, b, t0, nq, s0, ns, vis)) continue;
    for (int64_t i = 0; i < nq; ++i) seen[i] |= vis[i];
    LoadBlock(in.k, in.kv_bf16, sh, b, kvh, s0, ns, kb.data());
    LoadBlock(in.v, in.kv_bf16, sh, b, kvh, s0, ns, vb.data());
    Scores(p, qt.data(), rows, kb.data(), ns, d, s.data());
    for (int64_t r = 0; r < rows; ++r) {  // online softmax: rescale what came before to the new max
      const uint64_t bits = vis[r % nq];
      float* sr = s.data() + r * kKBlock;
      const float m = bits ? std::max(mx[r], rk.masked_max(sr, bits)) : mx[r];
      const float correction = mx[r] == -kInf ? 0.0f : std::exp(mx[r] - m);
      sum[r] = sum[r] * correction + (bits ? rk.exp_sum(sr, bits, m) : 0.0f);
      if (!bits) std::fill_n(sr, kKBlock, 0.0f);
      mx[r] = m;
      if (correction != 1.0f)
        for (int64_t i = 0; i < d; ++i) acc[r * d + i] *= correction;
    }
    GemmAccumulate({s.data(), kKBlock, 1}, {vb.data(), d, 1}, rows, d, ns, acc.data(), d);
  }
  std::vector<float> mean;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t head = kvh * g + r / nq, t = t0 + r % nq;
    float* ar = acc.data() + r * d;
    float* lse_at = lse + (b * sh.t + t) * sh.h + head;
    if (seen[r % nq]) {
      const float inv = 1.0f / sum[r];
      for (int64_t i = 0; i < d; ++i) ar[i] *= inv;
      *lse_at = mx[r] + std::log(sum[r]);
    } else {  // no visible key: the uniform average of every value; +inf marks the row for the backward
      if (mean.empty()) {
        mean.assign(d, 0.0f);
        std::vector<float> row(d);
        for (int64_t j = 0; j < sh.t; ++j) {
          LoadRow(in.v, in.kv_bf16, sh, sh.kv, b, j, kvh, row.data());
          for (int64_t i = 0; i < d; ++i) mean[i] += row[i];
        }
        for (int64_t i = 0; i < d; ++i) mean[i] /= static_cast<float>(sh.t);
      }
      std::copy_n(mean.data(), d, ar);
      *lse_at = kInf;
    }
    StoreRow(out, out_bf16, sh, sh.h, b, t, head, ar);
  }
  return ffi::Error::Success();
}

// ---- backward -----------------------------------------------------------------------------------

// What the backward of a query tile reads: q' (scaled) and dO rows, each row's log-sum-exp and
// D = rowsum(dO * O) (the caller's, from the unrounded output: a bf16 O would put its rounding into
// every score gradient, dS = P (dP - D), where one key takes all the mass and dS should vanish).
struct TileGrad {
  std::vector<float> qt, dot, lse, dsum;
};

void LoadGradTile(const Buffers& in, const void* dout, const float* lse, const float* dsum, const Params& p,
                  const Shape& sh, int64_t b, int64_t kvh, int64_t t0, int64_t nq, TileGrad* tg) {
  const int64_t g = sh.g(), rows = g * nq, d = sh.d;
  tg->qt.resize(rows * d);
  tg->dot.resize(rows * d);
  tg->lse.resize(rows);
  tg->dsum.resize(rows);
  LoadScaledTile(in.q, in.q_bf16, sh, b, kvh, t0, nq, p.scale, tg->qt.data());
  LoadTile(dout, in.q_bf16, sh, b, kvh, t0, nq, tg->dot.data());
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t at = (b * sh.t + t0 + r % nq) * sh.h + kvh * g + r / nq;
    tg->lse[r] = lse[at];
    tg->dsum[r] = dsum[at];
  }
}

// For one (tile, block) pair: prob = the probabilities and ds = dL/dx for the scores x = q' . k
// (rows x ns, stride kKBlock), recomputed from the log-sum-exp. Rows that see no key at all have
// prob = 0 here (their uniform average is the caller's) and no score gradient.
void ProbsAndGrads(const Params& p, const TileGrad& tg, const uint64_t* vis, int64_t nq, int64_t rows, const float* kb,
                   const float* vb, int64_t ns, int64_t d, float* prob, float* ds) {
  const RowKernels& rk = Rows();
  Scores(p, tg.qt.data(), rows, kb, ns, d, prob);
  for (int64_t r = 0; r < rows; ++r) std::fill_n(ds + r * kKBlock, ns, 0.0f);
  GemmAccumulate({tg.dot.data(), d, 1}, {vb, 1, d}, rows, ns, d, ds, kKBlock);  // dP = dO @ v^T
  for (int64_t r = 0; r < rows; ++r) {
    float* pr = prob + r * kKBlock;
    float* dr = ds + r * kKBlock;
    const uint64_t bits = tg.lse[r] == kInf ? 0 : vis[r % nq];
    float cap_grad[kKBlock];  // d capped / d x = 1 - tanh(x / cap)^2, read before pr turns into probabilities
    if (p.softcap > 0)
      for (int64_t j = 0; j < ns; ++j) cap_grad[j] = 1.0f - (pr[j] / p.softcap) * (pr[j] / p.softcap);
    rk.softmax_grad(pr, dr, bits, tg.lse[r], tg.dsum[r]);
    if (p.softcap > 0)
      for (int64_t j = 0; j < ns; ++j) dr[j] *= cap_grad[j];
  }
}

struct GradOut {
  void *dq, *dk, *dv;
};

// dK and dV of key block `task` (over every query tile that sees it).
ffi::Error BackwardKeys(const Buffers& in, const void* dout, const float* lse, const float* dsum, const MaskRule& mask,
                        const Params& p, const Shape& sh, int64_t task, const GradOut& g_out) {
  const int64_t b = task / (sh.kv * Blocks(sh)), kvh = task / Blocks(sh) % sh.kv, s0 = task % Blocks(sh) * kKBlock;
  const int64_t ns = std::min(kKBlock, sh.t - s0), g = sh.g(), d = sh.d;
  std::vector<float> kb(ns * d), vb(ns * d), dk(ns * d, 0.0f), dv(ns * d, 0.0f);
  std::vector<float> prob(g * kQTile * kKBlock), ds(g * kQTile * kKBlock);
  uint64_t vis[kQTile];
  LoadBlock(in.k, in.kv_bf16, sh, b, kvh, s0, ns, kb.data());
  LoadBlock(in.v, in.kv_bf16, sh, b, kvh, s0, ns, vb.data());
  TileGrad tg;
  for (int64_t tile = 0; tile < Tiles(sh); ++tile) {
    const int64_t t0 = tile * kQTile, nq = std::min(kQTile, sh.t - t0), rows = g * nq;
    const bool any = TileMask(mask, sh, b, t0, nq, s0, ns, vis);
    bool uniform = false;  // a row that sees no key at all spreads dO / T over every value
    for (int64_t i = 0; i < nq && !uniform; ++i)
      for (int64_t gi = 0; gi < g && !uniform; ++gi) uniform = lse[(b * sh.t + t0 + i) * sh.h + kvh * g + gi] == kInf;
    if (!any && !uniform) continue;
    LoadGradTile(in, dout, lse, dsum, p, sh, b, kvh, t0, nq, &tg);
    if (any) {
      ProbsAndGrads(p, tg, vis, nq, rows, kb.data(), vb.data(), ns, d, prob.data(), ds.data());
      GemmAccumulate({prob.data(), 1, kKBlock}, {tg.dot.data(), d, 1}, ns, d, rows, dv.data(), d);
      GemmAccumulate({ds.data(), 1, kKBlock}, {tg.qt.data(), d, 1}, ns, d, rows, dk.data(), d);  // dK = dS^T q'
    }
    if (uniform)
      for (int64_t r = 0; r < rows; ++r) {
        if (tg.lse[r] != kInf) continue;
        const float w = 1.0f / static_cast<float>(sh.t);
        for (int64_t j = 0; j < ns; ++j)
          for (int64_t i = 0; i < d; ++i) dv[j * d + i] += w * tg.dot[r * d + i];
      }
  }
  for (int64_t j = 0; j < ns; ++j) {
    StoreRow(g_out.dk, in.kv_bf16, sh, sh.kv, b, s0 + j, kvh, dk.data() + j * d);
    StoreRow(g_out.dv, in.kv_bf16, sh, sh.kv, b, s0 + j, kvh, dv.data() + j * d);
  }
  return ffi::Error::Success();
}

// dQ of query tile `task` (over every key block it sees): scale * dS @ k.
ffi::Error BackwardQueries(const Buffers& in, const void* dout, const float* lse, const float* dsum,
                           const MaskRule& mask, const Params& p, const Shape& sh, int64_t task, const GradOut& g_out) {
  const int64_t b = task / (sh.kv * Tiles(sh)), kvh = task / Tiles(sh) % sh.kv, t0 = task % Tiles(sh) * kQTile;
  const int64_t nq = std::min(kQTile, sh.t - t0), g = sh.g(), rows = g * nq, d = sh.d;
  std::vector<float> kb(kKBlock * d), vb(kKBlock * d), dq(rows * d, 0.0f), prob(rows * kKBlock), ds(rows * kKBlock);
  uint64_t vis[kQTile];
  TileGrad tg;
  LoadGradTile(in, dout, lse, dsum, p, sh, b, kvh, t0, nq, &tg);
  for (int64_t s0 = 0; s0 < sh.t; s0 += kKBlock) {
    const int64_t ns = std::min(kKBlock, sh.t - s0);
    if (!TileMask(mask, sh, b, t0, nq, s0, ns, vis)) continue;
    LoadBlock(in.k, in.kv_bf16, sh, b, kvh, s0, ns, kb.data());
    LoadBlock(in.v, in.kv_bf16, sh, b, kvh, s0, ns, vb.data());
    ProbsAndGrads(p, tg, vis, nq, rows, kb.data(), vb.data(), ns, d, prob.data(), ds.data());
    GemmAccumulate({ds.data(), kKBlock, 1}, {kb.data(), d, 1}, rows, d, ns, dq.data(), d);
  }
  for (int64_t r = 0; r < rows; ++r) {
    float* dr = dq.data() + r * d;
    for (int64_t i = 0; i < d; ++i) dr[i] *= p.scale;
    StoreRow(g_out.dq, in.q_bf16, sh, sh.h, b, t0 + r % nq, kvh * g + r / nq, dr);
  }
  return ffi::Error::Success();
}

// ---- handlers -----------------------------------------------------------------------------------

ffi::Error CheckInputs(const ffi::AnyBuffer& q, const ffi::AnyBuffer& k, const ffi::AnyBuffer& v,
                       const ffi::AnyBuffer& pos, const ffi::AnyBuffer& seg, Shape* sh) {
  const auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || vd.size() != 4)
    return InvalidArgument("attention: q, k and v must be (B, T, heads, D)");
  if (!IsF32OrBf16(q.element_type()) || !IsF32OrBf16(k.element_type()) || k.element_type() != v.element_type())
    return InvalidArgument("attention: q, k, v must be f32 or bf16, k and v of one dtype");
  for (size_t i = 0; i < 4; ++i)
    if (kd[i] != vd[i]) return InvalidArgument("attention: k and v shapes differ");
  if (kd[0] != qd[0] || kd[1] != qd[1] || kd[3] != qd[3] || kd[2] < 1 || qd[2] % kd[2] != 0)
    return InvalidArgument("attention: k must be (B, T, KV, D) with q's B, T, D and KV dividing q's heads");
  for (const ffi::AnyBuffer* ids : {&pos, &seg}) {
    const auto dd = ids->dimensions();
    if (ids->element_type() != ffi::DataType::S32 || dd.size() != 2 || dd[0] != qd[0] || dd[1] != qd[1])
      return InvalidArgument("attention: positions and segment ids must be int32 (B, T)");
  }
  *sh = Shape{qd[0], qd[1], qd[2], kd[2], qd[3]};
  return ffi::Error::Success();
}

MaskRule MakeMask(const ffi::AnyBuffer& pos, const ffi::AnyBuffer& seg, bool segments, int64_t window) {
  return MaskRule{static_cast<const int32_t*>(pos.untyped_data()),
                  segments ? static_cast<const int32_t*>(seg.untyped_data()) : nullptr, window};
}

ffi::Error CheckAttrs(float scale, int64_t window, float softcap) {
  if (!std::isfinite(scale) || !std::isfinite(softcap) || softcap < 0 || window < 0)
    return InvalidArgument("attention: scale must be finite, softcap >= 0 and window >= 0");
  return ffi::Error::Success();
}

ffi::Future AttentionFwd(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer pos,
                         ffi::AnyBuffer seg, ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::Buffer<ffi::F32>> lse,
                         float scale, int64_t window, float softcap, bool segments) {
  Shape sh;
  if (ffi::Error e = CheckInputs(q, k, v, pos, seg, &sh); !e.success()) return ReadyFuture(e);
  if (ffi::Error e = CheckAttrs(scale, window, softcap); !e.success()) return ReadyFuture(e);
  if ((out->element_type() != q.element_type() && out->element_type() != ffi::DataType::F32) ||
      out->element_count() != q.element_count() || static_cast<int64_t>(lse->element_count()) != sh.b * sh.t * sh.h)
    return ReadyFuture(InvalidArgument("attention: outputs must be q's shape in q's dtype or f32, and (B, T, H) f32"));
  const Buffers in{q.untyped_data(), k.untyped_data(), v.untyped_data(), q.element_type() == ffi::DataType::BF16,
                   k.element_type() == ffi::DataType::BF16};
  const MaskRule mask = MakeMask(pos, seg, segments, window);
  const Params p{scale, softcap};
  void* o = out->untyped_data();
  const bool o_bf16 = out->element_type() == ffi::DataType::BF16;
  float* l = lse->typed_data();
  const int64_t tasks = sh.b * sh.kv * ((sh.t + kQTile - 1) / kQTile);
  if (sh.d == 0) std::fill_n(l, sh.b * sh.t * sh.h, 0.0f);  // nothing to attend with; no output left unwritten
  if (tasks == 0 || sh.d == 0) return ReadyFuture(ffi::Error::Success());
  return ParallelFor(pool, tasks, tasks, [=](int64_t, int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task)
      if (ffi::Error e = ForwardTile(in, mask, p, sh, task, o, o_bf16, l); !e.success()) return e;
    return ffi::Error::Success();
  });
}

ffi::Future AttentionBwd(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer pos,
                         ffi::AnyBuffer seg, ffi::Buffer<ffi::F32> lse, ffi::Buffer<ffi::F32> dsum, ffi::AnyBuffer dout,
                         ffi::Result<ffi::AnyBuffer> dq, ffi::Result<ffi::AnyBuffer> dk, ffi::Result<ffi::AnyBuffer> dv,
                         float scale, int64_t window, float softcap, bool segments) {
  Shape sh;
  if (ffi::Error e = CheckInputs(q, k, v, pos, seg, &sh); !e.success()) return ReadyFuture(e);
  if (ffi::Error e = CheckAttrs(scale, window, softcap); !e.success()) return ReadyFuture(e);
  const auto rows = static_cast<size_t>(sh.b * sh.t * sh.h);
  if (dout.element_type() != q.element_type() || dout.element_count() != q.element_count() ||
      lse.element_count() != rows || dsum.element_count() != rows || dq->element_type() != q.element_type() ||
      dk->element_type() != k.element_type() || dv->element_type() != k.element_type() ||
      dq->element_count() != q.element_count() || dk->element_count() != k.element_count() ||
      dv->element_count() != k.element_count())
    return ReadyFuture(InvalidArgument("attention backward: dout, lse, dsum and the gradients must match q, k, v"));
  const Buffers in{q.untyped_data(), k.untyped_data(), v.untyped_data(), q.element_type() == ffi::DataType::BF16,
                   k.element_type() == ffi::DataType::BF16};
  const MaskRule mask = MakeMask(pos, seg, segments, window);
  const Params p{scale, softcap};
  const void* d_o = dout.untyped_data();
  const float* l = lse.typed_data();
  const float* ds = dsum.typed_data();
  const GradOut g_out{dq->untyped_data(), dk->untyped_data(), dv->untyped_data()};
  const int64_t key_tasks = sh.b * sh.kv * ((sh.t + kKBlock - 1) / kKBlock);
  const int64_t query_tasks = sh.b * sh.kv * ((sh.t + kQTile - 1) / kQTile);
  const int64_t tasks = key_tasks + query_tasks;
  if (tasks == 0 || sh.d == 0) return ReadyFuture(ffi::Error::Success());
  return ParallelFor(pool, tasks, tasks, [=](int64_t, int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      ffi::Error e = task < key_tasks ? BackwardKeys(in, d_o, l, ds, mask, p, sh, task, g_out)
                                      : BackwardQueries(in, d_o, l, ds, mask, p, sh, task - key_tasks, g_out);
      if (!e.success()) return e;
    }
    return ffi::Error::Success();
  });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(AttentionFwdHandler, AttentionFwd,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("window")
                                  .Attr<float>("softcap")
                                  .Attr<bool>("segments"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(AttentionBwdHandler, AttentionBwd,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("window")
                                  .Attr<float>("softcap")
                                  .Attr<bool>("segments"));

}  // namespace tunix_rt
