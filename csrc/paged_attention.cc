// Paged KV cache ops: write_kv scatters new K/V rows into cache blocks; paged_attention attends
// over block tables.
//
// Cache: (num_blocks, block_size, kv_heads, head_dim), f32 or bf16; slot s = block * block_size +
// offset. Queries are the step's tokens packed together (T, heads, head_dim), each tagged with its
// sequence (token_seq, -1 = padding) and absolute position. Token t of sequence s sees the keys at
// positions [start, pos] of s, read through block_tables[s, position / block_size], where start is
// 0 or pos - window + 1 on sliding-window layers. The same rule covers decode, chunked prefill
// (a chunk's own keys are written before it attends) and prefix-cached blocks. Every block id,
// sequence id, slot and position comes from data and is checked before use: a bad one is an FFI
// error, never an out-of-bounds read.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
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
AVX2_FN void BlockAvx2(const float* q, const float* k, const float* v, int64_t stride, int64_t n, int64_t g, int64_t d,
                       float scale, float softcap, float* m, float* l, float* acc, float* scores) {
  const int64_t d8 = d - d % 8;
  for (int64_t gi = 0; gi < g; ++gi) {
    const float* qg = q + gi * d;
    float* sg = scores + gi * n;
    for (int64_t j = 0; j < n; ++j) {
      const float* kr = k + j * stride;
      __m256 a0 = _mm256_setzero_ps();
      for (int64_t i = 0; i < d8; i += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qg + i), _mm256_loadu_ps(kr + i), a0);
      float dot = HSum8(a0);
      for (int64_t i = d8; i < d; ++i) dot += qg[i] * kr[i];
      sg[j] = Softcapped(dot * scale, softcap);
    }
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
  for (int64_t gi = 0; gi < g; ++gi) {  // each 8 columns of a head's accumulator stay in a register over the keys
    const float* w = scores + gi * n;
    float* ag = acc + gi * d;
    for (int64_t i = 0; i < d8; i += 8) {
      __m256 a0 = _mm256_loadu_ps(ag + i);
      for (int64_t j = 0; j < n; ++j)
        a0 = _mm256_fmadd_ps(_mm256_set1_ps(w[j]), _mm256_loadu_ps(v + j * stride + i), a0);
      _mm256_storeu_ps(ag + i, a0);
    }
    for (int64_t i = d8; i < d; ++i)
      for (int64_t j = 0; j < n; ++j) ag[i] += w[j] * v[j * stride + i];
  }
}

AVX512_FN void BlockAvx512(const float* q, const float* k, const float* v, int64_t stride, int64_t n, int64_t g,
                           int64_t d, float scale, float softcap, float* m, float* l, float* acc, float* scores) {
  const int64_t d16 = d - d % 16;
  const __mmask16 dtail = static_cast<__mmask16>((1u << (d % 16)) - 1);
  for (int64_t gi = 0; gi < g; ++gi) {
    const float* qg = q + gi * d;
    float* sg = scores + gi * n;
    for (int64_t j = 0; j < n; ++j) {
      const float* kr = k + j * stride;
      __m512 a0 = _mm512_setzero_ps();
      for (int64_t i = 0; i < d16; i += 16) a0 = _mm512_fmadd_ps(_mm512_loadu_ps(qg + i), _mm512_loadu_ps(kr + i), a0);
      if (dtail)
        a0 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(dtail, qg + d16), _mm512_maskz_loadu_ps(dtail, kr + d16), a0);
      sg[j] = Softcapped(_mm512_reduce_add_ps(a0) * scale, softcap);
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
  for (int64_t gi = 0; gi < g; ++gi) {  // each 16 columns of a head's accumulator stay in a register over the keys
    const float* w = scores + gi * n;
    float* ag = acc + gi * d;
    for (int64_t i = 0; i < d; i += 16) {
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
  void* out;
};

// One (token, kv head) item: the `group` query heads sharing that kv head, online softmax over
// the visible blocks.
ffi::Error AttendItem(const AttnArgs& a, BlockFn block_fn, int64_t t, int64_t h, std::vector<float>& buf) {
  const int64_t d = a.c.head_dim, g = a.group, bs = a.c.block_size;
  buf.resize(g * d * 2 + g * bs + 2 * g + 2 * bs * d);
  float* qscratch = buf.data();
  float* acc = qscratch + g * d;
  float* scores = acc + g * d;
  float* m = scores + g * bs;
  float* l = m + g;
  float* kscratch = l + g;
  float* vscratch = kscratch + bs * d;
  const int64_t qrow = (t * a.heads + h * g) * d;
  const int32_t s = a.seq[t];
  std::fill(acc, acc + g * d, 0.0f);
  if (s != -1) {
    if (s < -1 || s >= a.seqs)
      return InvalidArgument("token_seq[" + std::to_string(t) + "] = " + std::to_string(s) + " is outside [-1, " +
                             std::to_string(a.seqs) + ")");
    const int32_t p = a.pos[t];
    if (p < 0 || p / bs >= a.max_blocks)
      return InvalidArgument("token_pos[" + std::to_string(t) + "] = " + std::to_string(p) + " is outside [0, " +
                             std::to_string(a.max_blocks * bs) + ") (block_tables width x block size)");
    // The group's query heads are row t * kv_heads + h of q viewed as (T * kv_heads, group * head_dim).
    const float* q = RowAsF32(a.q, a.q_bf16, t * a.c.kv_heads + h, g * d, qscratch);
    std::fill(m, m + g, -std::numeric_limits<float>::infinity());
    std::fill(l, l + g, 0.0f);
    const int64_t start = a.window > 0 ? std::max<int64_t>(0, p - a.window + 1) : 0;
    const int32_t* table = a.tables + s * a.max_blocks;
    for (int64_t b = start / bs; b <= p / bs; ++b) {
      const int32_t block = table[b];
      if (block < 0 || block >= a.c.blocks)
        return InvalidArgument("block_tables[" + std::to_string(s) + ", " + std::to_string(b) +
                               "] = " + std::to_string(block) + " is outside [0, " + std::to_string(a.c.blocks) + ")");
      const int64_t lo = std::max<int64_t>(start, b * bs) - b * bs;
      const int64_t hi = std::min<int64_t>(p, b * bs + bs - 1) - b * bs;  // inclusive
      const int64_t n = hi - lo + 1;
      const int64_t first = (block * bs + lo) * a.c.kv_heads + h;  // the first key's row
      if (a.cache_bf16) {                                          // the block's rows as f32, d apart
        for (int64_t j = 0; j < n; ++j) {
          RowAsF32(a.kc, true, first + j * a.c.kv_heads, d, kscratch + j * d);
          RowAsF32(a.vc, true, first + j * a.c.kv_heads, d, vscratch + j * d);
        }
        block_fn(q, kscratch, vscratch, d, n, g, d, a.scale, a.softcap, m, l, acc, scores);
      } else {
        block_fn(q, static_cast<const float*>(a.kc) + first * d, static_cast<const float*>(a.vc) + first * d,
                 a.c.kv_heads * d, n, g, d, a.scale, a.softcap, m, l, acc, scores);
      }
    }
    for (int64_t gi = 0; gi < g; ++gi) {  // l >= 1: pos itself is visible
      const float inv = 1.0f / l[gi];
      for (int64_t i = 0; i < d; ++i) acc[gi * d + i] *= inv;
    }
  }
  if (a.q_bf16) {
    uint16_t* o = static_cast<uint16_t*>(a.out) + qrow;
    for (int64_t i = 0; i < g * d; ++i) o[i] = F32ToBf16(acc[i]);
  } else {
    std::memcpy(static_cast<float*>(a.out) + qrow, acc, g * d * sizeof(float));
  }
  return ffi::Error::Success();
}

ffi::Future PagedAttention(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k_cache, ffi::AnyBuffer v_cache,
                           ffi::Buffer<ffi::S32> block_tables, ffi::Buffer<ffi::S32> token_seq,
                           ffi::Buffer<ffi::S32> token_pos, ffi::Result<ffi::AnyBuffer> out, float scale, float softcap,
                           int64_t window) {
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
  if (token_seq.element_count() != a.tokens || token_pos.element_count() != a.tokens)
    return ReadyFuture(InvalidArgument("token_seq and token_pos must hold one entry per query token"));
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
  a.out = out->untyped_data();

  // Cost per item ~ visible keys x group x head_dim; small steps stay on the calling thread.
  int64_t work = 0;
  for (int64_t t = 0; t < a.tokens; ++t)
    if (a.seq[t] >= 0) {
      const int64_t keys = std::max<int64_t>(a.pos[t], 0) + 1;
      work += (a.window > 0 ? std::min(keys, a.window) : keys) * a.heads * a.c.head_dim;
    }
  const int64_t items = a.tokens * a.c.kv_heads;
  const int64_t chunks = work < (1 << 16) ? 1 : NumChunks(pool, items, 1);
  const BlockFn block_fn = SelectBlockFn();
  return ParallelFor(pool, items, chunks, [a, block_fn](int64_t, int64_t begin, int64_t end) {
    std::vector<float> buf;
    for (int64_t i = begin; i < end; ++i)
      if (auto err = AttendItem(a, block_fn, i / a.c.kv_heads, i % a.c.kv_heads, buf); !err.success()) return err;
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(PagedAttentionHandler, PagedAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<float>("scale")
                                  .Attr<float>("softcap")
                                  .Attr<int64_t>("window"));

}  // namespace tunix_rt
