// Mixture-of-Experts routing: router top-k, token permutation by expert, grouped matmul over the
// permuted rows, and the weighted unpermute that combines the experts' outputs.
//
// The layout all ops share: a token's k choices are "assignments" a = t * k + j. permute sorts the
// assignments by expert, stably (ties keep assignment order), so expert e owns rows
// [offset_e, offset_e + group_sizes[e]) of the permuted buffer, one row per assignment; row_of[t, j]
// names the row that assignment went to.
// Expert ids, rows and group sizes come from data: each is checked, and a bad one is an FFI error.
#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "ffi_common.h"
#include "gemm_f32.h"
#include "parallel.h"

namespace tunix_rt {
namespace {

std::string At(int64_t t, int64_t j) { return "[" + std::to_string(t) + ", " + std::to_string(j) + "]"; }

// Writes f32 values into an f32 or bf16 output buffer at element offset `at`.
void Store(const ffi::AnyBuffer& out, int64_t at, const float* values, int64_t count) {
  if (out.element_type() == ffi::DataType::F32) {
    std::copy(values, values + count, static_cast<float*>(out.untyped_data()) + at);
    return;
  }
  uint16_t* dst = static_cast<uint16_t*>(out.untyped_data()) + at;
  for (int64_t i = 0; i < count; ++i) dst[i] = F32ToBf16(values[i]);
}

// ---- router top-k -----------------------------------------------------------------------------
//
// scores = softmax(logits) or sigmoid(logits); experts are chosen by scores + bias (DeepSeek-V3's
// load-balancing correction; zeros otherwise), optionally first restricted to the best
// `topk_groups` of `n_groups` equal expert groups (a group scores the sum of its `group_top` best
// choice scores: 1 = DeepSeek-V2's max, 2 = V3). Ties go to the lower expert id, as jax.lax.top_k
// and torch.topk do. weights = the chosen experts' scores, renormalised to sum 1 if asked, times
// `scale`.
ffi::Error RouteRow(const float* logits, const float* bias, int64_t e, int64_t k, int32_t scoring, bool renormalize,
                    int64_t n_groups, int64_t topk_groups, int64_t group_top, float scale, int64_t t, float* scores,
                    float* choice, float* weights, int32_t* ids) {
  for (int64_t i = 0; i < e; ++i) {
    if (std::isnan(logits[i]) || logits[i] == std::numeric_limits<float>::infinity())
      return InvalidArgument("router logits" + At(t, i) + " = " + std::to_string(logits[i]) +
                             ": router logits must be finite or -inf");
  }
  if (scoring == 0) {
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t i = 0; i < e; ++i) mx = std::max(mx, logits[i]);
    if (mx == -std::numeric_limits<float>::infinity())
      return InvalidArgument("router logits row " + std::to_string(t) + " is all -inf: softmax is undefined");
    float sum = 0.0f;
    for (int64_t i = 0; i < e; ++i) sum += scores[i] = std::exp(logits[i] - mx);
    for (int64_t i = 0; i < e; ++i) scores[i] /= sum;
  } else {
    for (int64_t i = 0; i < e; ++i) scores[i] = 1.0f / (1.0f + std::exp(-logits[i]));
  }
  for (int64_t i = 0; i < e; ++i) choice[i] = scores[i] + bias[i];
  // Better = larger, then lower index.
  auto better = [&](int64_t a, int64_t b) { return choice[a] > choice[b] || (choice[a] == choice[b] && a < b); };
  if (n_groups > 1) {
    const int64_t per = e / n_groups;
    std::vector<float> group_score(n_groups);
    std::vector<int64_t> idx(per);
    for (int64_t g = 0; g < n_groups; ++g) {
      for (int64_t i = 0; i < per; ++i) idx[i] = g * per + i;
      std::partial_sort(idx.begin(), idx.begin() + group_top, idx.end(), better);
      float s = 0.0f;
      for (int64_t i = 0; i < group_top; ++i) s += choice[idx[i]];
      group_score[g] = s;
    }
    std::vector<int64_t> groups(n_groups);
    for (int64_t g = 0; g < n_groups; ++g) groups[g] = g;
    std::partial_sort(groups.begin(), groups.begin() + topk_groups, groups.end(), [&](int64_t a, int64_t b) {
      return group_score[a] > group_score[b] || (group_score[a] == group_score[b] && a < b);
    });
    std::vector<char> keep(n_groups, 0);
    for (int64_t g = 0; g < topk_groups; ++g) keep[groups[g]] = 1;
    for (int64_t i = 0; i < e; ++i)
      if (!keep[i / per]) choice[i] = -std::numeric_limits<float>::infinity();
  }
  std::vector<int64_t> order(e);
  for (int64_t i = 0; i < e; ++i) order[i] = i;
  std::partial_sort(order.begin(), order.begin() + k, order.end(), better);
  float total = 0.0f;
  for (int64_t j = 0; j < k; ++j) total += scores[order[j]];
  for (int64_t j = 0; j < k; ++j) {
    ids[j] = static_cast<int32_t>(order[j]);
    weights[j] = (renormalize ? scores[order[j]] / total : scores[order[j]]) * scale;
  }
  return ffi::Error::Success();
}

ffi::Future Route(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> logits, ffi::Buffer<ffi::F32> bias,
                  ffi::Result<ffi::Buffer<ffi::F32>> weights, ffi::Result<ffi::Buffer<ffi::S32>> ids, int32_t scoring,
                  bool renormalize, int64_t n_groups, int64_t topk_groups, int64_t group_top, float scale) {
  const auto dims = logits.dimensions();
  if (dims.size() != 2) return ReadyFuture(InvalidArgument("router logits must be (tokens, experts)"));
  const int64_t t = dims[0], e = dims[1], k = LastDim(weights->dimensions());
  if (k < 1 || k > e || bias.element_count() != static_cast<size_t>(e))
    return ReadyFuture(InvalidArgument("router: need 1 <= k <= experts and one bias per expert"));
  if (n_groups < 1 || e % n_groups || topk_groups < 1 || topk_groups > n_groups || group_top < 1 ||
      group_top > e / n_groups || (n_groups > 1 && k > topk_groups * (e / n_groups)))
    return ReadyFuture(InvalidArgument("router: bad expert grouping"));
  const float* lg = logits.typed_data();
  const float* b = bias.typed_data();
  for (int64_t i = 0; i < e; ++i)
    if (!std::isfinite(b[i]))
      return ReadyFuture(InvalidArgument("router bias[" + std::to_string(i) + "] is not finite"));
  float* w = weights->typed_data();
  int32_t* id = ids->typed_data();
  const int64_t chunks = NumChunks(pool, t, std::max<int64_t>(1, 4096 / e));
  return ParallelFor(pool, t, chunks, [=](int64_t, int64_t begin, int64_t end) {
    std::vector<float> scores(e), choice(e);
    for (int64_t r = begin; r < end; ++r) {
      ffi::Error err = RouteRow(lg + r * e, b, e, k, scoring, renormalize, n_groups, topk_groups, group_top, scale, r,
                                scores.data(), choice.data(), w + r * k, id + r * k);
      if (!err.success()) return err;
    }
    return ffi::Error::Success();
  });
}

// ---- permute ------------------------------------------------------------------------------------

// A stable counting sort of the assignments by expert.
ffi::Error SortAssignments(const int32_t* ids, int64_t assignments, int64_t e, int64_t k, int32_t* row_of,
                           int32_t* group_sizes) {
  std::vector<int64_t> count(e, 0);
  for (int64_t a = 0; a < assignments; ++a) {
    if (ids[a] < 0 || ids[a] >= e)
      return InvalidArgument("expert_ids" + At(a / k, a % k) + " = " + std::to_string(ids[a]) + " is outside [0, " +
                             std::to_string(e) + ")");
    ++count[ids[a]];
  }
  std::vector<int64_t> next(e);
  int64_t offset = 0;
  for (int64_t x = 0; x < e; ++x) {
    group_sizes[x] = static_cast<int32_t>(count[x]);
    next[x] = offset;
    offset += count[x];
  }
  for (int64_t a = 0; a < assignments; ++a) row_of[a] = static_cast<int32_t>(next[ids[a]]++);
  return ffi::Error::Success();
}

ffi::Future Permute(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> expert_ids,
                    ffi::Result<ffi::AnyBuffer> xs, ffi::Result<ffi::Buffer<ffi::S32>> row_of,
                    ffi::Result<ffi::Buffer<ffi::S32>> group_sizes) {
  if (x.dimensions().size() != 2 || expert_ids.dimensions().size() != 2 ||
      expert_ids.dimensions()[0] != x.dimensions()[0])
    return ReadyFuture(InvalidArgument("permute: need x (tokens, hidden) and expert_ids (tokens, k)"));
  const int64_t t = x.dimensions()[0], h = x.dimensions()[1];
  const int64_t k = expert_ids.dimensions()[1], e = group_sizes->element_count();
  const int64_t assignments = t * k;
  if (assignments > std::numeric_limits<int32_t>::max())
    return ReadyFuture(InvalidArgument("permute: tokens * k exceeds the int32 row index range"));
  int32_t* rows = row_of->typed_data();
  ffi::Error err = SortAssignments(expert_ids.typed_data(), assignments, e, k, rows, group_sizes->typed_data());
  if (!err.success()) return ReadyFuture(err);
  const size_t item = x.element_type() == ffi::DataType::F32 ? 4 : 2;
  const char* src = static_cast<const char*>(x.untyped_data());
  char* dst = static_cast<char*>(xs->untyped_data());
  const int64_t chunks = NumChunks(pool, assignments, std::max<int64_t>(1, 8192 / std::max<int64_t>(h, 1)));
  return ParallelFor(pool, assignments, chunks, [=](int64_t, int64_t begin, int64_t end) {
    for (int64_t a = begin; a < end; ++a)
      std::copy(src + (a / k) * h * item, src + (a / k + 1) * h * item, dst + rows[a] * h * item);
    return ffi::Error::Success();
  });
}

// ---- unpermute: out[t] = sum_j weights[t, j] * ys[row_of[t, j]] ------------------------------------

ffi::Error CheckRows(const int32_t* rows, int64_t assignments, int64_t k, int64_t num_rows) {
  for (int64_t a = 0; a < assignments; ++a)
    if (rows[a] < -1 || rows[a] >= num_rows)
      return InvalidArgument("row_of" + At(a / k, a % k) + " = " + std::to_string(rows[a]) + " is outside [-1, " +
                             std::to_string(num_rows) + ")");
  return ffi::Error::Success();
}

ffi::Future Unpermute(ffi::ThreadPool pool, ffi::AnyBuffer ys, ffi::Buffer<ffi::S32> row_of,
                      ffi::Buffer<ffi::F32> weights, ffi::Result<ffi::AnyBuffer> out) {
  const int64_t r = ys.dimensions()[0], h = LastDim(ys.dimensions());
  const int64_t t = row_of.dimensions()[0], k = LastDim(row_of.dimensions());
  const int32_t* rows = row_of.typed_data();
  if (weights.element_count() != static_cast<size_t>(t * k))
    return ReadyFuture(InvalidArgument("unpermute: weights must be (tokens, k)"));
  ffi::Error err = CheckRows(rows, t * k, k, r);
  if (!err.success()) return ReadyFuture(err);
  std::shared_ptr<std::vector<float>> keep;
  const float* y = AsF32(ys, &keep);
  const float* w = weights.typed_data();
  const ffi::AnyBuffer o = *out;
  const int64_t chunks = NumChunks(pool, t, std::max<int64_t>(1, 8192 / std::max<int64_t>(h * k, 1)));
  return ParallelFor(pool, t, chunks, [=](int64_t, int64_t begin, int64_t end) {
    std::vector<float> acc(h);
    for (int64_t i = begin; i < end; ++i) {
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t j = 0; j < k; ++j) {
        const int32_t row = rows[i * k + j];
        if (row < 0) continue;
        const float wj = w[i * k + j];
        const float* yr = y + row * h;
        for (int64_t c = 0; c < h; ++c) acc[c] += wj * yr[c];
      }
      Store(o, i * h, acc.data(), h);
    }
    (void)keep;
    return ffi::Error::Success();
  });
}

// d ys[row_of[t, j]] = weights[t, j] * dout[t] (rows nobody reads get zeros); d weights[t, j] =
// dout[t] . ys[row_of[t, j]] (0 where row_of is -1).
ffi::Future UnpermuteBwd(ffi::ThreadPool pool, ffi::AnyBuffer ys, ffi::Buffer<ffi::S32> row_of,
                         ffi::Buffer<ffi::F32> weights, ffi::AnyBuffer dout, ffi::Result<ffi::AnyBuffer> dys,
                         ffi::Result<ffi::Buffer<ffi::F32>> dweights) {
  const int64_t r = ys.dimensions()[0], h = LastDim(ys.dimensions());
  const int64_t t = row_of.dimensions()[0], k = LastDim(row_of.dimensions());
  const int32_t* rows = row_of.typed_data();
  if (dout.element_count() != static_cast<size_t>(t * h) || weights.element_count() != static_cast<size_t>(t * k))
    return ReadyFuture(InvalidArgument("unpermute backward: dout must be (tokens, hidden), weights (tokens, k)"));
  ffi::Error err = CheckRows(rows, t * k, k, r);
  if (!err.success()) return ReadyFuture(err);
  std::vector<char> seen(r, 0);  // each row must belong to one assignment, as permute makes them
  for (int64_t a = 0; a < t * k; ++a) {
    if (rows[a] < 0) continue;
    if (seen[rows[a]]++)
      return ReadyFuture(InvalidArgument("row_of" + At(a / k, a % k) + " = " + std::to_string(rows[a]) +
                                         " repeats a row another assignment holds"));
  }
  std::shared_ptr<std::vector<float>> keep_y, keep_d;
  const float* y = AsF32(ys, &keep_y);
  const float* d = AsF32(dout, &keep_d);
  const float* w = weights.typed_data();
  float* dw = dweights->typed_data();
  const ffi::AnyBuffer dy = *dys;
  const size_t item = dy.element_type() == ffi::DataType::F32 ? 4 : 2;
  std::fill(static_cast<char*>(dy.untyped_data()), static_cast<char*>(dy.untyped_data()) + r * h * item, 0);
  const int64_t chunks = NumChunks(pool, t, std::max<int64_t>(1, 8192 / std::max<int64_t>(h * k, 1)));
  return ParallelFor(pool, t, chunks, [=](int64_t, int64_t begin, int64_t end) {
    std::vector<float> row_grad(h);
    for (int64_t i = begin; i < end; ++i) {
      const float* di = d + i * h;
      for (int64_t j = 0; j < k; ++j) {
        const int32_t row = rows[i * k + j];
        if (row < 0) {
          dw[i * k + j] = 0.0f;
          continue;
        }
        const float* yr = y + row * h;
        float dot = 0.0f;
        const float wj = w[i * k + j];
        for (int64_t c = 0; c < h; ++c) {
          dot += di[c] * yr[c];
          row_grad[c] = wj * di[c];
        }
        dw[i * k + j] = dot;
        Store(dy, row * h, row_grad.data(), h);  // each row belongs to one assignment: no race
      }
    }
    (void)keep_y;
    (void)keep_d;
    return ffi::Error::Success();
  });
}

// ---- grouped matmul ------------------------------------------------------------------------------

// Start row of each group; an error unless every size is >= 0 and they sum to at most `rows`.
ffi::Error GroupOffsets(const int32_t* sizes, int64_t e, int64_t rows, std::vector<int64_t>* offsets) {
  offsets->assign(e + 1, 0);
  for (int64_t g = 0; g < e; ++g) {
    if (sizes[g] < 0)
      return InvalidArgument("group_sizes[" + std::to_string(g) + "] = " + std::to_string(sizes[g]) + " is negative");
    (*offsets)[g + 1] = (*offsets)[g] + sizes[g];
    if ((*offsets)[g + 1] > rows)
      return InvalidArgument("group_sizes sum past the " + std::to_string(rows) + " rows of x");
  }
  return ffi::Error::Success();
}

// One independent product of the split: output rows [r0, r0 + rows) x columns [c0, c0 + cols) of
// group g.
struct Tile {
  int64_t g, r0, rows, c0, cols;
};
constexpr int64_t kTileRows = 192, kTileCols = 256;

std::vector<Tile> Tiles(const std::vector<int64_t>& extent_rows, int64_t cols) {
  std::vector<Tile> tiles;
  for (int64_t g = 0; g < static_cast<int64_t>(extent_rows.size()); ++g)
    for (int64_t r0 = 0; r0 < extent_rows[g]; r0 += kTileRows)
      for (int64_t c0 = 0; c0 < cols; c0 += kTileCols)
        tiles.push_back({g, r0, std::min(kTileRows, extent_rows[g] - r0), c0, std::min(kTileCols, cols - c0)});
  return tiles;
}

// y[rows of group g] = x[rows of group g] @ w[g] (w (E, K, N)), or @ w[g]^T with transpose_w
// (w (E, N, K)): the forward product and the input gradient.
ffi::Future GroupedMatmul(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::Buffer<ffi::S32> group_sizes,
                          ffi::Result<ffi::AnyBuffer> y, bool transpose_w) {
  const auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 3 || yd.size() != 2)
    return ReadyFuture(InvalidArgument("grouped_matmul: need x (rows, K), w (experts, K, N) and y (rows, N)"));
  const int64_t m = xd[0], k = xd[1], e = wd[0], n = yd[1];
  if (group_sizes.element_count() != static_cast<size_t>(e) || wd[transpose_w ? 2 : 1] != k ||
      wd[transpose_w ? 1 : 2] != n || yd[0] != m)
    return ReadyFuture(InvalidArgument("grouped_matmul: shapes of x, w, group_sizes and y do not agree"));
  std::vector<int64_t> offsets;
  ffi::Error err = GroupOffsets(group_sizes.typed_data(), e, m, &offsets);
  if (!err.success()) return ReadyFuture(err);
  auto keep_x = std::make_shared<std::vector<float>>();
  const float* xf = AsF32(x, &keep_x);
  // bf16 weights are widened tile by tile: experts without rows are never read.
  const bool w_f32 = w.element_type() == ffi::DataType::F32;
  const float* wf = static_cast<const float*>(w.untyped_data());
  const uint16_t* w16 = static_cast<const uint16_t*>(w.untyped_data());
  const bool out_f32 = y->element_type() == ffi::DataType::F32;
  auto y_scratch = std::make_shared<std::vector<float>>(out_f32 ? 0 : m * n);
  float* yf = out_f32 ? static_cast<float*>(y->untyped_data()) : y_scratch->data();
  const ffi::AnyBuffer out = *y;
  std::fill(yf + offsets[e] * n, yf + m * n, 0.0f);  // rows past the groups
  if (!out_f32) Store(out, offsets[e] * n, yf + offsets[e] * n, (m - offsets[e]) * n);
  std::vector<int64_t> sizes(e);
  for (int64_t g = 0; g < e; ++g) sizes[g] = offsets[g + 1] - offsets[g];
  auto tiles = std::make_shared<std::vector<Tile>>(Tiles(sizes, n));
  auto offs = std::make_shared<std::vector<int64_t>>(std::move(offsets));
  const int64_t count = tiles->size();
  return ParallelFor(pool, count, NumChunks(pool, count, 1), [=](int64_t, int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const Tile& tl = (*tiles)[i];
      const int64_t row = (*offs)[tl.g] + tl.r0;
      float* c = yf + row * n + tl.c0;
      for (int64_t r = 0; r < tl.rows; ++r) std::fill(c + r * n, c + r * n + tl.cols, 0.0f);
      const StridedMatrix a{xf + row * k, k, 1};
      StridedMatrix b = transpose_w ? StridedMatrix{wf + tl.g * k * n + tl.c0 * k, 1, k}
                                    : StridedMatrix{wf + tl.g * k * n + tl.c0, n, 1};
      std::vector<float> w_tile;
      if (!w_f32) {  // this tile's k x cols slice of w[g], widened to f32 (row-major, cols wide)
        w_tile.resize(k * tl.cols);
        const uint16_t* wg = w16 + tl.g * k * n;
        for (int64_t p = 0; p < k; ++p)
          for (int64_t j = 0; j < tl.cols; ++j)
            w_tile[p * tl.cols + j] = Bf16ToF32(transpose_w ? wg[(tl.c0 + j) * k + p] : wg[p * n + tl.c0 + j]);
        b = StridedMatrix{w_tile.data(), tl.cols, 1};
      }
      GemmAccumulate(a, b, tl.rows, tl.cols, k, c, n);
      if (!out_f32)
        for (int64_t r = 0; r < tl.rows; ++r) Store(out, (row + r) * n + tl.c0, c + r * n, tl.cols);
    }
    (void)keep_x;
    (void)y_scratch;
    return ffi::Error::Success();
  });
}

// dw[g] = x[rows of g]^T @ dy[rows of g]: the weight gradient (zeros for groups without rows).
ffi::Future GroupedMatmulDw(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer dy,
                            ffi::Buffer<ffi::S32> group_sizes, ffi::Result<ffi::AnyBuffer> dw) {
  const int64_t m = x.dimensions()[0], k = LastDim(x.dimensions()), n = LastDim(dy.dimensions());
  const int64_t e = dw->dimensions()[0];
  if (dy.dimensions()[0] != m || group_sizes.element_count() != static_cast<size_t>(e))
    return ReadyFuture(InvalidArgument("grouped_matmul weight gradient: shapes of x, dy and group_sizes do not agree"));
  std::vector<int64_t> offsets;
  ffi::Error err = GroupOffsets(group_sizes.typed_data(), e, m, &offsets);
  if (!err.success()) return ReadyFuture(err);
  auto keep_x = std::make_shared<std::vector<float>>(), keep_d = std::make_shared<std::vector<float>>();
  const float* xf = AsF32(x, &keep_x);
  const float* df = AsF32(dy, &keep_d);
  const bool out_f32 = dw->element_type() == ffi::DataType::F32;
  auto scratch = std::make_shared<std::vector<float>>(out_f32 ? 0 : e * k * n);
  float* wf = out_f32 ? static_cast<float*>(dw->untyped_data()) : scratch->data();
  const ffi::AnyBuffer out = *dw;
  auto tiles = std::make_shared<std::vector<Tile>>(Tiles(std::vector<int64_t>(e, k), n));
  auto offs = std::make_shared<std::vector<int64_t>>(std::move(offsets));
  const int64_t count = tiles->size();
  return ParallelFor(pool, count, NumChunks(pool, count, 1), [=](int64_t, int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const Tile& tl = (*tiles)[i];
      const int64_t row = (*offs)[tl.g], rows_g = (*offs)[tl.g + 1] - row;
      float* c = wf + (tl.g * k + tl.r0) * n + tl.c0;
      for (int64_t r = 0; r < tl.rows; ++r) std::fill(c + r * n, c + r * n + tl.cols, 0.0f);
      const StridedMatrix a{xf + row * k + tl.r0, 1, k};  // x_g^T
      const StridedMatrix b{df + row * n + tl.c0, n, 1};  // dy_g
      GemmAccumulate(a, b, tl.rows, tl.cols, rows_g, c, n);
      if (!out_f32)
        for (int64_t r = 0; r < tl.rows; ++r) Store(out, (tl.g * k + tl.r0 + r) * n + tl.c0, c + r * n, tl.cols);
    }
    (void)keep_x;
    (void)keep_d;
    (void)scratch;
    return ffi::Error::Success();
  });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeRouteHandler, Route,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Attr<int32_t>("scoring")
                                  .Attr<bool>("renormalize")
                                  .Attr<int64_t>("n_groups")
                                  .Attr<int64_t>("topk_groups")
                                  .Attr<int64_t>("group_top")
                                  .Attr<float>("scale"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoePermuteHandler, Permute,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeUnpermuteHandler, Unpermute,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeUnpermuteBwdHandler, UnpermuteBwd,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(GroupedMatmulHandler, GroupedMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<bool>("transpose_w"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(GroupedMatmulDwHandler, GroupedMatmulDw,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>());

}  // namespace tunix_rt
