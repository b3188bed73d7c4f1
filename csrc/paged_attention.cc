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

// Vector primitives over one head_dim row, per ISA tier.
struct RowOps {
  float (*dot)(const float* a, const float* b, int64_t n);
  void (*axpy)(float* acc, float w, const float* v, int64_t n);  // acc += w * v
  void (*scale)(float* acc, float c, int64_t n);                 // acc *= c
};

float DotScalar(const float* a, const float* b, int64_t n) {
  float acc[8] = {0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; ++j) acc[j] += a[i + j] * b[i + j];
  float s = 0;
  for (int j = 0; j < 8; ++j) s += acc[j];
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}
void AxpyScalar(float* acc, float w, const float* v, int64_t n) {
  for (int64_t i = 0; i < n; ++i) acc[i] += w * v[i];
}
void ScaleScalar(float* acc, float c, int64_t n) {
  for (int64_t i = 0; i < n; ++i) acc[i] *= c;
}

#ifdef TUNIX_RT_X86
AVX2_FN float DotAvx2(const float* a, const float* b, int64_t n) {
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
  }
  for (; i + 8 <= n; i += 8) acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
  float out = HSum8(_mm256_add_ps(acc0, acc1));
  for (; i < n; ++i) out += a[i] * b[i];
  return out;
}
AVX2_FN void AxpyAvx2(float* acc, float w, const float* v, int64_t n) {
  const __m256 wv = _mm256_set1_ps(w);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(acc + i, _mm256_fmadd_ps(wv, _mm256_loadu_ps(v + i), _mm256_loadu_ps(acc + i)));
  for (; i < n; ++i) acc[i] += w * v[i];
}
AVX2_FN void ScaleAvx2(float* acc, float c, int64_t n) {
  const __m256 cv = _mm256_set1_ps(c);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(acc + i, _mm256_mul_ps(cv, _mm256_loadu_ps(acc + i)));
  for (; i < n; ++i) acc[i] *= c;
}
#endif

const RowOps& SelectRowOps() {
  static const RowOps scalar{DotScalar, AxpyScalar, ScaleScalar};
#ifdef TUNIX_RT_X86
  static const RowOps avx2{DotAvx2, AxpyAvx2, ScaleAvx2};
  if (isa_level() >= IsaLevel::kAvx2) return avx2;
#endif
  return scalar;
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
ffi::Error AttendItem(const AttnArgs& a, const RowOps& ops, int64_t t, int64_t h, std::vector<float>& buf) {
  const int64_t d = a.c.head_dim, g = a.group, bs = a.c.block_size;
  buf.resize(g * d * 2 + g * bs + 2 * g + 2 * d);
  float* qscratch = buf.data();
  float* acc = qscratch + g * d;
  float* scores = acc + g * d;
  float* m = scores + g * bs;
  float* l = m + g;
  float* kscratch = l + g;
  float* vscratch = kscratch + d;
  const int64_t qrow = (t * a.heads + h * g) * d;
  const int32_t s = a.seq[t];
  if (s == -1) {
    for (int64_t i = 0; i < g * d; ++i) acc[i] = 0.0f;
  } else {
    if (s < -1 || s >= a.seqs)
      return InvalidArgument("token_seq[" + std::to_string(t) + "] = " + std::to_string(s) + " is outside [-1, " +
                             std::to_string(a.seqs) + ")");
    const int32_t p = a.pos[t];
    if (p < 0 || p / bs >= a.max_blocks)
      return InvalidArgument("token_pos[" + std::to_string(t) + "] = " + std::to_string(p) + " is outside [0, " +
                             std::to_string(a.max_blocks * bs) + ") (block_tables width x block size)");
    // The group's query heads are row t * kv_heads + h of q viewed as (T * kv_heads, group * head_dim).
    const float* q = RowAsF32(a.q, a.q_bf16, t * a.c.kv_heads + h, g * d, qscratch);
    std::fill(acc, acc + g * d, 0.0f);
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
      for (int64_t j = 0; j < n; ++j) {
        const float* krow = RowAsF32(a.kc, a.cache_bf16, (block * bs + lo + j) * a.c.kv_heads + h, d, kscratch);
        for (int64_t gi = 0; gi < g; ++gi) {
          float sc = ops.dot(q + gi * d, krow, d) * a.scale;
          if (a.softcap > 0) sc = std::tanh(sc / a.softcap) * a.softcap;
          scores[gi * bs + j] = sc;
        }
      }
      for (int64_t gi = 0; gi < g; ++gi) {
        float* sg = scores + gi * bs;
        float bm = m[gi];
        for (int64_t j = 0; j < n; ++j) bm = std::max(bm, sg[j]);
        const float corr = std::exp(m[gi] - bm);  // exp(-inf) = 0 on the first block
        float sum = 0.0f;
        for (int64_t j = 0; j < n; ++j) {
          sg[j] = std::exp(sg[j] - bm);
          sum += sg[j];
        }
        l[gi] = l[gi] * corr + sum;
        m[gi] = bm;
        if (corr != 1.0f) ops.scale(acc + gi * d, corr, d);
      }
      for (int64_t j = 0; j < n; ++j) {
        const float* vrow = RowAsF32(a.vc, a.cache_bf16, (block * bs + lo + j) * a.c.kv_heads + h, d, vscratch);
        for (int64_t gi = 0; gi < g; ++gi) ops.axpy(acc + gi * d, scores[gi * bs + j], vrow, d);
      }
    }
    for (int64_t gi = 0; gi < g; ++gi) ops.scale(acc + gi * d, 1.0f / l[gi], d);  // l >= 1: pos itself is visible
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
  const RowOps& ops = SelectRowOps();
  return ParallelFor(pool, items, chunks, [a, &ops](int64_t, int64_t begin, int64_t end) {
    std::vector<float> buf;
    for (int64_t i = begin; i < end; ++i)
      if (auto err = AttendItem(a, ops, i / a.c.kv_heads, i % a.c.kv_heads, buf); !err.success()) return err;
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
