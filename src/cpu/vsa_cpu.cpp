// CPU VSA backend, everything but the attention itself: tiling metadata, token gathers, tile
// mean pooling, top-k tile selection and the k2q index transpose.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <tuple>

#include "../core/vsa_backends.h"
#include "cpu_math.h"
#include "vsa_cpu.h"

namespace vidattn::detail {

namespace cpu_vsa {

std::vector<std::int32_t> read_block_sizes(const ArgChecker& check, const TensorView* sizes,
                                           const char* name, std::int64_t tiles,
                                           std::int64_t tile_volume) {
  std::vector<std::int32_t> out(static_cast<std::size_t>(tiles),
                                static_cast<std::int32_t>(tile_volume));
  if (!sizes) return out;
  for (std::int64_t i = 0; i < tiles; ++i) {
    out[i] = int_at(*sizes, i);
    if (out[i] < 0 || out[i] > tile_volume)
      check.fail("argument '", name, "' entry ", i, " is ", out[i], "; block sizes must lie in [0, ",
                 tile_volume, "] (the tile volume)");
  }
  return out;
}

void check_q2k_index(const ArgChecker& check, const TensorView& idx, const TensorView& cnt,
                     std::int64_t num_kv_tiles) {
  const std::int64_t B = idx.shape[0], H = idx.shape[1], Qt = idx.shape[2], K = idx.shape[3];
  const auto* id = static_cast<const std::int32_t*>(idx.data);
  const auto* ct = static_cast<const std::int32_t*>(cnt.data);
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t h = 0; h < H; ++h)
      for (std::int64_t t = 0; t < Qt; ++t) {
        const std::int32_t n = ct[b * cnt.stride[0] + h * cnt.stride[1] + t * cnt.stride[2]];
        if (n < 0 || n > K)
          check.fail("q2k_count[", b, ", ", h, ", ", t, "] is ", n, "; counts must lie in [0, ",
                     K, "] (MaxK)");
        const std::int32_t* row = id + b * idx.stride[0] + h * idx.stride[1] + t * idx.stride[2];
        std::int64_t prev = -1;
        for (std::int32_t s = 0; s < n; ++s) {
          const std::int32_t j = row[s * idx.stride[3]];
          if (j < 0 || j >= num_kv_tiles)
            check.fail("q2k_index[", b, ", ", h, ", ", t, ", ", s, "] is ", j,
                       ", out of range for ", num_kv_tiles, " key tiles");
          if (j <= prev)
            check.fail("q2k_index[", b, ", ", h, ", ", t, ", :", n,
                       "] must be strictly ascending, got ", prev, " then ", j);
          prev = j;
        }
      }
}

}  // namespace cpu_vsa

namespace {

using cpu::Storage;
using cpu::visit_float_dtype;

using cpu_vsa::threads_of;

std::int32_t* int_data(const TensorView& t) { return static_cast<std::int32_t*>(t.data); }

}  // namespace

void cpu_tiling_metadata(const TilingLayout& layout, const TensorView& block_sizes,
                         const TensorView& slot_to_token, const TensorView& token_to_slot,
                         const TensorView& cu_tiles, const TensorView& cu_tokens) {
  std::int32_t* sizes = int_data(block_sizes);
  std::int32_t* s2t = int_data(slot_to_token);
  std::int32_t* t2s = int_data(token_to_slot);
  const TileShape tile = layout.tile;
  const std::int64_t V = tile.volume();
  std::fill(s2t, s2t + layout.padded_len(), -1);
  std::int64_t tile0 = 0, token0 = 0;
  int_data(cu_tiles)[0] = 0;
  int_data(cu_tokens)[0] = 0;
  for (std::size_t video = 0; video < layout.grids.size(); ++video) {
    const VideoGrid g = layout.grids[video];
    const std::int64_t nh = (g.h + tile.h - 1) / tile.h, nw = (g.w + tile.w - 1) / tile.w;
    for (std::int64_t t = 0; t < g.t; ++t)
      for (std::int64_t h = 0; h < g.h; ++h)
        for (std::int64_t w = 0; w < g.w; ++w) {
          const std::int64_t ti = t / tile.t, hi = h / tile.h, wi = w / tile.w;
          // Extents of this (possibly truncated) tile; its tokens keep raster order.
          const std::int64_t et = std::min(tile.t, g.t - ti * tile.t);
          const std::int64_t eh = std::min(tile.h, g.h - hi * tile.h);
          const std::int64_t ew = std::min(tile.w, g.w - wi * tile.w);
          const std::int64_t tile_id = tile0 + (ti * nh + hi) * nw + wi;
          const std::int64_t local = ((t % tile.t) * eh + h % tile.h) * ew + w % tile.w;
          const std::int64_t slot = tile_id * V + local;
          const std::int64_t token = token0 + (t * g.h + h) * g.w + w;
          s2t[slot] = static_cast<std::int32_t>(token);
          t2s[token] = static_cast<std::int32_t>(slot);
          sizes[tile_id] = static_cast<std::int32_t>(et * eh * ew);
        }
    tile0 += layout.tiles_per_video[video];
    token0 += g.numel();
    int_data(cu_tiles)[video + 1] = static_cast<std::int32_t>(tile0);
    int_data(cu_tokens)[video + 1] = static_cast<std::int32_t>(token0);
  }
}

void cpu_gather_tokens(const TensorView& x, const TensorView& index, const TensorView& out,
                       int num_threads) {
  const ArgChecker check("vidattn::gather_tokens");
  const std::int64_t B = x.shape[0], S = x.shape[1], H = x.shape[2], D = x.shape[3];
  const std::int64_t N = index.shape[0];
  for (std::int64_t i = 0; i < N; ++i) {
    const std::int32_t src = cpu_vsa::int_at(index, i);
    if (src < -1 || src >= S)
      check.fail("index[", i, "] is ", src, "; expected -1 (padding) or a row of x in [0, ", S,
                 ")");
  }
  const std::size_t es = dtype_size(x.dtype);
  const auto* in = static_cast<const char*>(x.data);
  auto* o = static_cast<char*>(out.data);
#pragma omp parallel for num_threads(threads_of(num_threads)) schedule(static)
  for (std::int64_t bi = 0; bi < B * N; ++bi) {
    const std::int64_t b = bi / N, i = bi % N;
    const std::int32_t src = cpu_vsa::int_at(index, i);
    for (std::int64_t h = 0; h < H; ++h) {
      char* dst = o + (b * out.stride[0] + i * out.stride[1] + h * out.stride[2]) * es;
      if (src < 0)
        std::memset(dst, 0, D * es);  // all-zero bits are +0 in every float dtype
      else
        std::memcpy(dst, in + (b * x.stride[0] + src * x.stride[1] + h * x.stride[2]) * es,
                    D * es);
    }
  }
}

void cpu_tile_mean_pool(const TensorView& x, const TensorView& block_sizes,
                        std::int64_t tile_volume, const TensorView& out, int num_threads) {
  const ArgChecker check("vidattn::tile_mean_pool");
  const std::int64_t B = x.shape[0], T = out.shape[1], H = x.shape[2], D = x.shape[3];
  const std::vector<std::int32_t> sizes =
      cpu_vsa::read_block_sizes(check, &block_sizes, "block_sizes", T, tile_volume);
  visit_float_dtype(x.dtype, [&](auto tag) {
    using S = Storage<decltype(tag)::value>;
    using Acc = std::conditional_t<decltype(tag)::value == DType::kFloat64, double, float>;
    const auto* in = static_cast<const typename S::type*>(x.data);
    auto* o = static_cast<typename S::type*>(out.data);
#pragma omp parallel num_threads(threads_of(num_threads))
    {
      std::vector<Acc> sum(static_cast<std::size_t>(D));
#pragma omp for schedule(static)
      for (std::int64_t bth = 0; bth < B * T * H; ++bth) {
        const std::int64_t b = bth / (T * H), t = (bth / H) % T, h = bth % H;
        std::fill(sum.begin(), sum.end(), Acc(0));
        const std::int32_t n = sizes[t];
        for (std::int32_t s = 0; s < n; ++s) {
          const auto* row =
              in + b * x.stride[0] + (t * tile_volume + s) * x.stride[1] + h * x.stride[2];
          for (std::int64_t d = 0; d < D; ++d) sum[d] += S::template load<Acc>(row[d]);
        }
        const Acc inv = n > 0 ? Acc(1) / Acc(n) : Acc(0);
        auto* dst = o + b * out.stride[0] + t * out.stride[1] + h * out.stride[2];
        for (std::int64_t d = 0; d < D; ++d) dst[d] = S::template store<Acc>(sum[d] * inv);
      }
    }
  });
}

void cpu_tile_mean_pool_backward(const TensorView& grad_out, const TensorView& block_sizes,
                                 std::int64_t tile_volume, const TensorView& grad_x,
                                 int num_threads) {
  const ArgChecker check("vidattn::tile_mean_pool_backward");
  const std::int64_t B = grad_out.shape[0], T = grad_out.shape[1], H = grad_out.shape[2],
                     D = grad_out.shape[3];
  const std::vector<std::int32_t> sizes =
      cpu_vsa::read_block_sizes(check, &block_sizes, "block_sizes", T, tile_volume);
  visit_float_dtype(grad_out.dtype, [&](auto tag) {
    using S = Storage<decltype(tag)::value>;
    using Acc = std::conditional_t<decltype(tag)::value == DType::kFloat64, double, float>;
    const auto* g = static_cast<const typename S::type*>(grad_out.data);
    auto* o = static_cast<typename S::type*>(grad_x.data);
#pragma omp parallel for num_threads(threads_of(num_threads)) schedule(static)
    for (std::int64_t bth = 0; bth < B * T * H; ++bth) {
      const std::int64_t b = bth / (T * H), t = (bth / H) % T, h = bth % H;
      const std::int32_t n = sizes[t];
      const Acc inv = n > 0 ? Acc(1) / Acc(n) : Acc(0);
      const auto* src = g + b * grad_out.stride[0] + t * grad_out.stride[1] + h * grad_out.stride[2];
      for (std::int64_t s = 0; s < tile_volume; ++s) {
        auto* dst = o + b * grad_x.stride[0] + (t * tile_volume + s) * grad_x.stride[1] +
                    h * grad_x.stride[2];
        for (std::int64_t d = 0; d < D; ++d)
          dst[d] = S::template store<Acc>(s < n ? S::template load<Acc>(src[d]) * inv : Acc(0));
      }
    }
  });
}

namespace {

// Writes the top `k` of scores[0, n) (ties to the lowest index, NaN ranks as -inf) as
// `offset + index`, ascending, into row[0, k), -1 into row[k, max_k); `order` is scratch.
template <class Acc>
void select_row(Acc* scores, std::int64_t n, std::int64_t k, std::int64_t max_k,
                std::int64_t offset, std::vector<std::int32_t>& order, std::int32_t* row,
                std::int64_t row_stride) {
  const Acc neg_inf = -std::numeric_limits<Acc>::infinity();
  for (std::int64_t j = 0; j < n; ++j)
    if (std::isnan(scores[j])) scores[j] = neg_inf;
  order.resize(static_cast<std::size_t>(n));
  std::iota(order.begin(), order.end(), 0);
  k = std::min(k, n);
  auto better = [&](std::int32_t a, std::int32_t b) {
    return scores[a] > scores[b] || (scores[a] == scores[b] && a < b);
  };
  if (k < n) std::nth_element(order.begin(), order.begin() + k, order.end(), better);
  std::sort(order.begin(), order.begin() + k);
  for (std::int64_t s = 0; s < max_k; ++s)
    row[s * row_stride] = s < k ? static_cast<std::int32_t>(offset + order[s]) : -1;
}

// Per-video ranges of packed tiles: video_of[t] for each query tile, and each video's key range.
struct VideoRanges {
  std::vector<std::int32_t> video_of_q;
  std::vector<std::int64_t> k_begin, k_end;
};

VideoRanges video_ranges(const ArgChecker& check, const TopkOptions& o, std::int64_t Qt,
                         std::int64_t Kt) {
  VideoRanges r;
  if (!o.cu_tiles_q) {
    r.video_of_q.assign(static_cast<std::size_t>(Qt), 0);
    r.k_begin = {0};
    r.k_end = {Kt};
    return r;
  }
  const TensorView& cq = *o.cu_tiles_q;
  const TensorView& ck = *o.cu_tiles_k;
  const std::int64_t n = cq.shape[0] - 1;
  using Entry = std::tuple<const TensorView*, const char*, std::int64_t>;
  for (auto [cu, name, total] : {Entry{&cq, "cu_tiles_q", Qt}, Entry{&ck, "cu_tiles_k", Kt}}) {
    if (cpu_vsa::int_at(*cu, 0) != 0)
      check.fail("argument '", name, "' must start at 0, got ", cpu_vsa::int_at(*cu, 0));
    for (std::int64_t i = 0; i < n; ++i)
      if (cpu_vsa::int_at(*cu, i + 1) < cpu_vsa::int_at(*cu, i))
        check.fail("argument '", name, "' must be non-decreasing, but entry ", i + 1,
                   " is below entry ", i);
    if (cpu_vsa::int_at(*cu, n) != total)
      check.fail("argument '", name, "' must end at the number of tiles (", total, "), got ",
                 cpu_vsa::int_at(*cu, n));
  }
  r.video_of_q.resize(static_cast<std::size_t>(Qt));
  for (std::int64_t i = 0; i < n; ++i) {
    for (std::int64_t t = cpu_vsa::int_at(cq, i); t < cpu_vsa::int_at(cq, i + 1); ++t)
      r.video_of_q[t] = static_cast<std::int32_t>(i);
    r.k_begin.push_back(cpu_vsa::int_at(ck, i));
    r.k_end.push_back(cpu_vsa::int_at(ck, i + 1));
  }
  return r;
}

}  // namespace

void cpu_select_topk_tiles(const TensorView& qp, const TensorView& kp, const TopkOptions& o,
                           double scale, const TensorView& q2k_index,
                           const TensorView& q2k_count) {
  const ArgChecker check("vidattn::select_topk_tiles");
  const std::int64_t B = qp.shape[0], Qt = qp.shape[1], Hq = qp.shape[2], D = qp.shape[3];
  const std::int64_t Kt = kp.shape[1], Hkv = kp.shape[2], group = Hq / Hkv;
  const std::int64_t max_k = q2k_index.shape[3];
  const VideoRanges ranges = video_ranges(check, o, Qt, Kt);
  constexpr std::int64_t kRows = 64;  // query tiles scored per block product
  // The block products take the key tile count as an int.
  if (Kt > std::numeric_limits<int>::max())
    check.fail("the CPU backend takes at most 2^31 - 1 key tiles, got ", Kt,
               " (argument 'k_pooled')");
  const int threads = threads_of(o.num_threads);
  const std::int64_t row_len = std::max<std::int64_t>(Kt, 1);
  auto run = [&](auto acc_tag) {
    using Acc = decltype(acc_tag);
    // Pooled tensors are small (one row per tile): pack them once as [H][tiles][D].
    std::vector<Acc> q = cpu::working_buffer<Acc>(check.function(), "'q_pooled'", Hq * Qt * D);
    std::vector<Acc> k = cpu::working_buffer<Acc>(check.function(), "'k_pooled'", Hkv * Kt * D);
    // Each thread's scores of kRows query tiles, allocated here: no exception may leave the
    // parallel region.
    std::vector<Acc> all_scores = cpu::working_buffer<Acc>(
        check.function(), "the coarse scores", threads * kRows * row_len);
    visit_float_dtype(qp.dtype, [&](auto tag) {
      using S = Storage<decltype(tag)::value>;
      auto pack = [&](const TensorView& t, std::int64_t b, std::int64_t H, std::int64_t n,
                      std::vector<Acc>& dst) {
        const auto* src = static_cast<const typename S::type*>(t.data);
        for (std::int64_t h = 0; h < H; ++h)
          for (std::int64_t i = 0; i < n; ++i)
            for (std::int64_t d = 0; d < D; ++d)
              dst[(h * n + i) * D + d] = S::template load<Acc>(
                  src[b * t.stride[0] + i * t.stride[1] + h * t.stride[2] + d]);
      };
      for (std::int64_t b = 0; b < B; ++b) {
        pack(qp, b, Hq, Qt, q);
        pack(kp, b, Hkv, Kt, k);
        const std::int64_t blocks = (Qt + kRows - 1) / kRows;
#pragma omp parallel num_threads(threads)
        {
          Acc* const scores = all_scores.data() + omp_get_thread_num() * kRows * row_len;
          std::vector<std::int32_t> order;
#pragma omp for schedule(dynamic)
          for (std::int64_t hb = 0; hb < Hq * blocks; ++hb) {
            const std::int64_t h = hb / blocks, t0 = (hb % blocks) * kRows;
            const int rows = static_cast<int>(std::min(kRows, Qt - t0));
            cpu::gemm_nt<Acc>(rows, static_cast<int>(Kt), static_cast<int>(D),
                              q.data() + (h * Qt + t0) * D, static_cast<int>(D),
                              k.data() + (h / group) * Kt * D, static_cast<int>(D), Acc(0),
                              scores, static_cast<int>(Kt));
            for (int r = 0; r < rows; ++r) {
              const std::int64_t t = t0 + r;
              const std::int32_t video = ranges.video_of_q[t];
              const std::int64_t k0 = ranges.k_begin[video], n = ranges.k_end[video] - k0;
              Acc* s = scores + r * Kt + k0;
              for (std::int64_t j = 0; j < n; ++j) s[j] *= Acc(scale);
              std::int64_t want = std::min(o.topk, n);
              if (o.sparsity && n > 0) want = std::min(topk_from_sparsity(*o.sparsity, n), max_k);
              select_row(s, n, want, max_k, k0, order,
                         int_data(q2k_index) + b * q2k_index.stride[0] + h * q2k_index.stride[1] +
                             t * q2k_index.stride[2],
                         q2k_index.stride[3]);
              int_data(q2k_count)[b * q2k_count.stride[0] + h * q2k_count.stride[1] +
                                  t * q2k_count.stride[2]] =
                  static_cast<std::int32_t>(std::min(want, n));
            }
          }
        }
      }
    });
  };
  if (qp.dtype == DType::kFloat64)
    run(double{});
  else
    run(float{});
}

void cpu_topk_tiles_from_scores(const TensorView& scores, std::int64_t topk,
                                const TensorView& q2k_index, const TensorView& q2k_count,
                                int num_threads) {
  const std::int64_t B = scores.shape[0], H = scores.shape[1], Qt = scores.shape[2],
                     Kt = scores.shape[3];
  const std::int64_t max_k = q2k_index.shape[3];
  const int threads = threads_of(num_threads);
  auto run = [&](auto acc_tag) {
    using Acc = decltype(acc_tag);
    // Each thread's row of scores, allocated here: no exception may leave the parallel region.
    std::vector<Acc> rows = cpu::working_buffer<Acc>("vidattn::topk_tiles_from_scores",
                                                     "a row of 'scores'", threads * Kt);
    visit_float_dtype(scores.dtype, [&](auto tag) {
      using S = Storage<decltype(tag)::value>;
      const auto* src = static_cast<const typename S::type*>(scores.data);
#pragma omp parallel num_threads(threads)
      {
        Acc* const row = rows.data() + omp_get_thread_num() * Kt;
        std::vector<std::int32_t> order;
#pragma omp for schedule(static)
        for (std::int64_t bht = 0; bht < B * H * Qt; ++bht) {
          const std::int64_t b = bht / (H * Qt), h = (bht / Qt) % H, t = bht % Qt;
          const auto* s = src + b * scores.stride[0] + h * scores.stride[1] + t * scores.stride[2];
          for (std::int64_t j = 0; j < Kt; ++j) row[j] = S::template load<Acc>(s[j]);
          select_row(row, Kt, topk, max_k, 0, order,
                     int_data(q2k_index) + b * q2k_index.stride[0] + h * q2k_index.stride[1] +
                         t * q2k_index.stride[2],
                     q2k_index.stride[3]);
          int_data(q2k_count)[b * q2k_count.stride[0] + h * q2k_count.stride[1] +
                              t * q2k_count.stride[2]] =
              static_cast<std::int32_t>(std::min(topk, Kt));
        }
      }
    });
  };
  if (scores.dtype == DType::kFloat64)
    run(double{});
  else
    run(float{});
}

void cpu_block_sparse_transpose_index(const TensorView& q2k_index, const TensorView& q2k_count,
                                      std::int64_t num_kv_tiles, const TensorView& k2q_offsets,
                                      const TensorView& k2q_index, int num_threads) {
  const ArgChecker check("vidattn::block_sparse_transpose_index");
  cpu_vsa::check_q2k_index(check, q2k_index, q2k_count, num_kv_tiles);
  const std::int64_t B = q2k_index.shape[0], H = q2k_index.shape[1], Qt = q2k_index.shape[2],
                     K = q2k_index.shape[3];
  const auto* idx = static_cast<const std::int32_t*>(q2k_index.data);
  const auto* cnt = static_cast<const std::int32_t*>(q2k_count.data);
#pragma omp parallel num_threads(threads_of(num_threads))
  {
    std::vector<std::int32_t> cursor(static_cast<std::size_t>(num_kv_tiles));
#pragma omp for schedule(static)
    for (std::int64_t bh = 0; bh < B * H; ++bh) {
      const std::int64_t b = bh / H, h = bh % H;
      std::int32_t* off = int_data(k2q_offsets) + b * k2q_offsets.stride[0] + h * k2q_offsets.stride[1];
      std::int32_t* out = int_data(k2q_index) + b * k2q_index.stride[0] + h * k2q_index.stride[1];
      const std::int64_t os = k2q_offsets.stride[2], is = k2q_index.stride[2];
      auto entries = [&](auto&& visit) {  // (query tile, key tile) pairs, query tile ascending
        for (std::int64_t t = 0; t < Qt; ++t) {
          const std::int64_t base = b * q2k_index.stride[0] + h * q2k_index.stride[1] +
                                    t * q2k_index.stride[2];
          const std::int32_t n =
              cnt[b * q2k_count.stride[0] + h * q2k_count.stride[1] + t * q2k_count.stride[2]];
          for (std::int32_t s = 0; s < n; ++s) visit(t, idx[base + s * q2k_index.stride[3]]);
        }
      };
      // Counting pass, exclusive scan, then a stable fill: each key tile's list comes out in
      // ascending query-tile order without a sort.
      std::fill(cursor.begin(), cursor.end(), 0);
      entries([&](std::int64_t, std::int32_t j) { ++cursor[j]; });
      std::int32_t total = 0;
      for (std::int64_t j = 0; j < num_kv_tiles; ++j) {
        off[j * os] = total;
        const std::int32_t c = cursor[j];
        cursor[j] = total;
        total += c;
      }
      off[num_kv_tiles * os] = total;
      entries([&](std::int64_t t, std::int32_t j) {
        out[cursor[j]++ * is] = static_cast<std::int32_t>(t);
      });
      for (std::int64_t e = total; e < Qt * K; ++e) out[e * is] = -1;
    }
  }
}

}  // namespace vidattn::detail
