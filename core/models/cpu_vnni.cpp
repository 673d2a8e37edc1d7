// Weight-only int4 and int8 matmuls of a few rows for AVX-512 VNNI CPUs (`core/models/cpu_vnni.py` builds and
// loads this at first use). The activations are rounded to int8 per block of 32 (x ~ d * xq, d = max|x| / 127, as
// llama.cpp rounds them for its Q4_1 and Q8_0 dot products) and vpdpbusd sums 64 products of unsigned 8-bit by
// signed 8-bit values an instruction, four into each 32-bit lane: the weights go in as the unsigned side.
//
// int4 (w = q * scale + min per block of 32, q in 0..15):
//   y[r, n] = sum_b scale[n, b] * d[r, b] * sum_k q[n, b, k] * xq[r, b, k] + sum_b min[n, b] * d[r, b] * xqsum[r, b]
// int8 (w = q * scale[n], stored as u = q + 128), x to 15 bits (the rounding's residual rounded again, `RoundedRows`):
//   y[r, n] = scale[n] * sum_b d[r, b] * (sum_k q[n, b, k] * xq[r, b, k] + sum_k q[n, b, k] * fine[r, b, k] / 254)
//   with each sum_k q * v taken as sum_k u * v - 128 * sum_k v
// Both are the exact products of the stored weights with the rounded activations, summed in fp32.
//
// The weights lie in groups of 16 output rows, a 32-bit lane per row (`cpu_vnni.py` lays them out): a 64-byte load
// holds four consecutive weights of each of 16 rows, so one vpdpbusd against four activations broadcast to every
// lane advances 16 outputs at once. Each lane ends holding its row's whole sum: no horizontal sums, no shuffles, the
// per-block scales applied to 16 rows by one multiply, and the outputs stored 16 at a time. (Rows as the reduction
// axis instead, a row's dot product spread over the lanes, needed a shuffle per block for the scales and a
// horizontal sum per output: at a decode step's shapes that arithmetic, not the weights' bytes, was the time.)
// A group's weights are one run of memory, read front to back by one thread: one stream for the hardware's
// prefetchers (a pass over several groups at once, or scales and mins apart, was slower for its extra streams).
//   int4, per group of 16 rows and block of 32, 320 bytes: four 64-byte chunks, chunk c's lane r byte j holding
//   k = 4c + j in its low nibble and k = 16 + 4c + j in its high one; then the 16 rows' fp16 scales, then their
//   fp16 mins.
//   int8, per group of 16 rows: K / 4 chunks of 64 bytes, chunk c's lane r byte j holding u at k = 4c + j; the
//   per-row bf16 scales apart, in row order (read once per group).
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
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

constexpr int kBlock = 32;  // activations per rounding block, weights per int4 scale/min block
constexpr int kLanes = 16;  // output rows per weight group: a 32-bit lane each
constexpr int kRowTile = 4;  // activation rows per pass over a group's weights
constexpr int kInt4BlockBytes = 4 * 64 + 2 * kLanes * 2;  // a group's block of int4 weights, scales, mins

// x [rows, K] rounded per block: xq in K order, each block's d and d times the sum of its xq; with ``fine``, also
// what rounding left, rounded again: x = d * (xq + fine / 254) to within d / 508 (a 15-bit x, for products whose
// every value is read: the LM head's logits, where the 8-bit x alone turned near-ties and moved EAGLE's acceptance)
struct RoundedRows {
    std::vector<int8_t> xq;
    std::vector<float> d;
    std::vector<float> xsum;
    std::vector<int32_t> qsum;
    std::vector<int8_t> fine;
    std::vector<int32_t> fine_sum;
    std::vector<float> fine_d;  // d / kFine, the fine part's scale
};
constexpr float kFine = 254.f;  // a residual in [-0.5, 0.5] to int8

inline __m512 bf16_to_fp32(const at::BFloat16* p) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

// fp32 -> bf16 as c10::BFloat16 rounds: to nearest even, a NaN to 0x7FC0
inline __m256i fp32_to_bf16(__m512 v) {
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
    return _mm512_cvtepi32_epi16(r);
}

// a block's 16 scaled values t rounded (to nearest even), and t's residual rounded to int8 at kFine
inline void round_half(__m512 t, int8_t* q, int8_t* fine) {
    const __m512i qi = _mm512_cvtps_epi32(t);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtepi32_epi8(qi));
    if (fine != nullptr) {
        const __m512 left = _mm512_sub_ps(t, _mm512_cvtepi32_ps(qi));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(fine), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(left, _mm512_set1_ps(kFine)))));
    }
}

inline int32_t sum_int8(const int8_t* p) {
    return _mm512_reduce_add_epi32(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))) +
           _mm512_reduce_add_epi32(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16))));
}

RoundedRows round_rows(const at::BFloat16* x, int64_t rows, int64_t k, bool fine = false) {
    const int64_t blocks = k / kBlock;
    RoundedRows out{std::vector<int8_t>(rows * k),       std::vector<float>(rows * blocks),
                    std::vector<float>(rows * blocks),   std::vector<int32_t>(rows * blocks),
                    std::vector<int8_t>(fine ? rows * k : 0), std::vector<int32_t>(fine ? rows * blocks : 0),
                    std::vector<float>(fine ? rows * blocks : 0)};
    const __m512 inf = _mm512_set1_ps(std::numeric_limits<float>::infinity());
    for (int64_t b = 0; b < rows * blocks; ++b) {
        const __m512 lo = bf16_to_fp32(x + b * kBlock), hi = bf16_to_fp32(x + b * kBlock + 16);
        const __m512 alo = _mm512_abs_ps(lo), ahi = _mm512_abs_ps(hi);
        // an inf or a NaN (unordered: not less than inf) anywhere in the block
        const bool finite = !(_mm512_cmp_ps_mask(alo, inf, _CMP_NLT_UQ) | _mm512_cmp_ps_mask(ahi, inf, _CMP_NLT_UQ));
        const float amax = finite ? _mm512_reduce_max_ps(_mm512_max_ps(alo, ahi)) : 0.f;
        // x / amax * 127, not x * (127 / amax): the latter overflows for blocks of bf16's smallest normals
        const bool scaled = finite && amax > 0.f;
        const __m512 a = _mm512_set1_ps(scaled ? amax : 1.f), s = _mm512_set1_ps(scaled ? 127.f : 0.f);
        int8_t* q = out.xq.data() + b * kBlock;
        int8_t* f = fine ? out.fine.data() + b * kBlock : nullptr;
        round_half(_mm512_mul_ps(_mm512_div_ps(lo, a), s), q, f);
        round_half(_mm512_mul_ps(_mm512_div_ps(hi, a), s), q + 16, f == nullptr ? nullptr : f + 16);
        const int32_t sum = sum_int8(q);
        out.d[b] = finite ? amax / 127.f : std::numeric_limits<float>::quiet_NaN();  // a NaN or inf x: a NaN row
        out.qsum[b] = sum;
        out.xsum[b] = out.d[b] * static_cast<float>(sum);
        if (fine) {
            out.fine_sum[b] = sum_int8(f);
            out.fine_d[b] = out.d[b] / kFine;
        }
    }
    return out;
}

// four int8 activations on every lane
inline __m512i broadcast4(const int8_t* p) {
    int32_t v;
    std::memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

// 16 outputs of row r for group g (the last group's lanes past n not written)
inline void store_lanes(at::BFloat16* y, int64_t r, int64_t g, int64_t n, __m512 v) {
    const int64_t n0 = g * kLanes, left = n - n0;
    const __mmask16 m = left >= kLanes ? 0xFFFF : static_cast<__mmask16>((1u << left) - 1);
    _mm256_mask_storeu_epi16(y + r * n + n0, m, fp32_to_bf16(v));
}

// int4 group g against activation rows [r0, r0 + R)
template <int R>
inline void int4_tile(const uint8_t* packed, const RoundedRows& xr, int64_t r0, int64_t g, int64_t k, int64_t n,
                      at::BFloat16* y) {
    const int64_t blocks = k / kBlock;
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    __m512 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    const uint8_t* block = packed + g * blocks * kInt4BlockBytes;
    for (int64_t b = 0; b < blocks; ++b, block += kInt4BlockBytes) {
        __m512i lo_sum[R], hi_sum[R];
        for (int r = 0; r < R; ++r) lo_sum[r] = hi_sum[r] = _mm512_setzero_si512();
        for (int c = 0; c < 4; ++c) {
            const __m512i v = _mm512_loadu_si512(block + 64 * c);
            const __m512i lo = _mm512_and_si512(v, low4);
            const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
            for (int r = 0; r < R; ++r) {
                const int8_t* at = xr.xq.data() + (r0 + r) * k + b * kBlock + 4 * c;
                lo_sum[r] = _mm512_dpbusd_epi32(lo_sum[r], lo, broadcast4(at));
                hi_sum[r] = _mm512_dpbusd_epi32(hi_sum[r], hi, broadcast4(at + 16));
            }
        }
        const __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 256)));
        const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 288)));
        for (int r = 0; r < R; ++r) {
            const int64_t rb = (r0 + r) * blocks + b;
            const __m512 dot = _mm512_cvtepi32_ps(_mm512_add_epi32(lo_sum[r], hi_sum[r]));
            acc[r] = _mm512_fmadd_ps(dot, _mm512_mul_ps(s, _mm512_set1_ps(xr.d[rb])), acc[r]);
            acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(xr.xsum[rb]), acc[r]);
        }
    }
    for (int r = 0; r < R; ++r) store_lanes(y, r0 + r, g, n, acc[r]);
}

// int8 group g against activation rows [r0, r0 + R) (`RoundedRows` with ``fine``); a block's chunks summed in two
// chains for each part of x and row where there are one or two rows (fewer would wait on vpdpbusd's latency), one
// from three (more would outgrow the vector registers)
template <int R>
inline void int8_tile(const uint8_t* w, const at::BFloat16* scales, const RoundedRows& xr, int64_t r0, int64_t g,
                      int64_t k, int64_t n, at::BFloat16* y) {
    const int64_t blocks = k / kBlock;
    __m512 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    const uint8_t* chunk = w + g * k * kLanes;
    for (int64_t b = 0; b < blocks; ++b) {
        constexpr int kChains = R <= 2 ? 2 : 1;
        __m512i sum[2][R], fine[2][R];
        for (int r = 0; r < R; ++r) sum[0][r] = sum[1][r] = fine[0][r] = fine[1][r] = _mm512_setzero_si512();
        for (int c = 0; c < 8; ++c, chunk += 64) {
            const __m512i v = _mm512_loadu_si512(chunk);
            const int h = c % kChains;
            for (int r = 0; r < R; ++r) {
                const int64_t at = (r0 + r) * k + b * kBlock + 4 * c;
                sum[h][r] = _mm512_dpbusd_epi32(sum[h][r], v, broadcast4(xr.xq.data() + at));
                fine[h][r] = _mm512_dpbusd_epi32(fine[h][r], v, broadcast4(xr.fine.data() + at));
            }
        }
        for (int r = 0; r < R; ++r) {
            const int64_t rb = (r0 + r) * blocks + b;
            // sum u * xq - 128 * sum xq == sum q * xq, exactly, in int32 (and so for the fine part)
            const __m512i dot = _mm512_sub_epi32(_mm512_add_epi32(sum[0][r], sum[1][r]), _mm512_set1_epi32(128 * xr.qsum[rb]));
            const __m512i dot_fine = _mm512_sub_epi32(_mm512_add_epi32(fine[0][r], fine[1][r]), _mm512_set1_epi32(128 * xr.fine_sum[rb]));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_set1_ps(xr.d[rb]), acc[r]);
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot_fine), _mm512_set1_ps(xr.fine_d[rb]), acc[r]);
        }
    }
    const __m512 s = bf16_to_fp32(scales + g * kLanes);
    for (int r = 0; r < R; ++r) store_lanes(y, r0 + r, g, n, _mm512_mul_ps(acc[r], s));
}

// y [rows, n] by groups of 16 outputs over torch's intra-op threads (at least ``grain_rows`` outputs a thread),
// each group against every activation row, kRowTile rows at a time
template <typename Tile>
at::Tensor over_groups(const at::Tensor& x, int64_t n, int64_t grain_rows, Tile tile) {
    const int64_t rows = x.size(0), groups = (n + kLanes - 1) / kLanes;
    at::Tensor y = at::empty({rows, n}, x.options());
    at::BFloat16* out = y.data_ptr<at::BFloat16>();
    at::parallel_for(0, groups, std::max<int64_t>(1, grain_rows / kLanes), [&](int64_t begin, int64_t end) {
        for (int64_t g = begin; g < end; ++g)
            for (int64_t r0 = 0; r0 < rows; r0 += kRowTile) {
                switch (std::min<int64_t>(kRowTile, rows - r0)) {
                    case 4: tile(std::integral_constant<int, 4>{}, r0, g, out); break;
                    case 3: tile(std::integral_constant<int, 3>{}, r0, g, out); break;
                    case 2: tile(std::integral_constant<int, 2>{}, r0, g, out); break;
                    default: tile(std::integral_constant<int, 1>{}, r0, g, out); break;
                }
            }
    });
    return y;
}

void check_x(const at::Tensor& x) {
    TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kBFloat16, "x: contiguous bf16 [rows, K]");
}

// x [rows, K] bf16, K % 32 == 0; packed [ceil(n / 16), K / 32 * 320] uint8 (the header's layout). Returns [rows, n]
// bf16.
at::Tensor int4_vnni_mm(const at::Tensor& x, const at::Tensor& packed, int64_t n) {
    check_x(x);
    const int64_t rows = x.size(0), k = x.size(1), groups = (n + kLanes - 1) / kLanes;
    TORCH_CHECK(k % kBlock == 0 && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                    packed.sizes() == at::IntArrayRef({groups, k / kBlock * kInt4BlockBytes}),
                "packed: contiguous uint8 [ceil(N / 16), K / 32 * 320], K % 32 == 0");
    const RoundedRows xr = round_rows(x.data_ptr<at::BFloat16>(), rows, k);
    const uint8_t* w = packed.data_ptr<uint8_t>();
    return over_groups(x, n, 128, [&](auto r, int64_t r0, int64_t g, at::BFloat16* y) {
        int4_tile<decltype(r)::value>(w, xr, r0, g, k, n, y);
    });
}

// x [rows, K] bf16, K % 64 == 0; weight [ceil(n / 16), K * 16] uint8 (q + 128, the header's layout); scales
// [ceil(n / 16) * 16] bf16. Returns [rows, n] bf16.
at::Tensor int8_vnni_mm(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales, int64_t n) {
    check_x(x);
    const int64_t rows = x.size(0), k = x.size(1), groups = (n + kLanes - 1) / kLanes;
    TORCH_CHECK(k % 64 == 0 && weight.scalar_type() == at::kByte && weight.sizes() == at::IntArrayRef({groups, k * 16}),
                "weight: uint8 [ceil(N / 16), K * 16], K % 64 == 0");
    TORCH_CHECK(scales.numel() == groups * kLanes && scales.scalar_type() == at::kBFloat16, "scales: bf16 [ceil(N / 16) * 16]");
    TORCH_CHECK(weight.is_contiguous() && scales.is_contiguous(), "contiguous weights");
    const RoundedRows xr = round_rows(x.data_ptr<at::BFloat16>(), rows, k, /*fine=*/true);
    const uint8_t* w = weight.data_ptr<uint8_t>();
    const at::BFloat16* s = scales.data_ptr<at::BFloat16>();
    return over_groups(x, n, 512, [&](auto r, int64_t r0, int64_t g, at::BFloat16* y) {
        int8_tile<decltype(r)::value>(w, s, xr, r0, g, k, n, y);
    });
}

}  // namespace

TORCH_LIBRARY(sluice_cpu, m) {
    m.def("int4_vnni_mm(Tensor x, Tensor packed, int n) -> Tensor");
    m.def("int8_vnni_mm(Tensor x, Tensor weight, Tensor scales, int n) -> Tensor");
}

TORCH_LIBRARY_IMPL(sluice_cpu, CPU, m) {
    m.impl("int4_vnni_mm", &int4_vnni_mm);
    m.impl("int8_vnni_mm", &int8_vnni_mm);
}
