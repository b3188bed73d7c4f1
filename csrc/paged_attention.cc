// Paged KV cache ops: write_kv scatters new K/V rows into cache blocks; paged_attention attends
// over block tables.
//
// Cache: (num_blocks, block_size, kv_heads, head_dim), f32 or bf16; slot s = block * block_size +
// offset. Queries are the step's tokens packed together (T, heads, head_dim), each tagged with its
// sequence (token_seq, -1 = padding), absolute position and the last position it sees (token_until,
// >= its position: past it for the tokens of an image, which see their whole image). Token t of sequence
// s sees the keys at positions [start, until] of s, read through block_tables[s, position / block_size],
// where start is 0 or pos - window + 1 on sliding-window layers. The same rule covers decode, chunked
// prefill (a chunk's own keys are written before it attends) and prefix-cached blocks. Every block id,
// sequence id, slot and position comes from data and is checked before use: a bad one is an FFI
// error, never an out-of-bounds read.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "cpu_features.h"
#include "ffi_common.h"
#include "parallel.h"

#include "isa.h"

namespace tunix_rt {
namespace {

// One block's keys folded into a (token, kv head) item's online softmax: the scores of the `g` query heads
// (q: g x d) against the block's n keys (rows k + j * stride), the running max m and sum l of each head,
// and the accumulators acc (g x d) += softmax weight x value row (v + j * stride). `scores` is g x n
// scratch. One function per ISA tier; each computes an item the same way whatever else the step holds.
using BlockFn = void (*)(const float* q, const float* k, const float* v, int64_t stride, int64_t n, int64_t g,
                         int64_t d, float scale, float softcap, float* m, float* l, float* acc, float* scores);

float Softcapped(float s, float softcap) { return softcap > 0 ? std::tanh(s / softcap) * softcap : s; }

// The new running max of head gi and the factor its earlier terms are rescaled by (exp(-inf) = 0 at first).
float NewMax(const float* sg, int64_t n, float* m, float* corr) {
  float bm = *m;
  for (int64_t j = 0; j < n; ++j) bm = std::max(bm, sg[j]);
  *corr = std::exp(*m - bm);
  *m = bm;
  return bm;
}

void BlockScalar(const float* q, const float* k, const float* v, int64_t stride, int64_t n, int64_t g, int64_t d,
                 float scale, float softcap, float* m, float* l, float* acc, float* scores) {
  for (int64_t gi = 0; gi < g; ++gi) {
    float* sg = scores + gi * n;
    for (int64_t j = 0; j < n; ++j) {
      const float* qg = q + gi * d;
      const float* kr = k + j * stride;
      float part[8] = {0};
      int64_t i = 0;
      for (; i + 8 <= d; i += 8)
        for (int u = 0; u < 8; ++u) part[u] += qg[i + u] * kr[i + u];
      float dot = 0;
      for (int u = 0; u < 8; ++u) dot += part[u];
      for (; i < d; ++i) dot += qg[i] * kr[i];
      sg[j] = Softcapped(dot * scale, softcap);
    }
    float corr;
    const float bm = NewMax(sg, n, m + gi, &corr);
    float sum = 0.0f;
    for (int64_t j = 0; j < n; ++j) {
      sg[j] = std::exp(sg[j] - bm);
      sum += sg[j];
    }
    l[gi] = l[gi] * corr + sum;
    if (corr != 1.0f)
      for (int64_t i = 0; i < d; ++i) acc[gi * d + i] *= corr;
  }
  for (int64_t j = 0; j < n; ++j)
    for (int64_t gi = 0; gi < g; ++gi) {
      const float w = scores[gi * n + j];
      for (int64_t i = 0; i < d; ++i) acc[gi * d + i] += w * v[j * stride + i];
    }
}

#ifdef TUNIX_RT_X86
// A query row's dot product with one key (row kr), scaled and softcapped: the reference order of a key's score on
// this tier (one 8-lane multiply-add chain, HSum8, then the scalar tail), which HeadsKeyDots4Avx2 keeps.
AVX2_FN inline float KeyDotAvx2(const float* qg, const float* kr, int64_t d, float scale, float softcap) {
  const int64_t d8 = d - d % 8;
  __m256 a = _mm256_setzero_ps();
  for (int64_t i = 0; i < d8; i += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(qg + i), _mm256_loadu_ps(kr + i), a);
  float dot = HSum8(a);
  for (int64_t i = d8; i < d; ++i) dot += qg[i] * kr[i];
  return Softcapped(dot * scale, softcap);
}

// The scores of H query heads (rows q + h * d) against four keys (rows kr + c * stride) into s[h * n + c]: each
// (head, key) pair is KeyDotAvx2's chain, its eight lanes summed in HSum8's order (the halves added, then lanes
// 0 + 2 and 1 + 3, then those two), so its bits are KeyDotAvx2's. Each key row loaded feeds H chains (one head's
// chains issued 1.25 loads per multiply-add), and the four keys' lanes are summed together by shuffles, not by a
// horizontal sum each.
template <int H>
AVX2_FN inline void HeadsKeyDots4Avx2(const float* q, const float* kr, int64_t stride, int64_t d, int64_t n,
                                      float scale, float softcap, float* s) {
  const int64_t d8 = d - d % 8;
  __m256 a[H][4];
  for (int h = 0; h < H; ++h)
    for (int c = 0; c < 4; ++c) a[h][c] = _mm256_setzero_ps();
  for (int64_t i = 0; i < d8; i += 8) {
    __m256 kv[4];
    for (int c = 0; c < 4; ++c) kv[c] = _mm256_loadu_ps(kr + c * stride + i);
    for (int h = 0; h < H; ++h) {
      const __m256 qv = _mm256_loadu_ps(q + h * d + i);
      for (int c = 0; c < 4; ++c) a[h][c] = _mm256_fmadd_ps(qv, kv[c], a[h][c]);
    }
  }
  for (int h = 0; h < H; ++h) {
    const __m256 s01 = _mm256_add_ps(_mm256_permute2f128_ps(a[h][0], a[h][1], 0x20),
                                     _mm256_permute2f128_ps(a[h][0], a[h][1], 0x31));  // [key 0 | key 1]
    const __m256 s23 = _mm256_add_ps(_mm256_permute2f128_ps(a[h][2], a[h][3], 0x20),
                                     _mm256_permute2f128_ps(a[h][2], a[h][3], 0x31));  // [key 2 | key 3]
    // [0: 0+2, 0: 1+3, 2: 0+2, 2: 1+3 | the same of keys 1 and 3]
    const __m256 p = _mm256_add_ps(_mm256_shuffle_ps(s01, s23, _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm256_shuffle_ps(s01, s23, _MM_SHUFFLE(3, 2, 3, 2)));
    const __m256 r = _mm256_add_ps(_mm256_shuffle_ps(p, p, _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm256_shuffle_ps(p, p, _MM_SHUFFLE(3, 1, 3, 1)));  // lanes 0, 4, 1, 5: keys 0..3
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, r);
    const float dots[4] = {lanes[0], lanes[4], lanes[1], lanes[5]};
    const float* qh = q + h * d;
    for (int c = 0; c < 4; ++c) {
      float dot = dots[c];
      for (int64_t i = d8; i < d; ++i) dot += qh[i] * kr[c * stride + i];
      s[h * n + c] = Softcapped(dot * scale, softcap);
    }
  }
}

// ag[0 .. 8R) += sum over keys j of w[j] * v[j * stride + 0 .. 8R), each column summed key after key in its own
// register (R independent multiply-add chains; the same bits for any R).
template <int R>
AVX2_FN inline void ValueColumnsAvx2(const float* w, const float* v, int64_t stride, int64_t n, float* ag) {
  __m256 a[R];
  for (int r = 0; r < R; ++r) a[r] = _mm256_loadu_ps(ag + 8 * r);
  for (int64_t j = 0; j < n; ++j) {
    const __m256 wj = _mm256_set1_ps(w[j]);
    const float* vr = v + j * stride;
    for (int r = 0; r < R; ++r) a[r] = _mm256_fmadd_ps(wj, _mm256_loadu_ps(vr + 8 * r), a[r]);
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(ag + 8 * r, a[r]);
}

AVX2_FN void BlockAvx2(const float* q, const float* k, const float* v, int64_t stride, int64_t n, int64_t g, int64_t d,
                       float scale, float softcap, float* m, float* l, float* acc, float* scores) {
  const int64_t d8 = d - d % 8;
  // every head's scores first, up to three heads per pass over the keys
  for (int64_t g0 = 0; g0 < g; g0 += 3) {
    const int64_t heads = std::min<int64_t>(3, g - g0);
    const float* qh = q + g0 * d;
    float* sh = scores + g0 * n;
    const int64_t n4 = n - n % 4;
    if (heads == 3) {
      for (int64_t key = 0; key < n4; key += 4)
        HeadsKeyDots4Avx2<3>(qh, k + key * stride, stride, d, n, scale, softcap, sh + key);
    } else if (heads == 2) {
      for (int64_t key = 0; key < n4; key += 4)
        HeadsKeyDots4Avx2<2>(qh, k + key * stride, stride, d, n, scale, softcap, sh + key);
    } else {
      for (int64_t key = 0; key < n4; key += 4)
        HeadsKeyDots4Avx2<1>(qh, k + key * stride, stride, d, n, scale, softcap, sh + key);
    }
    for (int64_t key = n4; key < n; ++key)
      for (int64_t h = 0; h < heads; ++h) sh[h * n + key] = KeyDotAvx2(qh + h * d, k + key * stride, d, scale, softcap);
  }
  for (int64_t gi = 0; gi < g; ++gi) {
    float* sg = scores + gi * n;
    float corr;
    const __m256 bm = _mm256_set1_ps(NewMax(sg, n, m + gi, &corr));
    __m256 total = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
      const __m256 e = Exp8(_mm256_sub_ps(_mm256_loadu_ps(sg + j), bm));
      _mm256_storeu_ps(sg + j, e);
      total = _mm256_add_ps(total, e);
    }
    if (j < n) {
      float tail[8] = {0};
      std::memcpy(tail, sg + j, (n - j) * sizeof(float));
      const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
      const __m256 live = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(int(n - j)), lanes));
      const __m256 e = _mm256_and_ps(live, Exp8(_mm256_sub_ps(_mm256_loadu_ps(tail), bm)));
      _mm256_storeu_ps(tail, e);
      std::memcpy(sg + j, tail, (n - j) * sizeof(float));
      total = _mm256_add_ps(total, e);
    }
    l[gi] = l[gi] * corr + HSum8(total);
    if (corr != 1.0f) {
      const __m256 c = _mm256_set1_ps(corr);
      float* ag = acc + gi * d;
      for (int64_t i = 0; i < d8; i += 8) _mm256_storeu_ps(ag + i, _mm256_mul_ps(c, _mm256_loadu_ps(ag + i)));
      for (int64_t i = d8; i < d; ++i) ag[i] *= corr;
    }
  }
  // Each 8 columns of a head's accumulator stay in a register over the keys, eight such registers at a time
  // where 64 columns are left (eight independent FMA chains: two FMA units of four cycles' latency), else four,
  // else one.
  for (int64_t gi = 0; gi < g; ++gi) {
    const float* w = scores + gi * n;
    float* ag = acc + gi * d;
    int64_t i = 0;
    for (; i + 64 <= d8; i += 64) ValueColumnsAvx2<8>(w, v + i, stride, n, ag + i);
    for (; i + 32 <= d8; i += 32) ValueColumnsAvx2<4>(w, v + i, stride, n, ag + i);
    for (; i < d8; i += 8) ValueColumnsAvx2<1>(w, v + i, stride, n, ag + i);
    for (int64_t i = d8; i < d; ++i)
      for (int64_t j = 0; j < n; ++j) ag[i] += w[j] * v[j * stride + i];
  }
}

// The dot products of a query row with c <= 16 keys (rows k + j * stride), key j in lane j: each key's
// 16-lane partial products are summed by one fixed tree that reduces all 16 keys together (three shuffle
// stages instead of a horizontal sum per key), so a key's score never depends on the keys beside it.
AVX512_FN __m512 Dots16(const float* qg, const float* k, int64_t stride, int64_t c, int64_t d16, __mmask16 dtail) {
  __m512 v[16];
  for (int64_t j = 0; j < 16; ++j) {
    __m512 a = _mm512_setzero_ps();
    if (j < c) {
      const float* kr = k + j * stride;
      for (int64_t i = 0; i < d16; i += 16) a = _mm512_fmadd_ps(_mm512_loadu_ps(qg + i), _mm512_loadu_ps(kr + i), a);
      if (dtail) a = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(dtail, qg + d16), _mm512_maskz_loadu_ps(dtail, kr + d16), a);
    }
    v[j] = a;
  }
  __m512 w[8];  // w[i]: 8 partials of key 2i, then 8 of key 2i + 1
  for (int i = 0; i < 8; ++i)
    w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  __m512 x[4];  // x[i]: 4 partials of each of keys 4i .. 4i + 3
  for (int i = 0; i < 4; ++i)
    x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0xDD));
  // quarter r of y0: 2 partials of keys r and 4 + r; of y1: of keys 8 + r and 12 + r
  const __m512 y0 = _mm512_add_ps(_mm512_shuffle_ps(x[0], x[1], 0x44), _mm512_shuffle_ps(x[0], x[1], 0xEE));
  const __m512 y1 = _mm512_add_ps(_mm512_shuffle_ps(x[2], x[3], 0x44), _mm512_shuffle_ps(x[2], x[3], 0xEE));
  // lane 4r + q of z: key 4q + r
  const __m512 z = _mm512_add_ps(_mm512_shuffle_ps(y0, y1, 0x88), _mm512_shuffle_ps(y0, y1, 0xDD));
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), z);
}

AVX512_FN void BlockAvx512(const float* q, const float* k, const float* v, int64_t stride, int64_t n, int64_t g,
                           int64_t d, float scale, float softcap, float* m, float* l, float* acc, float* scores) {
  const int64_t d16 = d - d % 16;
  const __mmask16 dtail = static_cast<__mmask16>((1u << (d % 16)) - 1);
  for (int64_t gi = 0; gi < g; ++gi) {
    const float* qg = q + gi * d;
    float* sg = scores + gi * n;
    for (int64_t j0 = 0; j0 < n; j0 += 16) {
      const int64_t c = std::min<int64_t>(16, n - j0);
      const __m512 dots = _mm512_mul_ps(Dots16(qg, k + j0 * stride, stride, c, d16, dtail), _mm512_set1_ps(scale));
      _mm512_mask_storeu_ps(sg + j0, static_cast<__mmask16>((1u << c) - 1), dots);
      if (softcap > 0)
        for (int64_t j = j0; j < j0 + c; ++j) sg[j] = Softcapped(sg[j], softcap);
    }
    float corr;
    const __m512 bm = _mm512_set1_ps(NewMax(sg, n, m + gi, &corr));
    __m512 total = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; j += 16) {
      const __mmask16 live = n - j >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (n - j)) - 1);
      const __m512 e = _mm512_maskz_mov_ps(live, Exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, sg + j), bm)));
      _mm512_mask_storeu_ps(sg + j, live, e);
      total = _mm512_add_ps(total, e);
    }
    l[gi] = l[gi] * corr + _mm512_reduce_add_ps(total);
    if (corr != 1.0f) {
      const __m512 c = _mm512_set1_ps(corr);
      float* ag = acc + gi * d;
      for (int64_t i = 0; i < d16; i += 16) _mm512_storeu_ps(ag + i, _mm512_mul_ps(c, _mm512_loadu_ps(ag + i)));
      if (dtail) _mm512_mask_storeu_ps(ag + d16, dtail, _mm512_mul_ps(c, _mm512_maskz_loadu_ps(dtail, ag + d16)));
    }
  }
  // Each 16 columns of a head's accumulator stay in a register over the keys, four such registers at a time
  // where the head has 64 columns left (four independent FMA chains: one chain alone waits on its latency).
  for (int64_t gi = 0; gi < g; ++gi) {
    const float* w = scores + gi * n;
    float* ag = acc + gi * d;
    int64_t i = 0;
    for (; i + 64 <= d16; i += 64) {
      __m512 a0 = _mm512_loadu_ps(ag + i), a1 = _mm512_loadu_ps(ag + i + 16);
      __m512 a2 = _mm512_loadu_ps(ag + i + 32), a3 = _mm512_loadu_ps(ag + i + 48);
      for (int64_t j = 0; j < n; ++j) {
        const __m512 wj = _mm512_set1_ps(w[j]);
        const float* vr = v + j * stride + i;
        a0 = _mm512_fmadd_ps(wj, _mm512_loadu_ps(vr), a0);
        a1 = _mm512_fmadd_ps(wj, _mm512_loadu_ps(vr + 16), a1);
        a2 = _mm512_fmadd_ps(wj, _mm512_loadu_ps(vr + 32), a2);
        a3 = _mm512_fmadd_ps(wj, _mm512_loadu_ps(vr + 48), a3);
      }
      _mm512_storeu_ps(ag + i, a0);
      _mm512_storeu_ps(ag + i + 16, a1);
      _mm512_storeu_ps(ag + i + 32, a2);
      _mm512_storeu_ps(ag + i + 48, a3);
    }
    for (; i < d; i += 16) {
      const __mmask16 cols = i < d16 ? static_cast<__mmask16>(0xFFFF) : dtail;
      __m512 a0 = _mm512_maskz_loadu_ps(cols, ag + i);
      for (int64_t j = 0; j < n; ++j)
        a0 = _mm512_fmadd_ps(_mm512_set1_ps(w[j]), _mm512_maskz_loadu_ps(cols, v + j * stride + i), a0);
      _mm512_mask_storeu_ps(ag + i, cols, a0);
    }
  }
}
#endif

BlockFn SelectBlockFn() {
#ifdef TUNIX_RT_X86
  if (isa_level() >= IsaLevel::kAvx512) return BlockAvx512;
  if (isa_level() >= IsaLevel::kAvx2) return BlockAvx2;
#endif
  return BlockScalar;
}

std::string DimsString(ffi::Span<const int64_t> dims) {
  std::string s = "(";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + (dims.size() == 1 ? ",)" : ")");
}

// Cache geometry, checked against a buffer's dimensions.
struct CacheShape {
  int64_t blocks, block_size, kv_heads, head_dim;
  int64_t slots() const { return blocks * block_size; }
  int64_t row() const { return kv_heads * head_dim; }
};

ffi::Error ReadCacheShape(const ffi::AnyBuffer& k, const ffi::AnyBuffer& v, CacheShape* out) {
  auto kd = k.dimensions();
  if (kd.size() != 4)
    return InvalidArgument("k_cache must be (num_blocks, block_size, kv_heads, head_dim), got " + DimsString(kd));
  if (!IsF32OrBf16(k.element_type())) return InvalidArgument("k_cache must be f32 or bf16");
  if (v.element_type() != k.element_type() || v.dimensions().size() != 4 ||
      !std::equal(kd.begin(), kd.end(), v.dimensions().begin()))
    return InvalidArgument("v_cache must match k_cache's shape and dtype");
  *out = {kd[0], kd[1], kd[2], kd[3]};
  return ffi::Error::Success();
}

ffi::Error WriteKv(ffi::AnyBuffer k_cache, ffi::AnyBuffer v_cache, ffi::AnyBuffer k, ffi::AnyBuffer v,
                   ffi::Buffer<ffi::S32> slots, ffi::Result<ffi::AnyBuffer> k_out, ffi::Result<ffi::AnyBuffer> v_out) {
  CacheShape c;
  if (auto err = ReadCacheShape(k_cache, v_cache, &c); !err.success()) return err;
  auto kd = k.dimensions();
  if (kd.size() != 3 || kd[1] != c.kv_heads || kd[2] != c.head_dim)
    return InvalidArgument("k must be (tokens, kv_heads, head_dim) matching the cache, got " + DimsString(kd));
  if (k.element_type() != k_cache.element_type() || v.element_type() != k_cache.element_type() ||
      v.dimensions().size() != 3 || !std::equal(kd.begin(), kd.end(), v.dimensions().begin()))
    return InvalidArgument("k and v must have the cache's dtype and one shape");
  const int64_t tokens = kd[0];
  if (slots.element_count() != tokens) return InvalidArgument("slots must hold one entry per token");
  const int32_t* slot = slots.typed_data();
  for (int64_t t = 0; t < tokens; ++t)
    if (slot[t] < -1 || slot[t] >= c.slots())
      return InvalidArgument("slots[" + std::to_string(t) + "] = " + std::to_string(slot[t]) + " is outside [-1, " +
                             std::to_string(c.slots()) + ")");
  const bool bf16 = k_cache.element_type() == ffi::DataType::BF16;
  const size_t bytes = k_cache.size_bytes();
  // Aliased (the cache was donated) in the engine; a copy keeps the op correct when it is not.
  if (k_out->untyped_data() != k_cache.untyped_data())
    std::memcpy(k_out->untyped_data(), k_cache.untyped_data(), bytes);
  if (v_out->untyped_data() != v_cache.untyped_data())
    std::memcpy(v_out->untyped_data(), v_cache.untyped_data(), bytes);
  const int64_t row_bytes = c.row() * (bf16 ? 2 : 4);
  auto* kdst = static_cast<char*>(k_out->untyped_data());
  auto* vdst = static_cast<char*>(v_out->untyped_data());
  const auto* ksrc = static_cast<const char*>(k.untyped_data());
  const auto* vsrc = static_cast<const char*>(v.untyped_data());
  for (int64_t t = 0; t < tokens; ++t) {
    if (slot[t] < 0) continue;
    std::memcpy(kdst + slot[t] * row_bytes, ksrc + t * row_bytes, row_bytes);
    std::memcpy(vdst + slot[t] * row_bytes, vsrc + t * row_bytes, row_bytes);
  }
  return ffi::Error::Success();
}

// The K and V pools, left as the allocator hands them over. An engine's pool is sized for its most sequences (1 GiB
// by default) and zeroing it faulted in and cleared every page at each engine start, before a token was decoded;
// untouched, a pool costs resident memory only as blocks are written. No output depends on a slot before write_kv
// wrote it (a token attends positions that are written first, a reused block's stale rows are not visible to it,
// and the references mask what they gather), so the contents never matter: fresh pages read as zeros, reused
// memory as whatever it held.
ffi::Error EmptyKv(ffi::Result<ffi::AnyBuffer>, ffi::Result<ffi::AnyBuffer>) { return ffi::Error::Success(); }

struct AttnArgs {
  CacheShape c;
  int64_t tokens, heads, group, seqs, max_blocks;
  float scale, softcap;
  int64_t window;
  bool q_bf16, cache_bf16;
  const void* q;
  const void* kc;
  const void* vc;
  const int32_t* tables;
  const int32_t* seq;
  const int32_t* pos;
  const int32_t* until;
  void* out;
};

// Per-thread scratch of AttendRun.
struct RunScratch {
  std::vector<float> f;
  std::vector<const float*> q;
};

constexpr int64_t kMaxRun = 16;  // most tokens of a sequence that share one walk over its blocks

// One (run, kv heads) item: tokens t0 .. t1 - 1, consecutive in the step and all of one sequence (or a single
// padding token), each with the `group` query heads sharing each kv head of [h0, h1). The run walks the union
// of its tokens' visible blocks once, so a prefill chunk reads each K/V block once, not once per token, and
// all the item's kv heads read a block while it is in cache (a block's rows interleave the kv heads: one pass
// per head would read a third of each row run at a time); for each block and kv head, every token that sees
// part of the block folds that part into its own online softmax, with the same call a token alone would make.
// A token's numbers therefore never depend on the run or the heads it is with.
ffi::Error AttendRun(const AttnArgs& a, BlockFn block_fn, int64_t t0, int64_t t1, int64_t h0, int64_t h1,
                     RunScratch& sc) {
  const int64_t d = a.c.head_dim, g = a.group, bs = a.c.block_size, r = t1 - t0, nh = h1 - h0;
  const int64_t states = r * nh;  // (token, kv head) pairs, token-major
  sc.f.resize(states * (2 * g * d + 2 * g) + g * bs + 2 * bs * d);
  sc.q.resize(states);
  float* qscratch = sc.f.data();  // states x g x d
  float* acc = qscratch + states * g * d;
  float* m = acc + states * g * d;  // states x g
  float* l = m + states * g;
  float* scores = l + states * g;  // g x bs
  float* kscratch = scores + g * bs;
  float* vscratch = kscratch + bs * d;
  std::fill(acc, acc + states * g * d, 0.0f);
  const int32_t s = a.seq[t0];
  if (s != -1) {
    if (s < -1 || s >= a.seqs)
      return InvalidArgument("token_seq[" + std::to_string(t0) + "] = " + std::to_string(s) + " is outside [-1, " +
                             std::to_string(a.seqs) + ")");
    int64_t first_block = a.max_blocks, last_block = -1;
    for (int64_t t = t0; t < t1; ++t) {
      const int32_t p = a.pos[t], u = a.until[t];
      if (p < 0 || p / bs >= a.max_blocks)
        return InvalidArgument("token_pos[" + std::to_string(t) + "] = " + std::to_string(p) + " is outside [0, " +
                               std::to_string(a.max_blocks * bs) + ") (block_tables width x block size)");
      if (u < p || u / bs >= a.max_blocks)
        return InvalidArgument("token_until[" + std::to_string(t) + "] = " + std::to_string(u) + " is outside [" +
                               std::to_string(p) + ", " + std::to_string(a.max_blocks * bs) + ")");
      for (int64_t h = h0; h < h1; ++h) {
        const int64_t i = (t - t0) * nh + (h - h0);
        // The group's query heads are row t * kv_heads + h of q viewed as (T * kv_heads, group * head_dim).
        sc.q[i] = RowAsF32(a.q, a.q_bf16, t * a.c.kv_heads + h, g * d, qscratch + i * g * d);
        std::fill(m + i * g, m + (i + 1) * g, -std::numeric_limits<float>::infinity());
        std::fill(l + i * g, l + (i + 1) * g, 0.0f);
      }
      const int64_t start = a.window > 0 ? std::max<int64_t>(0, p - a.window + 1) : 0;
      first_block = std::min(first_block, start / bs);
      last_block = std::max<int64_t>(last_block, u / bs);
    }
    const int32_t* table = a.tables + s * a.max_blocks;
    for (int64_t b = first_block; b <= last_block; ++b) {
      int64_t lo_all = bs, hi_all = -1;  // the block's rows any token of the run sees
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t p = a.pos[t], u = a.until[t], start = a.window > 0 ? std::max<int64_t>(0, p - a.window + 1) : 0;
        if (start / bs <= b && b <= u / bs) {
          lo_all = std::min(lo_all, std::max<int64_t>(start, b * bs) - b * bs);
          hi_all = std::max(hi_all, std::min<int64_t>(u, b * bs + bs - 1) - b * bs);
        }
      }
      if (hi_all < 0) continue;  // between two tokens' windows: no token of the run reads it
      const int32_t block = table[b];
      if (block < 0 || block >= a.c.blocks)
        return InvalidArgument("block_tables[" + std::to_string(s) + ", " + std::to_string(b) +
                               "] = " + std::to_string(block) + " is outside [0, " + std::to_string(a.c.blocks) + ")");
      for (int64_t h = h0; h < h1; ++h) {
        const int64_t row0 = block * bs * a.c.kv_heads + h;  // the block's first key row for kv head h
        if (a.cache_bf16)                                    // the rows the run reads, as f32, d apart
          for (int64_t j = lo_all; j <= hi_all; ++j) {
            RowAsF32(a.kc, true, row0 + j * a.c.kv_heads, d, kscratch + j * d);
            RowAsF32(a.vc, true, row0 + j * a.c.kv_heads, d, vscratch + j * d);
          }
        for (int64_t t = t0; t < t1; ++t) {
          const int64_t p = a.pos[t], u = a.until[t], start = a.window > 0 ? std::max<int64_t>(0, p - a.window + 1) : 0;
          if (b < start / bs || b > u / bs) continue;
          const int64_t lo = std::max<int64_t>(start, b * bs) - b * bs;
          const int64_t hi = std::min<int64_t>(u, b * bs + bs - 1) - b * bs;  // inclusive
          const int64_t i = (t - t0) * nh + (h - h0);
          float *mi = m + i * g, *li = l + i * g, *ai = acc + i * g * d;
          if (a.cache_bf16) {
            block_fn(sc.q[i], kscratch + lo * d, vscratch + lo * d, d, hi - lo + 1, g, d, a.scale, a.softcap, mi, li,
                     ai, scores);
          } else {
            const int64_t first = (row0 + lo * a.c.kv_heads) * d;
            block_fn(sc.q[i], static_cast<const float*>(a.kc) + first, static_cast<const float*>(a.vc) + first,
                     a.c.kv_heads * d, hi - lo + 1, g, d, a.scale, a.softcap, mi, li, ai, scores);
          }
        }
      }
    }
    for (int64_t i = 0; i < states * g; ++i) {  // l >= 1: pos itself is visible
      const float inv = 1.0f / l[i];
      for (int64_t c = 0; c < d; ++c) acc[i * d + c] *= inv;
    }
  }
  for (int64_t t = t0; t < t1; ++t)
    for (int64_t h = h0; h < h1; ++h) {
      const int64_t qrow = (t * a.heads + h * g) * d;
      const float* src = acc + ((t - t0) * nh + (h - h0)) * g * d;
      if (a.q_bf16) {
        uint16_t* o = static_cast<uint16_t*>(a.out) + qrow;
        for (int64_t i = 0; i < g * d; ++i) o[i] = F32ToBf16(src[i]);
      } else {
        std::memcpy(static_cast<float*>(a.out) + qrow, src, g * d * sizeof(float));
      }
    }
  return ffi::Error::Success();
}

ffi::Future PagedAttention(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k_cache, ffi::AnyBuffer v_cache,
                           ffi::Buffer<ffi::S32> block_tables, ffi::Buffer<ffi::S32> token_seq,
                           ffi::Buffer<ffi::S32> token_pos, ffi::Buffer<ffi::S32> token_until,
                           ffi::Result<ffi::AnyBuffer> out, float scale, float softcap, int64_t window) {
  AttnArgs a{};
  if (auto err = ReadCacheShape(k_cache, v_cache, &a.c); !err.success()) return ReadyFuture(err);
  auto qd = q.dimensions();
  if (qd.size() != 3 || qd[2] != a.c.head_dim || qd[1] % a.c.kv_heads != 0)
    return ReadyFuture(InvalidArgument(
        "q must be (tokens, heads, head_dim) with heads a multiple of the cache's kv_heads, got " + DimsString(qd)));
  if (!IsF32OrBf16(q.element_type()) || out->element_type() != q.element_type())
    return ReadyFuture(InvalidArgument("q must be f32 or bf16 (the output takes its dtype)"));
  auto bt = block_tables.dimensions();
  if (bt.size() != 2) return ReadyFuture(InvalidArgument("block_tables must be (num_seqs, max_blocks)"));
  a.tokens = qd[0];
  if (token_seq.element_count() != a.tokens || token_pos.element_count() != a.tokens ||
      token_until.element_count() != a.tokens)
    return ReadyFuture(InvalidArgument("token_seq, token_pos and token_until must hold one entry per query token"));
  a.heads = qd[1];
  a.group = a.heads / a.c.kv_heads;
  a.seqs = bt[0];
  a.max_blocks = bt[1];
  a.scale = scale;
  a.softcap = softcap;
  a.window = window;
  a.q_bf16 = q.element_type() == ffi::DataType::BF16;
  a.cache_bf16 = k_cache.element_type() == ffi::DataType::BF16;
  a.q = q.untyped_data();
  a.kc = k_cache.untyped_data();
  a.vc = v_cache.untyped_data();
  a.tables = block_tables.typed_data();
  a.seq = token_seq.typed_data();
  a.pos = token_pos.typed_data();
  a.until = token_until.typed_data();
  a.out = out->untyped_data();

  // Cost per item ~ visible keys x group x head_dim; small steps stay on the calling thread.
  int64_t work = 0;
  for (int64_t t = 0; t < a.tokens; ++t)
    if (a.seq[t] >= 0) {
      const int64_t keys = std::max<int64_t>(a.until[t], 0) + 1;
      work += (a.window > 0 ? std::min(keys, a.window) : keys) * a.heads * a.c.head_dim;
    }
  // Runs: a sequence's consecutive tokens cut into near-equal pieces of at most `longest` (kMaxRun, or fewer
  // when the step is small, so that every worker gets two items); a padding token alone.
  const int64_t longest = std::clamp<int64_t>(a.tokens * a.c.kv_heads / (2 * Workers(pool)), 1, kMaxRun);
  auto runs = std::make_shared<std::vector<int64_t>>();  // run i is tokens [runs[i], runs[i + 1])
  for (int64_t t = 0; t < a.tokens;) {
    int64_t end = t + 1;
    while (end < a.tokens && a.seq[t] >= 0 && a.seq[end] == a.seq[t]) ++end;
    const int64_t pieces = (end - t + longest - 1) / longest;
    for (int64_t k = 0; k < pieces; ++k) runs->push_back(t + (end - t) * k / pieces);
    t = end;
  }
  runs->push_back(a.tokens);
  // Each run's kv heads in as few items as still give every worker two: all of them together where the runs
  // alone are enough (one walk over each block), one each for a lone decode.
  const int64_t num_runs = static_cast<int64_t>(runs->size()) - 1;
  if (num_runs == 0) return ReadyFuture(ffi::Error::Success());  // no query tokens
  const int64_t split = std::clamp<int64_t>((2 * Workers(pool) + num_runs - 1) / num_runs, 1, a.c.kv_heads);
  const int64_t per_item = (a.c.kv_heads + split - 1) / split;
  const int64_t items = num_runs * split;
  const int64_t chunks = work < (1 << 16) ? 1 : NumChunks(pool, items, 1);
  const BlockFn block_fn = SelectBlockFn();
  return ParallelFor(pool, items, chunks, [a, block_fn, runs, split, per_item](int64_t, int64_t begin, int64_t end) {
    RunScratch scratch;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t run = i / split, h0 = (i % split) * per_item, h1 = std::min(a.c.kv_heads, h0 + per_item);
      if (h0 >= h1) continue;
      if (auto err = AttendRun(a, block_fn, (*runs)[run], (*runs)[run + 1], h0, h1, scratch); !err.success())
        return err;
    }
    return ffi::Error::Success();
  });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(WriteKvHandler, WriteKv,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(EmptyKvHandler, EmptyKv, ffi::Ffi::Bind().Ret<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(PagedAttentionHandler, PagedAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<float>("scale")
                                  .Attr<float>("softcap")
                                  .Attr<int64_t>("window"));

}  // namespace tunix_rt
