// Weight-only int4 and int8 matmuls of a few rows for AVX-512 VNNI CPUs (`core/models/cpu_vnni.py` builds and
// loads this at first use). The activations are rounded to int8 per block of 32 (x ~ d * xq, d = max|x| / 127, as
// llama.cpp rounds them for its Q4_1 and Q8_0 dot products) and vpdpbusd sums 64 products of unsigned 8-bit by
// signed 8-bit values an instruction, four into each 32-bit lane: the weights go in as the unsigned side.
//
// int4 (w = q * scale + min per block of 32, q in 0..15):
//   y[r, n] = sum_b scale[n, b] * d[r, b] * sum_k q[n, b, k] * xq[r, b, k] + sum_b min[n, b] * d[r, b] * xqsum[r, b]
// int8 (w = q * scale[n], stored as u = q + 128):
//   y[r, n] = scale[n] * sum_b d[r, b] * (sum_k u[n, b, k] * xq[r, b, k] - 128 * xqsum[r, b])
// Both are the exact products of the stored weights with the rounded activations, summed in fp32.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

constexpr int kBlock = 32;   // activations per rounding block, weights per int4 scale/min block
constexpr int kQuad = 4;     // int4 blocks per 64-byte load
constexpr int kRowTile = 4;  // activation rows per pass over a weight row
// weight rows per pass (independent accumulators): 4, or 2 where 3-4 activation rows' registers come too (16
// accumulators and their rows' x would not fit the 32 vector registers)
constexpr int kOutTile = 4;
constexpr int kOutTileManyRows = 2;

// x [rows, K] rounded per block: xq in K order, each block's d and the sum of its xq
struct RoundedRows {
    std::vector<int8_t> xq;
    std::vector<float> d;
    std::vector<int32_t> qsum;
};

RoundedRows round_rows(const at::BFloat16* x, int64_t rows, int64_t k) {
    const int64_t blocks = k / kBlock;
    RoundedRows out{std::vector<int8_t>(rows * k), std::vector<float>(rows * blocks), std::vector<int32_t>(rows * blocks)};
    for (int64_t b = 0; b < rows * blocks; ++b) {
        const at::BFloat16* xb = x + b * kBlock;
        float amax = 0.f;
        bool finite = true;
        for (int i = 0; i < kBlock; ++i) {
            const float v = static_cast<float>(xb[i]);
            finite = finite && std::isfinite(v);
            amax = std::max(amax, std::fabs(v));
        }
        // x / amax * 127, not x * (127 / amax): the latter overflows for blocks of bf16's smallest normals
        const bool scaled = finite && amax > 0.f;
        int32_t sum = 0;
        for (int i = 0; i < kBlock; ++i) {
            const int q = scaled ? static_cast<int>(std::nearbyint(static_cast<float>(xb[i]) / amax * 127.f)) : 0;
            out.xq[b * kBlock + i] = static_cast<int8_t>(q);
            sum += q;
        }
        out.d[b] = finite ? amax / 127.f : std::numeric_limits<float>::quiet_NaN();  // a NaN or inf x: a NaN row
        out.qsum[b] = sum;
    }
    return out;
}

// The rows in the int4 weights' order: per quad of blocks, the four blocks' first halves (k 0-15 of each in turn),
// then their second halves, zero past the last block; d per quad on 16 lanes (each block's on its 4 lanes); and
// each block's d * xqsum for the mins.
struct QuadRows {
    std::vector<int8_t> xq;     // [rows, quads, 128]
    std::vector<float> d;       // [rows, quads, 16]
    std::vector<float> xsum;    // [rows, blocks]
    int64_t quads;
};

QuadRows quad_rows(const RoundedRows& rr, int64_t rows, int64_t k) {
    const int64_t blocks = k / kBlock, quads = (blocks + kQuad - 1) / kQuad;
    QuadRows out{std::vector<int8_t>(rows * quads * 128, 0), std::vector<float>(rows * quads * 16, 0.f),
                 std::vector<float>(rows * blocks), quads};
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t b = 0; b < blocks; ++b) {
            const int64_t quad = r * quads + b / kQuad, slot = b % kQuad;
            const int8_t* src = rr.xq.data() + (r * blocks + b) * kBlock;
            int8_t* dst = out.xq.data() + quad * 128 + slot * 16;
            std::copy(src, src + 16, dst);
            std::copy(src + 16, src + 32, dst + 64);
            const float d = rr.d[r * blocks + b];
            std::fill_n(out.d.data() + quad * 16 + slot * 4, 4, d);
            out.xsum[r * blocks + b] = d * static_cast<float>(rr.qsum[r * blocks + b]);
        }
    return out;
}

// Weight rows ahead of a tile's first that it asks the cache for (two tiles: the hardware prefetchers alone left
// the kernel waiting on memory)
constexpr int64_t kPrefetchRows = 8;

inline void prefetch_rows(const void* start, int64_t bytes) {
    const char* p = static_cast<const char*>(start);
    for (int64_t i = 0; i < bytes; i += 64) _mm_prefetch(p + i, _MM_HINT_T0);
}

// int4 rows [n0, n0 + OUT) against activation rows [r0, r0 + R)
template <int OUT, int R>
inline void int4_tile(const uint8_t* packed, const at::Half* scales, const at::Half* mins, const QuadRows& xr,
                      int64_t r0, int64_t n0, int64_t k, int64_t n, at::BFloat16* y) {
    const int64_t blocks = k / kBlock, bytes = k / 2;
    if (r0 == 0 && n0 + OUT + kPrefetchRows <= n) {
        const int64_t ahead = n0 + kPrefetchRows;
        prefetch_rows(packed + ahead * bytes, OUT * bytes);
        prefetch_rows(scales + ahead * blocks, OUT * blocks * 2);
        prefetch_rows(mins + ahead * blocks, OUT * blocks * 2);
    }
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    const __m512i spread = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    __m512 acc[OUT][R];
    for (int o = 0; o < OUT; ++o)
        for (int r = 0; r < R; ++r) acc[o][r] = _mm512_setzero_ps();
    for (int64_t qd = 0; qd < xr.quads; ++qd) {
        const int64_t left = std::min<int64_t>(kQuad, blocks - qd * kQuad);
        const __mmask64 wmask = left == kQuad ? ~0ULL : (1ULL << (left * 16)) - 1;
        const __mmask8 smask = static_cast<__mmask8>((1u << left) - 1);
        __m512i xlo[R], xhi[R];
        __m512 dx[R];
        for (int r = 0; r < R; ++r) {
            const int64_t at = (r0 + r) * xr.quads + qd;
            xlo[r] = _mm512_loadu_si512(xr.xq.data() + at * 128);
            xhi[r] = _mm512_loadu_si512(xr.xq.data() + at * 128 + 64);
            dx[r] = _mm512_loadu_ps(xr.d.data() + at * 16);
        }
        for (int o = 0; o < OUT; ++o) {
            const int64_t row = n0 + o;
            const __m512i v = _mm512_maskz_loadu_epi8(wmask, packed + row * bytes + qd * 64);
            const __m512i lo = _mm512_and_si512(v, low4);
            const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
            const __m128i s16 = _mm_maskz_loadu_epi16(smask, scales + row * blocks + qd * kQuad);
            const __m512 s = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(_mm_cvtph_ps(s16)));
            for (int r = 0; r < R; ++r) {
                const __m512i dot = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, xlo[r]), hi, xhi[r]);
                acc[o][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(s, dx[r]), acc[o][r]);
            }
        }
    }
    for (int o = 0; o < OUT; ++o)
        for (int r = 0; r < R; ++r) {
            // the mins against each block's x sum, 16 blocks at a time, into the same lanes (all are summed)
            const float* xs = xr.xsum.data() + (r0 + r) * blocks;
            const at::Half* mn = mins + (n0 + o) * blocks;
            for (int64_t b = 0; b < blocks; b += 16) {
                const __mmask16 m = blocks - b >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (blocks - b)) - 1);
                const __m512 mv = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, mn + b));
                acc[o][r] = _mm512_fmadd_ps(mv, _mm512_maskz_loadu_ps(m, xs + b), acc[o][r]);
            }
            y[(r0 + r) * n + n0 + o] = static_cast<at::BFloat16>(_mm512_reduce_add_ps(acc[o][r]));
        }
}

// int8 rows [n0, n0 + OUT) against activation rows [r0, r0 + R); 64 weights a step: two blocks, each block's d on
// 8 lanes. Each lane's integer sum starts at -128 times its four xq (`lane_offsets`), so it ends at sum q * xq
// exactly: the offset never meets the fp32 sums (where, for large x, it would overflow).
template <int OUT, int R>
inline void int8_tile(const uint8_t* w, const at::BFloat16* scales, const RoundedRows& xr, const int32_t* lane_offsets,
                      int64_t r0, int64_t n0, int64_t k, int64_t n, at::BFloat16* y) {
    const int64_t blocks = k / kBlock;
    if (r0 == 0 && n0 + OUT + kPrefetchRows <= n) prefetch_rows(w + (n0 + kPrefetchRows) * k, OUT * k);
    __m512 acc[OUT][R];
    for (int o = 0; o < OUT; ++o)
        for (int r = 0; r < R; ++r) acc[o][r] = _mm512_setzero_ps();
    for (int64_t h = 0; h < k / 64; ++h) {
        __m512i xv[R], start[R];
        __m512 dv[R];
        for (int r = 0; r < R; ++r) {
            xv[r] = _mm512_loadu_si512(xr.xq.data() + (r0 + r) * k + h * 64);
            start[r] = _mm512_loadu_si512(lane_offsets + ((r0 + r) * k + h * 64) / 4);
            const float* db = xr.d.data() + (r0 + r) * blocks + h * 2;
            dv[r] = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(db[0]), _mm512_set1_ps(db[1]));
        }
        for (int o = 0; o < OUT; ++o) {
            const __m512i v = _mm512_loadu_si512(w + (n0 + o) * k + h * 64);
            for (int r = 0; r < R; ++r) {
                const __m512i dot = _mm512_dpbusd_epi32(start[r], v, xv[r]);
                acc[o][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), dv[r], acc[o][r]);
            }
        }
    }
    for (int o = 0; o < OUT; ++o)
        for (int r = 0; r < R; ++r)
            y[(r0 + r) * n + n0 + o] = static_cast<at::BFloat16>(_mm512_reduce_add_ps(acc[o][r]) * static_cast<float>(scales[n0 + o]));
}

// every activation row against weight rows [n0, n0 + OUT), kRowTile rows at a time
template <typename Tile>
inline void all_rows(int64_t rows, Tile tile) {
    int64_t r0 = 0;
    for (; r0 + kRowTile <= rows; r0 += kRowTile) tile(std::integral_constant<int, kRowTile>{}, r0);
    switch (rows - r0) {
        case 3: tile(std::integral_constant<int, 3>{}, r0); break;
        case 2: tile(std::integral_constant<int, 2>{}, r0); break;
        case 1: tile(std::integral_constant<int, 1>{}, r0); break;
        default: break;
    }
}

// y [rows, n] by tiles of OUT weight rows over torch's intra-op threads
template <int OUT, typename OutTile>
at::Tensor over_outputs(const at::Tensor& x, int64_t n, int64_t grain_rows, OutTile out_tile) {
    const int64_t tiles = n / OUT;
    at::Tensor y = at::empty({x.size(0), n}, x.options());
    at::BFloat16* out = y.data_ptr<at::BFloat16>();
    at::parallel_for(0, tiles, grain_rows / OUT, [&](int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; ++t) out_tile(std::integral_constant<int, OUT>{}, t * OUT, out);
    });
    for (int64_t n0 = tiles * OUT; n0 < n; ++n0) out_tile(std::integral_constant<int, 1>{}, n0, out);
    return y;
}

// `over_outputs` with the tile width for x's row count
template <typename OutTile>
at::Tensor by_tiles(const at::Tensor& x, int64_t n, int64_t grain_rows, OutTile out_tile) {
    return x.size(0) >= 3 ? over_outputs<kOutTileManyRows>(x, n, grain_rows, out_tile)
                          : over_outputs<kOutTile>(x, n, grain_rows, out_tile);
}

void check_x(const at::Tensor& x) {
    TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kBFloat16, "x: contiguous bf16 [rows, K]");
}

// x [rows, K] bf16; packed [N, K/2] uint8 (per block of 32 weights: byte i holds k = i in its low nibble and
// k = 16 + i in its high one); scales, mins [N, K/32] fp16. Returns [rows, N] bf16.
at::Tensor int4_vnni_mm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, const at::Tensor& mins) {
    check_x(x);
    const int64_t rows = x.size(0), k = x.size(1), n = packed.size(0);
    TORCH_CHECK(k % kBlock == 0 && packed.size(1) * 2 == k && packed.scalar_type() == at::kByte, "packed: uint8 [N, K/2], K % 32 == 0");
    TORCH_CHECK(scales.sizes() == at::IntArrayRef({n, k / kBlock}) && mins.sizes() == scales.sizes(), "scales, mins: [N, K/32]");
    TORCH_CHECK(scales.scalar_type() == at::kHalf && mins.scalar_type() == at::kHalf, "scales, mins: fp16");
    TORCH_CHECK(packed.is_contiguous() && scales.is_contiguous() && mins.is_contiguous(), "contiguous weights");
    const QuadRows xr = quad_rows(round_rows(x.data_ptr<at::BFloat16>(), rows, k), rows, k);
    const uint8_t* w = packed.data_ptr<uint8_t>();
    const at::Half* s = scales.data_ptr<at::Half>();
    const at::Half* m = mins.data_ptr<at::Half>();
    return by_tiles(x, n, 64, [&](auto out, int64_t n0, at::BFloat16* y) {
        all_rows(rows, [&](auto r, int64_t r0) { int4_tile<decltype(out)::value, decltype(r)::value>(w, s, m, xr, r0, n0, k, n, y); });
    });
}

// x [rows, K] bf16, K % 64 == 0; offset_weight [N, K] uint8 (q + 128); scales [N] bf16. Returns [rows, N] bf16.
at::Tensor int8_vnni_mm(const at::Tensor& x, const at::Tensor& offset_weight, const at::Tensor& scales) {
    check_x(x);
    const int64_t rows = x.size(0), k = x.size(1), n = offset_weight.size(0), blocks = k / kBlock;
    TORCH_CHECK(k % 64 == 0 && offset_weight.size(1) == k && offset_weight.scalar_type() == at::kByte, "offset_weight: uint8 [N, K], K % 64 == 0");
    TORCH_CHECK(scales.numel() == n && scales.scalar_type() == at::kBFloat16, "scales: bf16 [N]");
    TORCH_CHECK(offset_weight.is_contiguous() && scales.is_contiguous(), "contiguous weights");
    const RoundedRows xr = round_rows(x.data_ptr<at::BFloat16>(), rows, k);
    std::vector<int32_t> lane_offsets(rows * k / 4);  // -128 times each lane's four xq (`int8_tile`)
    for (int64_t i = 0; i < rows * k / 4; ++i)
        lane_offsets[i] = -128 * (xr.xq[4 * i] + xr.xq[4 * i + 1] + xr.xq[4 * i + 2] + xr.xq[4 * i + 3]);
    const uint8_t* w = offset_weight.data_ptr<uint8_t>();
    const at::BFloat16* s = scales.data_ptr<at::BFloat16>();
    return by_tiles(x, n, 256, [&](auto out, int64_t n0, at::BFloat16* y) {
        all_rows(rows, [&](auto r, int64_t r0) { int8_tile<decltype(out)::value, decltype(r)::value>(w, s, xr, lane_offsets.data(), r0, n0, k, n, y); });
    });
}

}  // namespace

TORCH_LIBRARY(sluice_cpu, m) {
    m.def("int4_vnni_mm(Tensor x, Tensor packed, Tensor scales, Tensor mins) -> Tensor");
    m.def("int8_vnni_mm(Tensor x, Tensor offset_weight, Tensor scales) -> Tensor");
}

TORCH_LIBRARY_IMPL(sluice_cpu, CPU, m) {
    m.impl("int4_vnni_mm", &int4_vnni_mm);
    m.impl("int8_vnni_mm", &int8_vnni_mm);
}
