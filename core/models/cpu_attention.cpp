// Decode attention over the paged KV cache for AVX-512 CPUs: one query token per sequence (built beside
// `cpu_vnni.cpp`, into the same library, by `core/models/cpu_vnni.py`). The compiled CPU decode step's attention
// in torch ops (`kv/attention/torch_decode.py`) became one generated loop that ran on a single thread, over every
// row's padded width; this reads each row's own keys once for the query heads that share them, and spreads
// (sequence, KV head) pairs over torch's intra-op threads.
//
// Per pair: the logits of keys [start, len) (start > 0 only with a sliding window), soft-capped if asked, their
// softmax in fp32 (max subtracted), and the values' weighted sum, all in fp32 whatever the cache's dtype.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

constexpr int kLanes = 16;  // fp32 lanes of a 512-bit register

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }

inline __m512 load16(const at::BFloat16* p) {  // bf16 is the top half of an fp32
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }

inline void store16(at::BFloat16* p, __m512 v) {  // round to nearest even, as torch's conversion does
    alignas(64) float tmp[kLanes];
    _mm512_store_ps(tmp, v);
    for (int i = 0; i < kLanes; ++i) p[i] = static_cast<at::BFloat16>(tmp[i]);
}

// e^x for 16 lanes: 2^n * 2^f with x * log2(e) = n + f, |f| <= 1/2, and 2^f as its Taylor polynomial of degree 7
// (relative error under 1e-8 there); lanes below -87 (e^x under fp32's smallest normal) give 0
inline __m512 exp16(__m512 x) {
    const __m512 t = _mm512_mul_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.f)), _mm512_set1_ps(1.44269504f));
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.693147181f));  // f * ln 2
    __m512 p = _mm512_set1_ps(1.f / 5040.f);
    for (const float c : {1.f / 720.f, 1.f / 120.f, 1.f / 24.f, 1.f / 6.f, 0.5f, 1.f, 1.f})
        p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c));
    return _mm512_scalef_ps(p, n);
}

// f(j, row) for keys start + j in [start, len): their rows in the cache through the block table, a block at a time
// (no division per key); each block's rows of this head (at ``head``, ``token_stride`` apart) are asked of the
// cache while the block before them is read (one block's rows are too few for the hardware's stride prefetcher)
template <typename T, typename F>
inline void for_each_key(const int32_t* table, int64_t start, int64_t len, int64_t block_size, const T* head,
                         int64_t token_stride, int64_t d, F f) {
    const int64_t last = (len - 1) / block_size;
    for (int64_t block = start / block_size, pos = start; pos < len; ++block) {
        if (block < last) {
            const char* next = reinterpret_cast<const char*>(head + static_cast<int64_t>(table[block + 1]) * block_size * token_stride);
            for (int64_t r = 0; r < block_size; ++r)
                for (int64_t b = 0; b < d * static_cast<int64_t>(sizeof(T)); b += 64)
                    _mm_prefetch(next + r * token_stride * static_cast<int64_t>(sizeof(T)) + b, _MM_HINT_T0);
        }
        const int64_t base = static_cast<int64_t>(table[block]) * block_size - block * block_size;
        for (const int64_t end = std::min(len, (block + 1) * block_size); pos < end; ++pos) f(pos - start, base + pos);
    }
}

// acc [D] = sum_j p[j] * value_j over the keys [start, len): D / 16 accumulators held in registers where D is 32,
// 64, 128 or 256 (VECS), else in memory (VECS = 0)
template <typename T, int VECS>
void weigh_values_in(const float* p, const T* v_cache, const int32_t* table, int64_t start, int64_t len,
                     int64_t block_size, int64_t token_stride, int64_t d, float* acc) {
    if constexpr (VECS == 0) {
        std::fill_n(acc, d, 0.f);
        for_each_key(table, start, len, block_size, v_cache, token_stride, d, [&](int64_t j, int64_t row) {
            const __m512 w = _mm512_set1_ps(p[j]);
            for (int64_t i = 0; i < d; i += kLanes) store16(acc + i, _mm512_fmadd_ps(w, load16(v_cache + row * token_stride + i), load16(acc + i)));
        });
    } else {
        __m512 a[VECS];
        for (int v = 0; v < VECS; ++v) a[v] = _mm512_setzero_ps();
        for_each_key(table, start, len, block_size, v_cache, token_stride, d, [&](int64_t j, int64_t row) {
            const __m512 w = _mm512_set1_ps(p[j]);
            const T* value = v_cache + row * token_stride;
            for (int v = 0; v < VECS; ++v) a[v] = _mm512_fmadd_ps(w, load16(value + v * kLanes), a[v]);
        });
        for (int v = 0; v < VECS; ++v) store16(acc + v * kLanes, a[v]);
    }
}

template <typename T>
void weigh_values(const float* p, const T* v_cache, const int32_t* table, int64_t start, int64_t len,
                  int64_t block_size, int64_t token_stride, int64_t d, float* acc) {
    switch (d) {
        case 32: return weigh_values_in<T, 2>(p, v_cache, table, start, len, block_size, token_stride, d, acc);
        case 64: return weigh_values_in<T, 4>(p, v_cache, table, start, len, block_size, token_stride, d, acc);
        case 128: return weigh_values_in<T, 8>(p, v_cache, table, start, len, block_size, token_stride, d, acc);
        case 256: return weigh_values_in<T, 16>(p, v_cache, table, start, len, block_size, token_stride, d, acc);
        default: return weigh_values_in<T, 0>(p, v_cache, table, start, len, block_size, token_stride, d, acc);
    }
}

// The G = Hq / Hk query heads of one KV head over their sequence's keys [start, len): each key read once for all
// of them; the values once per head (its sum held in registers), the head's rows by then in cache.
// q: [G, D] in fp32, scaled; logits: room for [G, len - start]; acc: [G, D], the output.
template <typename T>
void kv_head(const float* q, int64_t group, const T* k_cache, const T* v_cache, const int32_t* table, int64_t start,
             int64_t len, int64_t block_size, int64_t token_stride, int64_t d, float softcap, float* logits, float* acc) {
    const int64_t keys = len - start, vecs = d / kLanes;
    for_each_key(table, start, len, block_size, k_cache, token_stride, d, [&](int64_t j, int64_t row) {
        const T* key = k_cache + row * token_stride;
        for (int64_t g = 0; g < group; ++g) {
            __m512 dot = _mm512_setzero_ps();
            for (int64_t v = 0; v < vecs; ++v) dot = _mm512_fmadd_ps(load16(q + g * d + v * kLanes), load16(key + v * kLanes), dot);
            logits[g * keys + j] = _mm512_reduce_add_ps(dot);
        }
    });
    for (int64_t g = 0; g < group; ++g) {  // softmax of each head's logits, in place
        float* l = logits + g * keys;
        if (softcap > 0.f)
            for (int64_t j = 0; j < keys; ++j) l[j] = softcap * std::tanh(l[j] / softcap);
        const float top = *std::max_element(l, l + keys);
        float total = 0.f;
        int64_t j = 0;
        for (; j + kLanes <= keys; j += kLanes) {
            const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(l + j), _mm512_set1_ps(top)));
            _mm512_storeu_ps(l + j, e);
            total += _mm512_reduce_add_ps(e);
        }
        for (; j < keys; ++j) total += l[j] = std::exp(l[j] - top);
        for (j = 0; j < keys; ++j) l[j] /= total;
    }
    for (int64_t g = 0; g < group; ++g) weigh_values<T>(logits + g * keys, v_cache, table, start, len, block_size, token_stride, d, acc + g * d);
}

template <typename T>
void attend(const at::Tensor& query, const at::Tensor& kv_cache, const at::Tensor& block_tables,
            const at::Tensor& seq_lens, double scale, int64_t window, double softcap, at::Tensor& out) {
    const int64_t b = query.size(0), hq = query.size(1), d = query.size(2);
    const int64_t block_size = kv_cache.size(2), hk = kv_cache.size(3), group = hq / hk;
    const int64_t token_stride = hk * d, width = block_tables.size(1);
    const T* q_all = query.data_ptr<T>();
    const T* k_all = kv_cache.data_ptr<T>();
    const T* v_all = k_all + kv_cache.stride(0);
    const int32_t* tables = block_tables.data_ptr<int32_t>();
    const int32_t* lens = seq_lens.data_ptr<int32_t>();
    T* o_all = out.data_ptr<T>();
    at::parallel_for(0, b * hk, 1, [&](int64_t begin, int64_t end) {
        std::vector<float> q(group * d), acc(group * d), logits(group * width * block_size);
        for (int64_t pair = begin; pair < end; ++pair) {
            const int64_t s = pair / hk, kv_head_index = pair % hk;
            const int64_t len = std::min<int64_t>(lens[s], width * block_size);
            const int64_t start = window > 0 ? std::max<int64_t>(0, len - window) : 0;
            const T* qs = q_all + (s * hq + kv_head_index * group) * d;  // the group's heads, one after another
            T* o = o_all + (s * hq + kv_head_index * group) * d;
            if (len <= start) {  // no key: a zero output (a decode row always has its own)
                std::fill_n(o, group * d, static_cast<T>(0.f));
                continue;
            }
            for (int64_t i = 0; i < group * d; ++i) q[i] = static_cast<float>(qs[i]) * static_cast<float>(scale);
            kv_head<T>(q.data(), group, k_all + kv_head_index * d, v_all + kv_head_index * d, tables + s * width, start,
                       len, block_size, token_stride, d, static_cast<float>(softcap), logits.data(), acc.data());
            for (int64_t i = 0; i < group * d; i += kLanes) store16(o + i, load16(acc.data() + i));
        }
    });
}

// query [B, Hq, D]; kv_cache [2, blocks, block_size, Hk, D] of query's dtype (bf16 or fp32), D % 16 == 0;
// block_tables [B, W] int32, covering each row's seq_lens (int32 [B]) keys. Returns [B, Hq, D].
at::Tensor decode_attention(const at::Tensor& query_in, const at::Tensor& kv_cache, const at::Tensor& block_tables_in,
                            const at::Tensor& seq_lens_in, double scale, int64_t window, double softcap) {
    const at::Tensor query = query_in.contiguous();
    const at::Tensor block_tables = block_tables_in.contiguous(), seq_lens = seq_lens_in.contiguous();
    TORCH_CHECK(query.dim() == 3 && kv_cache.dim() == 5 && kv_cache.size(0) == 2, "query [B, Hq, D], kv_cache [2, blocks, block, Hk, D]");
    TORCH_CHECK(kv_cache.is_contiguous() && kv_cache.scalar_type() == query.scalar_type(), "kv_cache: contiguous, query's dtype");
    TORCH_CHECK(query.scalar_type() == at::kBFloat16 || query.scalar_type() == at::kFloat, "bf16 or fp32");
    TORCH_CHECK(query.size(2) == kv_cache.size(4) && query.size(2) % kLanes == 0, "head size: a multiple of 16");
    TORCH_CHECK(query.size(1) % kv_cache.size(3) == 0, "query heads: a multiple of the KV heads");
    TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == query.size(0) && block_tables.scalar_type() == at::kInt, "block_tables: int32 [B, W]");
    TORCH_CHECK(seq_lens.numel() == query.size(0) && seq_lens.scalar_type() == at::kInt, "seq_lens: int32 [B]");
    at::Tensor out = at::empty(query.sizes(), query.options());
    if (query.scalar_type() == at::kFloat)
        attend<float>(query, kv_cache, block_tables, seq_lens, scale, window, softcap, out);
    else
        attend<at::BFloat16>(query, kv_cache, block_tables, seq_lens, scale, window, softcap, out);
    return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(sluice_cpu, m) {
    m.def("decode_attention(Tensor query, Tensor kv_cache, Tensor block_tables, Tensor seq_lens, float scale, int window, float softcap) -> Tensor");
}

TORCH_LIBRARY_IMPL(sluice_cpu, CPU, m) { m.impl("decode_attention", &decode_attention); }
