// Grouped-query attention over an INT8 KV cache, for ONNX Runtime's CPU provider (a custom operator).
//
// Why it exists (docs/generation.md, "Attention over an INT8 cache"): at many concurrent sequences a CPU decode step is
// bound by reading the KV cache. ONNX Runtime's GroupQueryAttention keeps an INT8 cache (k_quant_type PER_CHANNEL)
// but reads it at 2-3 GB/s (it is compute-bound), slower than its float cache. This kernel reads each cached key
// and value row once per KV head, converts it to float in registers and serves every query head of the group from
// it, so one byte per element is what crosses memory.
//
// Semantics: those of com.microsoft.GroupQueryAttention as the factory's text-generation graphs use it (packed or
// separate QKV, rotary inside, past and present sharing one [batch, kv_heads, max_context, head_dim] buffer, per-channel
// scales), checked against ONNX Runtime's own kernel in tests/backend/test_int8_attention.py:
//   inputs  0 query [B, S, N * H] float, or query/key/value packed [B, S, (N + 2K) * H] with 1 and 2 absent
//           1 key, 2 value [B, S, K * H] float (optional)   3 past_key [B, K, M, H] int8   4 past_value (same)
//           5 seqlens_k [B] int32 (a row's total length - 1)   6 total_sequence_length int32
//           7 cos_cache, 8 sin_cache [positions, R / 2] float    9 k_scale, 10 v_scale [K * H] float
//           11 block_table [B, max_blocks] int32 (optional: the paged layout below)
//   outputs 0 attention [B, S, N * H] float   1 present_key   2 present_value (written in place when bound to the past)
//   attributes num_heads, kv_num_heads, scale (0: 1/sqrt(H)), softcap (0: none), local_window_size (-1: none),
//              rotary_interleaved, block_size (0: the pool's dim 2; checked against it when set).
// With a block_table, past key and value are a pool of blocks [num_blocks, K, block_size, H] int8 shared by the rows:
// row b's token at position p lives in block block_table[b][p / block_size], row p % block_size of it (a block holds
// every KV head's rows, each head's block_size x H bytes contiguous), and its new keys and values are written there in
// place. Two rows may name the same block (a shared prefix): what a step writes must fall in blocks of the row's own.
// Without it, the contiguous layout above (max_context = max_blocks * block_size with it).
// A first prompt (S == total_sequence_length) places token s at position s; otherwise row b's tokens follow its
// seqlens_k[b] + 1 - S cached ones. Right-padding tokens (past a row's length) are skipped and their output is 0.
// A new key is rotated, then stored as clamp(round(x / k_scale), -128, 127); attention reads keys and values back
// as q * scale.
//
// The ONNX Runtime API it calls is declared in ort_abi.h (the Python wheel ships no SDK headers). Built on the serving
// host by backends/python_backend/generation/int8_attention.py (g++ -O3 -march=native).

#include <algorithm>
#include <atomic>
#include <climits>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <new>
#include <string>
#include <vector>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "ort_abi.h"

namespace {

using namespace ort_abi;

struct Attention {
  int64_t num_heads = 0, kv_heads = 0, window = -1, interleaved = 0, block_size = 0;
  float scale = 0.f, softcap = 0.f;
};

// exp(x) for x <= 0 (softmax after subtracting the maximum), written so that the compiler vectorizes it:
// 2^(x log2 e) split into an integer power and a degree-6 polynomial on [0, 1) (relative error ~2e-7).
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);
  float t = x * 1.44269504088896341f;
  float whole = std::floor(t);
  float f = t - whole;
  float p = 1.535336188319500e-4f;
  p = p * f + 1.339887440266574e-3f;
  p = p * f + 9.618437357674640e-3f;
  p = p * f + 5.550332471162809e-2f;
  p = p * f + 2.402264791363012e-1f;
  p = p * f + 6.931472028550421e-1f;
  p = p * f + 1.0f;
  int32_t bits = (static_cast<int32_t>(whole) + 127) << 23;
  float power;
  std::memcpy(&power, &bits, sizeof power);
  return p * power;
}

inline float dot_int8(const float* __restrict q, const int8_t* __restrict k, int64_t n) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t d = 0; d < n; ++d) acc += q[d] * static_cast<float>(k[d]);
  return acc;
}

// Rotates x (head_dim values, the first rotary_dim of them paired) at one position's cos/sin row.
inline void rotate(const float* x, float* out, const float* cos, const float* sin, int64_t head_dim,
                   int64_t rotary_dim, bool interleaved) {
  const int64_t half = rotary_dim / 2;
  if (interleaved) {
    for (int64_t i = 0; i < half; ++i) {
      const float a = x[2 * i], b = x[2 * i + 1];
      out[2 * i] = a * cos[i] - b * sin[i];
      out[2 * i + 1] = b * cos[i] + a * sin[i];
    }
  } else {
    for (int64_t i = 0; i < half; ++i) {
      const float a = x[i], b = x[i + half];
      out[i] = a * cos[i] - b * sin[i];
      out[i + half] = b * cos[i] + a * sin[i];
    }
  }
  for (int64_t i = rotary_dim; i < head_dim; ++i) out[i] = x[i];
}

inline int8_t quantize(float x, float scale) {
  const float q = std::nearbyint(x / scale);
  return static_cast<int8_t>(std::min(127.0f, std::max(-128.0f, q)));
}

constexpr size_t kInputs = 12;
constexpr size_t kBlockTable = 11;
constexpr int64_t kQueryBlock = 16;
constexpr int64_t kPrefetchRows = 16;  // cached rows read ahead of use

// A run of n cached rows of one (row, KV head), keys at k and values at v (head_dim bytes a row), and where the rows
// the loops prefetch ahead of them lie (k_ahead + i * H: the row a prefetch distance past row i; with a block table
// the next block's row i, the next run's start, so a prefetch never touches another head's or row's block).
struct Span {
  const int8_t* k;
  const int8_t* v;
  const int8_t* k_ahead;
  const int8_t* v_ahead;
  int64_t n;
};

using TokenKernel = void (*)(const float*, const Span*, int64_t, const float*, int64_t, float, float*, float*);
using WideKernel = void (*)(const float*, const Span*, int64_t, const float*, int64_t, int64_t, float, float*,
                            float*);

struct Step {
  const Attention* op;
  const float* q;  // token (b, s)'s query heads at q + (b * seq + s) * q_stride; its KV heads likewise
  const float* k;
  const float* v;
  int64_t q_stride, kv_stride;
  int8_t* key;
  int8_t* value;
  const int32_t* seqlens;
  const float* cos;
  const float* sin;
  const float* k_scale;
  const float* v_scale;
  float* out;
  int64_t batch, seq, max_context, head_dim, rotary_dim, positions, blocks;
  bool first_prompt;
  TokenKernel kernel = nullptr;  // specialized for (head_dim, group), else null
  WideKernel wide = nullptr;  // for a wide head (any head_dim in whole column blocks) where kernel is null
  const int32_t* table = nullptr;  // the block table [batch, table_width], or null: the contiguous layout
  int64_t table_width = 0, block_size = 0;
  std::atomic<int> bad_position{0};  // set when a token's position is outside the cache

  // Row b's token s: its position, or -1 for right padding.
  int64_t position(int64_t b, int64_t s) const {
    const int64_t total = static_cast<int64_t>(seqlens[b]) + 1;
    const int64_t pos = first_prompt ? s : total - seq + s;
    return (pos < total && pos >= 0) ? pos : -1;
  }
  int8_t* cache(int8_t* base, int64_t b, int64_t h, int64_t pos) const {
    if (table) {
      const int64_t block = table[b * table_width + pos / block_size];
      return base + ((block * op->kv_heads + h) * block_size + pos % block_size) * head_dim;
    }
    return base + ((b * op->kv_heads + h) * max_context + pos) * head_dim;
  }
  // Row b's KV head h's n cached rows from position lo as runs of contiguous rows: one run in the contiguous layout
  // (its prefetches kPrefetchRows rows ahead, as before block tables), a run per block with a block table.
  void spans(int64_t b, int64_t h, int64_t lo, int64_t n, std::vector<Span>& out) const {
    out.clear();
    if (!table) {
      const int8_t* k = cache(key, b, h, lo);
      const int8_t* v = cache(value, b, h, lo);
      out.push_back({k, v, k + kPrefetchRows * head_dim, v + kPrefetchRows * head_dim, n});
      return;
    }
    bool in_order = true;  // each block right after the one before (one KV head: a pool's blocks in order)
    for (int64_t pos = lo, end = lo + n; pos < end;) {
      const int64_t rows = std::min(end, (pos / block_size + 1) * block_size) - pos;
      const int8_t* k = cache(key, b, h, pos);
      const int8_t* v = cache(value, b, h, pos);
      if (!out.empty())
        in_order = in_order && k == out.back().k + out.back().n * head_dim && v == out.back().v + out.back().n * head_dim;
      out.push_back({k, v, k, v, rows});
      pos += rows;
    }
    if (in_order) {  // one run, read and prefetched as the contiguous layout's
      out.resize(1);
      out[0] = {out[0].k, out[0].v, out[0].k + kPrefetchRows * head_dim, out[0].v + kPrefetchRows * head_dim, n};
      return;
    }
    // Each run prefetches the next one's rows: its row i, the next run's row i (a block later at one block a run),
    // less the first run's offset in its block; the last run its own rows (already on their way).
    for (size_t r = 0; r + 1 < out.size(); ++r) {
      const int64_t offset = (r == 0 ? lo % block_size : 0) * head_dim;
      out[r].k_ahead = out[r + 1].k + offset;
      out[r].v_ahead = out[r + 1].v + offset;
    }
  }
};

// Phase 1, one (row, token): rotate and store the token's keys and values, rotate and scale its queries into `out`.
void place_token(void* user, size_t index) {
  Step& st = *static_cast<Step*>(user);
  const Attention& op = *st.op;
  const int64_t b = static_cast<int64_t>(index) / st.seq, s = static_cast<int64_t>(index) % st.seq;
  const int64_t H = st.head_dim, N = op.num_heads, K = op.kv_heads;
  float* out = st.out + (b * st.seq + s) * N * H;
  const int64_t pos = st.position(b, s);
  if (pos < 0) {
    std::fill(out, out + N * H, 0.f);
    return;
  }
  if (pos >= st.max_context || (st.rotary_dim > 0 && pos >= st.positions)) {
    st.bad_position.store(1, std::memory_order_relaxed);
    return;
  }
  const int64_t token = b * st.seq + s;
  const float* q_in = st.q + token * st.q_stride;
  const float* k_in = st.k + token * st.kv_stride;
  const float* v_in = st.v + token * st.kv_stride;
  const float* cos = st.cos + pos * (st.rotary_dim / 2);
  const float* sin = st.sin + pos * (st.rotary_dim / 2);
  float rotated[1024];
  const float scale = op.scale > 0.f ? op.scale : 1.0f / std::sqrt(static_cast<float>(H));
  for (int64_t n = 0; n < N; ++n) {
    rotate(q_in + n * H, out + n * H, cos, sin, H, st.rotary_dim, op.interleaved != 0);
    for (int64_t d = 0; d < H; ++d) out[n * H + d] *= scale;
  }
  for (int64_t h = 0; h < K; ++h) {
    rotate(k_in + h * H, rotated, cos, sin, H, st.rotary_dim, op.interleaved != 0);
    int8_t* k = st.cache(st.key, b, h, pos);
    int8_t* v = st.cache(st.value, b, h, pos);
    const float* vin = v_in + h * H;
    for (int64_t d = 0; d < H; ++d) {
      k[d] = quantize(rotated[d], st.k_scale[h * H + d]);
      v[d] = quantize(vin[d], st.v_scale[h * H + d]);
    }
  }
}

// W floats in one vector register: 16 with AVX-512, else 8 (two SSE registers where there is no AVX2). GCC's
// vector extensions; the int8 conversion is spelled out per instruction set (GCC scalarizes __builtin_convertvector
// from int8).
#if defined(__AVX512F__)
constexpr int W = 16;
#else
constexpr int W = 8;
#endif
typedef float vecf __attribute__((vector_size(W * sizeof(float))));
typedef float v4f __attribute__((vector_size(16)));

inline vecf load_f(const float* p) {
  vecf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// W int8 to float.
inline vecf load_b(const int8_t* p) {
  vecf out;
#if defined(__AVX512F__)
  const __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  std::memcpy(&out, &f, sizeof out);
#elif defined(__AVX2__)
  const __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  std::memcpy(&out, &f, sizeof out);
#else
  for (int i = 0; i < W; ++i) out[i] = static_cast<float>(p[i]);
#endif
  return out;
}

// The sums of four vectors' lanes, {sum a, sum b, sum c, sum d}: rounds of shuffles and adds shared by the four.
inline v4f reduce4(vecf a, vecf b, vecf c, vecf d) {
#if defined(__AVX512F__)
  const vecf ab = __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
                  __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  const vecf cd = __builtin_shufflevector(c, d, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
                  __builtin_shufflevector(c, d, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  const vecf x = __builtin_shufflevector(ab, cd, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
                 __builtin_shufflevector(ab, cd, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  const vecf y = x + __builtin_shufflevector(x, x, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  const vecf z = y + __builtin_shufflevector(y, y, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
  return v4f{z[0], z[4], z[8], z[12]};
#else
  const vecf ab = __builtin_shufflevector(a, b, 0, 1, 2, 3, 8, 9, 10, 11) +
                  __builtin_shufflevector(a, b, 4, 5, 6, 7, 12, 13, 14, 15);  // [a: 4 | b: 4]
  const vecf cd = __builtin_shufflevector(c, d, 0, 1, 2, 3, 8, 9, 10, 11) +
                  __builtin_shufflevector(c, d, 4, 5, 6, 7, 12, 13, 14, 15);  // [c: 4 | d: 4]
  const vecf x = __builtin_shufflevector(ab, cd, 0, 1, 8, 9, 4, 5, 12, 13) +
                 __builtin_shufflevector(ab, cd, 2, 3, 10, 11, 6, 7, 14, 15);  // [a a c c b b d d]
  const vecf y = x + __builtin_shufflevector(x, x, 1, 0, 3, 2, 5, 4, 7, 6);
  return v4f{y[0], y[4], y[2], y[6]};
#endif
}

// Softmax in place over each of the G score rows (n keys each), softcap first when set.
void softmax_rows(float* scores, int64_t G, int64_t n, float softcap) {
  for (int64_t g = 0; g < G; ++g) {
    float* sc = scores + g * n;
    if (softcap > 0.f)
      for (int64_t j = 0; j < n; ++j) sc[j] = softcap * std::tanh(sc[j] / softcap);
    float top = sc[0];
    for (int64_t j = 1; j < n; ++j) top = std::max(top, sc[j]);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < n; ++j) {
      const float e = exp_nonpositive(sc[j] - top);
      sc[j] = e;
      sum += e;
    }
    const float inv = 1.0f / sum;
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) sc[j] *= inv;
  }
}

// One token's G query heads (query: G x H floats, the key scale folded in) over n cached rows, head_dim H = W * HV:
// each cached key and value row is loaded and converted once and serves the G heads from registers.
template <int HV, int G>
void attend_token(const float* query, const Span* spans, int64_t runs, const float* v_scale, int64_t n, float softcap,
                  float* scores, float* out) {
  constexpr int64_t H = W * HV;
  vecf q[G][HV];
  for (int g = 0; g < G; ++g)
    for (int v = 0; v < HV; ++v) q[g][v] = load_f(query + g * H + W * v);
  const vecf zero{};
  for (int64_t run = 0, j = 0; run < runs; ++run) {
    const int8_t* keys = spans[run].k;
    const int8_t* ahead = spans[run].k_ahead;
    for (int64_t i = 0; i < spans[run].n; ++i, ++j) {
      __builtin_prefetch(ahead + i * H);  // past a page the hardware prefetcher starts over
      if (H > 64) __builtin_prefetch(ahead + i * H + 64);
      vecf k[HV];
      for (int v = 0; v < HV; ++v) k[v] = load_b(keys + i * H + W * v);
      vecf a[G];
      for (int g = 0; g < G; ++g) {
        a[g] = q[g][0] * k[0];
        for (int v = 1; v < HV; ++v) a[g] += q[g][v] * k[v];
      }
      for (int g0 = 0; g0 < G; g0 += 4) {
        const v4f r = reduce4(a[g0], g0 + 1 < G ? a[g0 + 1] : zero, g0 + 2 < G ? a[g0 + 2] : zero,
                              g0 + 3 < G ? a[g0 + 3] : zero);
        for (int t = 0; t < 4 && g0 + t < G; ++t) scores[(g0 + t) * n + j] = r[t];
      }
    }
  }
  softmax_rows(scores, G, n, softcap);
  vecf acc[G][HV];
  for (int g = 0; g < G; ++g)
    for (int v = 0; v < HV; ++v) acc[g][v] = zero;
  for (int64_t run = 0, j = 0; run < runs; ++run) {
    const int8_t* values = spans[run].v;
    const int8_t* ahead = spans[run].v_ahead;
    for (int64_t i = 0; i < spans[run].n; ++i, ++j) {
      __builtin_prefetch(ahead + i * H);
      if (H > 64) __builtin_prefetch(ahead + i * H + 64);
      vecf x[HV];
      for (int v = 0; v < HV; ++v) x[v] = load_b(values + i * H + W * v);
      for (int g = 0; g < G; ++g) {
        const float p = scores[g * n + j];
        for (int v = 0; v < HV; ++v) acc[g][v] += p * x[v];
      }
    }
  }
  for (int g = 0; g < G; ++g)
    for (int v = 0; v < HV; ++v) {
      const vecf o = acc[g][v] * load_f(v_scale + W * v);
      std::memcpy(out + g * H + W * v, &o, sizeof o);
    }
}

template <int HV>
TokenKernel token_kernel_for_group(int64_t G) {
  switch (G) {
    case 1: return attend_token<HV, 1>;
    case 2: return attend_token<HV, 2>;
    case 3: return attend_token<HV, 3>;
    case 4: return attend_token<HV, 4>;
    case 5: return attend_token<HV, 5>;
    case 6: return attend_token<HV, 6>;
    case 7: return attend_token<HV, 7>;
    case 8: return attend_token<HV, 8>;
    default: return nullptr;
  }
}

// Accumulator registers a wide-head loop keeps: 16 of AVX-512's 32 vector registers, 8 of AVX2's 16 (the rest hold
// the converted cache vectors, a query vector or a broadcast probability).
constexpr int kAccumulators = W == 16 ? 16 : 8;

// The largest power of two <= kAccumulators / G (at least 1): cached rows per step of the score loop, and vectors
// per column block of the value loop.
constexpr int per_group(int G) {
  int r = 1;
  while (2 * r * G <= kAccumulators) r *= 2;
  return r;
}

// One token's G query heads over n cached rows for a wide head (Gemma 3's 256: G * H / W vectors of queries do not
// fit the registers): scores take R cached key rows a step, each query vector loaded (from L1) once for the R rows and
// each key vector converted once for the G heads; values are read in column blocks of CB vectors (with AVX-512 one
// 64-byte cache line of each row a pass), the G heads' accumulators of the block in registers, so no accumulator goes
// through memory per row. Every cached byte still crosses from memory once: a row's later column blocks are read
// again from L1/L2 in the next pass. The caller guarantees H % (W * CB) == 0.
template <int G>
void attend_token_wide(const float* query, const Span* spans, int64_t runs, const float* v_scale, int64_t H,
                       int64_t n, float softcap, float* scores, float* out) {
  constexpr int R = per_group(G), CB = per_group(G);
  const int64_t HV = H / W;
  const vecf zero{};
  for (int64_t run = 0, j = 0; run < runs; ++run) {  // j: the run's first row among the n
    const int8_t* keys = spans[run].k;
    const int8_t* ahead = spans[run].k_ahead;
    const int64_t m = spans[run].n;
    int64_t i = 0;
    for (; i + R <= m; i += R) {
      vecf a[R][G];
      for (int r = 0; r < R; ++r)
        for (int g = 0; g < G; ++g) a[r][g] = zero;
      const int8_t* row = keys + i * H;
      for (int64_t line = 0; line < R * H; line += 64) __builtin_prefetch(ahead + i * H + line);
      for (int64_t v = 0; v < HV; ++v) {
        vecf k[R];
        for (int r = 0; r < R; ++r) k[r] = load_b(row + r * H + W * v);
        for (int g = 0; g < G; ++g) {
          const vecf q = load_f(query + g * H + W * v);
          for (int r = 0; r < R; ++r) a[r][g] += q * k[r];
        }
      }
      for (int r = 0; r < R; ++r)
        for (int g0 = 0; g0 < G; g0 += 4) {
          const v4f s = reduce4(a[r][g0], g0 + 1 < G ? a[r][g0 + 1] : zero, g0 + 2 < G ? a[r][g0 + 2] : zero,
                                g0 + 3 < G ? a[r][g0 + 3] : zero);
          for (int t = 0; t < 4 && g0 + t < G; ++t) scores[(g0 + t) * n + j + i + r] = s[t];
        }
    }
    for (; i < m; ++i) {
      vecf a[G];
      for (int g = 0; g < G; ++g) a[g] = zero;
      for (int64_t v = 0; v < HV; ++v) {
        const vecf k = load_b(keys + i * H + W * v);
        for (int g = 0; g < G; ++g) a[g] += load_f(query + g * H + W * v) * k;
      }
      for (int g0 = 0; g0 < G; g0 += 4) {
        const v4f s = reduce4(a[g0], g0 + 1 < G ? a[g0 + 1] : zero, g0 + 2 < G ? a[g0 + 2] : zero,
                              g0 + 3 < G ? a[g0 + 3] : zero);
        for (int t = 0; t < 4 && g0 + t < G; ++t) scores[(g0 + t) * n + j + i] = s[t];
      }
    }
    j += m;
  }
  softmax_rows(scores, G, n, softcap);
  for (int64_t c0 = 0; c0 < HV; c0 += CB) {
    vecf acc[G][CB];
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < CB; ++c) acc[g][c] = zero;
    for (int64_t run = 0, j = 0; run < runs; ++run) {
      const int8_t* column = spans[run].v + W * c0;
      const int8_t* ahead = spans[run].v_ahead;
      for (int64_t i = 0; i < spans[run].n; ++i, ++j) {
        if (c0 == 0)  // the first pass asks for a row's every line: the later passes find them in L1 / L2
          for (int64_t line = 0; line < H; line += 64) __builtin_prefetch(ahead + i * H + line);
        vecf x[CB];
        for (int c = 0; c < CB; ++c) x[c] = load_b(column + i * H + W * c);
        for (int g = 0; g < G; ++g) {
          const float p = scores[g * n + j];
          for (int c = 0; c < CB; ++c) acc[g][c] += p * x[c];
        }
      }
    }
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < CB; ++c) {
        const vecf o = acc[g][c] * load_f(v_scale + W * (c0 + c));
        std::memcpy(out + g * H + W * (c0 + c), &o, sizeof o);
      }
  }
}

// The wide-head kernel for group size G at head_dim H, or null (H not a whole number of its column blocks).
WideKernel wide_kernel(int64_t H, int64_t G) {
  switch (G) {
#define MF_WIDE(g) \
  case g: return H % (W * per_group(g)) == 0 ? attend_token_wide<g> : nullptr;
    MF_WIDE(1) MF_WIDE(2) MF_WIDE(3) MF_WIDE(4) MF_WIDE(5) MF_WIDE(6) MF_WIDE(7) MF_WIDE(8)
#undef MF_WIDE
    default: return nullptr;
  }
}

// The specialized kernel for head_dim H and group size G (query heads per KV head), or null: the wide-head one, else
// the general one then.
TokenKernel token_kernel(int64_t H, int64_t G) {
  if (H == 64) return token_kernel_for_group<64 / W>(G);
  if (H == 128) return token_kernel_for_group<128 / W>(G);
  return nullptr;
}

// The same for any head_dim.
void attend_token_any(const float* query, const Span* spans, int64_t runs, const float* v_scale, int64_t G,
                      int64_t H, int64_t n, float softcap, float* scores, float* acc, float* out) {
  for (int64_t run = 0, j = 0; run < runs; ++run)
    for (int64_t i = 0; i < spans[run].n; ++i, ++j)
      for (int64_t g = 0; g < G; ++g) scores[g * n + j] = dot_int8(query + g * H, spans[run].k + i * H, H);
  softmax_rows(scores, G, n, softcap);
  std::fill(acc, acc + G * H, 0.f);
  for (int64_t run = 0, j = 0; run < runs; ++run)
    for (int64_t i = 0; i < spans[run].n; ++i, ++j) {
      const int8_t* v = spans[run].v + i * H;
      for (int64_t g = 0; g < G; ++g) {
        const float p = scores[g * n + j];
        float* a = acc + g * H;
#pragma omp simd
        for (int64_t d = 0; d < H; ++d) a[d] += p * static_cast<float>(v[d]);
      }
    }
  for (int64_t g = 0; g < G; ++g)
    for (int64_t d = 0; d < H; ++d) out[g * H + d] = acc[g * H + d] * v_scale[d];
}

// Phase 2, one (row, KV head, block of tokens): every query head of the group attends over the cached rows.
void attend(void* user, size_t index) {
  Step& st = *static_cast<Step*>(user);
  const Attention& op = *st.op;
  const int64_t block = static_cast<int64_t>(index) % st.blocks;
  const int64_t h = (static_cast<int64_t>(index) / st.blocks) % op.kv_heads;
  const int64_t b = static_cast<int64_t>(index) / (st.blocks * op.kv_heads);
  const int64_t H = st.head_dim, N = op.num_heads, G = N / op.kv_heads;
  const float* ks = st.k_scale + h * H;
  const float* vs = st.v_scale + h * H;
  thread_local std::vector<float> scores, query, acc;
  thread_local std::vector<Span> spans;
  query.resize(static_cast<size_t>(G * H));
  acc.resize(static_cast<size_t>(G * H));
  for (int64_t s = block * kQueryBlock; s < std::min(st.seq, (block + 1) * kQueryBlock); ++s) {
    const int64_t pos = st.position(b, s);
    if (pos < 0 || pos >= st.max_context) continue;
    const int64_t lo = op.window >= 0 ? std::min(pos, std::max<int64_t>(0, pos - op.window + 1)) : 0;
    const int64_t n_keys = pos - lo + 1;
    if (scores.size() < static_cast<size_t>(G * n_keys)) scores.resize(static_cast<size_t>(G * n_keys));
    float* out = st.out + (b * st.seq + s) * N * H + h * G * H;
    for (int64_t g = 0; g < G; ++g)
      for (int64_t d = 0; d < H; ++d) query[g * H + d] = out[g * H + d] * ks[d];  // the key's scale folded in
    st.spans(b, h, lo, n_keys, spans);
    const Span* runs = spans.data();
    const int64_t count = static_cast<int64_t>(spans.size());
    if (st.kernel)
      st.kernel(query.data(), runs, count, vs, n_keys, op.softcap, scores.data(), out);
    else if (st.wide)
      st.wide(query.data(), runs, count, vs, H, n_keys, op.softcap, scores.data(), out);
    else
      attend_token_any(query.data(), runs, count, vs, G, H, n_keys, op.softcap, scores.data(), acc.data(), out);
  }
}

OrtStatus* attr_int(const OrtKernelInfo* info, const char* name, int64_t* out, bool required) {
  OrtStatus* s = fn<OrtStatus* (*)(const OrtKernelInfo*, const char*, int64_t*)>(kKernelInfoGetAttributeInt64)(info, name, out);
  if (s && !required) {
    fn<void (*)(OrtStatus*)>(kReleaseStatus)(s);
    return nullptr;
  }
  return s;
}

OrtStatus* attr_float(const OrtKernelInfo* info, const char* name, float* out) {
  OrtStatus* s = fn<OrtStatus* (*)(const OrtKernelInfo*, const char*, float*)>(kKernelInfoGetAttributeFloat)(info, name, out);
  if (s) fn<void (*)(OrtStatus*)>(kReleaseStatus)(s);  // absent: the default stays
  return nullptr;
}

OrtStatus* create_kernel(const CustomOp*, const OrtApi*, const OrtKernelInfo* info, void** kernel) {
  auto* op = new (std::nothrow) Attention();
  if (!op) return error(kOrtRuntimeException, "Int8KVAttention: out of memory");
  OrtStatus* s = attr_int(info, "num_heads", &op->num_heads, true);
  if (!s) s = attr_int(info, "kv_num_heads", &op->kv_heads, true);
  if (!s) s = attr_int(info, "local_window_size", &op->window, false);
  if (!s) s = attr_int(info, "rotary_interleaved", &op->interleaved, false);
  if (!s) s = attr_int(info, "block_size", &op->block_size, false);
  if (!s) s = attr_float(info, "scale", &op->scale);
  if (!s) s = attr_float(info, "softcap", &op->softcap);
  if (!s && (op->num_heads <= 0 || op->kv_heads <= 0 || op->num_heads % op->kv_heads != 0))
    s = error(kOrtInvalidArgument, "Int8KVAttention: num_heads must be a positive multiple of kv_num_heads");
  if (s) {
    delete op;
    return s;
  }
  *kernel = op;
  return nullptr;
}

OrtStatus* compute(void* kernel, OrtKernelContext* context) {
  const Attention& op = *static_cast<Attention*>(kernel);
  Tensor in[kInputs];
  bool present[kInputs] = {};
  for (size_t i = 0; i < kInputs; ++i) {
    const OrtValue* value = nullptr;
    if (OrtStatus* s = fn<OrtStatus* (*)(const OrtKernelContext*, size_t, const OrtValue**)>(kKernelContextGetInput)(context, i, &value)) return s;
    present[i] = value != nullptr;
    if (!value && i != 1 && i != 2 && i != kBlockTable) return error(kOrtInvalidArgument, "Int8KVAttention: input " + std::to_string(i) + " is missing");
    if (value)
      if (OrtStatus* s = describe(value, &in[i])) return s;
  }
  const Tensor &query = in[0], &key = in[1], &value = in[2], &past_k = in[3], &past_v = in[4], &seqlens = in[5],
               &total = in[6], &cos = in[7], &sin = in[8], &k_scale = in[9], &v_scale = in[10];
  const int64_t N = op.num_heads, K = op.kv_heads;
  if (present[1] != present[2]) return error(kOrtInvalidArgument, "Int8KVAttention: key and value come together or not at all");
  const bool packed = !present[1];
  const int64_t width = packed ? N + 2 * K : N;  // heads in the query input
  if (query.type != kFloat || query.dims.size() != 3 || query.dims[2] % width != 0)
    return error(kOrtInvalidArgument, std::string("Int8KVAttention: the query must be float [batch, seq, ") +
                                          (packed ? "(num_heads + 2 * kv_num_heads)" : "num_heads") + " * head_dim], got " + shape(query));
  const int64_t B = query.dims[0], S = query.dims[1], H = query.dims[2] / width;
  if (!packed)
    for (const Tensor* t : {&key, &value})
      if (t->type != kFloat || t->dims.size() != 3 || t->dims[0] != B || t->dims[1] != S || t->dims[2] != K * H)
        return error(kOrtInvalidArgument, "Int8KVAttention: key and value must be float [batch, seq, kv_num_heads * head_dim], got " + shape(*t));
  if (H > 1024) return error(kOrtInvalidArgument, "Int8KVAttention: head_dim above 1024");
  const bool paged = present[kBlockTable];
  const Tensor& table = in[kBlockTable];
  if (paged) {
    for (const Tensor* t : {&past_k, &past_v})
      if (t->type != kInt8 || t->dims.size() != 4 || t->dims != past_k.dims || t->dims[1] != K || t->dims[3] != H ||
          t->dims[2] < 1 || (op.block_size > 0 && t->dims[2] != op.block_size))
        return error(kOrtInvalidArgument, "Int8KVAttention: with a block table past key/value must be one int8 pool [num_blocks, kv_num_heads, block_size" +
                                              (op.block_size > 0 ? " " + std::to_string(op.block_size) : std::string()) + ", head_dim], got " + shape(*t));
    if (table.type != kInt32 || table.dims.size() != 2 || table.dims[0] != B || table.dims[1] < 1)
      return error(kOrtInvalidArgument, "Int8KVAttention: block_table must be int32 [batch, max_blocks], got " + shape(table));
  } else {
    for (const Tensor* t : {&past_k, &past_v})
      if (t->type != kInt8 || t->dims.size() != 4 || t->dims[0] != B || t->dims[1] != K || t->dims[3] != H || t->dims[2] < 1)
        return error(kOrtInvalidArgument, "Int8KVAttention: past key/value must be int8 [batch, kv_num_heads, max_context, head_dim], got " + shape(*t));
  }
  if (seqlens.type != kInt32 || seqlens.dims.size() != 1 || seqlens.dims[0] != B)
    return error(kOrtInvalidArgument, "Int8KVAttention: seqlens_k must be int32 [batch], got " + shape(seqlens));
  if (total.type != kInt32) return error(kOrtInvalidArgument, "Int8KVAttention: total_sequence_length must be int32");
  if (cos.type != kFloat || sin.type != kFloat || cos.dims.size() != 2 || cos.dims != sin.dims || 2 * cos.dims[1] > H)
    return error(kOrtInvalidArgument, "Int8KVAttention: cos/sin caches must be float [positions, rotary_dim / 2], got " + shape(cos));
  for (const Tensor* t : {&k_scale, &v_scale}) {
    int64_t n = 1;
    for (int64_t d : t->dims) n *= d;
    if (t->type != kFloat || n != K * H)
      return error(kOrtInvalidArgument, "Int8KVAttention: k_scale/v_scale must hold kv_num_heads * head_dim floats, got " + shape(*t));
  }
  const int64_t out_dims[3] = {B, S, N * H};
  OrtValue* outs[3] = {nullptr, nullptr, nullptr};
  auto get_output = fn<OrtStatus* (*)(OrtKernelContext*, size_t, const int64_t*, size_t, OrtValue**)>(kKernelContextGetOutput);
  if (OrtStatus* s = get_output(context, 0, out_dims, 3, &outs[0])) return s;
  if (OrtStatus* s = get_output(context, 1, past_k.dims.data(), 4, &outs[1])) return s;
  if (OrtStatus* s = get_output(context, 2, past_v.dims.data(), 4, &outs[2])) return s;
  Tensor out, present_k, present_v;
  if (OrtStatus* s = describe(outs[0], &out)) return s;
  if (OrtStatus* s = describe(outs[1], &present_k)) return s;
  if (OrtStatus* s = describe(outs[2], &present_v)) return s;
  const size_t cache_bytes = static_cast<size_t>(past_k.dims[0] * K * past_k.dims[2] * H);
  // Bound to the same buffers (the backend's KV slots) the cache is updated in place; else the present starts as a copy.
  if (present_k.data != past_k.data) std::memcpy(present_k.data, past_k.data, cache_bytes);
  if (present_v.data != past_v.data) std::memcpy(present_v.data, past_v.data, cache_bytes);
  if (B == 0 || S == 0) return nullptr;

  Step st;
  st.op = &op;
  st.q = static_cast<const float*>(query.data);
  if (packed) {
    st.q_stride = st.kv_stride = (N + 2 * K) * H;
    st.k = st.q + N * H;
    st.v = st.q + (N + K) * H;
  } else {
    st.q_stride = N * H;
    st.kv_stride = K * H;
    st.k = static_cast<const float*>(key.data);
    st.v = static_cast<const float*>(value.data);
  }
  st.key = static_cast<int8_t*>(present_k.data);
  st.value = static_cast<int8_t*>(present_v.data);
  st.seqlens = static_cast<const int32_t*>(seqlens.data);
  st.cos = static_cast<const float*>(cos.data);
  st.sin = static_cast<const float*>(sin.data);
  st.k_scale = static_cast<const float*>(k_scale.data);
  st.v_scale = static_cast<const float*>(v_scale.data);
  st.out = static_cast<float*>(out.data);
  st.batch = B;
  st.seq = S;
  st.max_context = past_k.dims[2];
  if (paged) {
    st.table = static_cast<const int32_t*>(table.data);
    st.table_width = table.dims[1];
    st.block_size = past_k.dims[2];
    st.max_context = st.table_width * st.block_size;
    // Every block a row's tokens occupy (positions up to seqlens_k) must be in the pool: checked here, once, so that
    // the threads below index it without a check.
    const int32_t* lengths = static_cast<const int32_t*>(seqlens.data);
    for (int64_t b = 0; b < B; ++b) {
      const int64_t used = std::min<int64_t>(st.table_width, (std::max<int64_t>(lengths[b], 0)) / st.block_size + 1);
      for (int64_t i = 0; i < used; ++i) {
        const int32_t block = st.table[b * st.table_width + i];
        if (block < 0 || block >= past_k.dims[0])
          return error(kOrtInvalidArgument, "Int8KVAttention: block_table[" + std::to_string(b) + "][" + std::to_string(i) +
                                                "] = " + std::to_string(block) + " is not a block of the pool (" +
                                                std::to_string(past_k.dims[0]) + " blocks)");
      }
    }
  }
  st.head_dim = H;
  st.rotary_dim = 2 * cos.dims[1];
  st.positions = cos.dims[0];
  st.blocks = (S + kQueryBlock - 1) / kQueryBlock;
  st.first_prompt = static_cast<const int32_t*>(total.data)[0] == S;
  st.kernel = token_kernel(H, N / K);
  if (!st.kernel) st.wide = wide_kernel(H, N / K);
  auto parallel = fn<OrtStatus* (*)(const OrtKernelContext*, void (*)(void*, size_t), size_t, size_t, void*)>(kKernelContextParallelFor);
  if (OrtStatus* s = parallel(context, place_token, static_cast<size_t>(B * S), 0, &st)) return s;
  if (st.bad_position.load())
    return error(kOrtInvalidArgument, "Int8KVAttention: a token's position is past the cache (max_context " +
                                          std::to_string(st.max_context) + ") or the rotary cache (" + std::to_string(st.positions) + " positions)");
  return parallel(context, attend, static_cast<size_t>(B * K * st.blocks), 0, &st);
}

const int kInputTypes[kInputs] = {kFloat, kFloat, kFloat, kInt8, kInt8, kInt32, kInt32, kFloat, kFloat, kFloat, kFloat,
                                  kInt32};
const int kOutputTypes[3] = {kFloat, kInt8, kInt8};

CustomOp make_op() {
  CustomOp op = cpu_op(create_kernel, compute, [](void* k) { delete static_cast<Attention*>(k); });
  op.GetName = [](const CustomOp*) { return "Int8KVAttention"; };
  op.GetInputType = [](const CustomOp*, size_t i) { return kInputTypes[i]; };
  op.GetInputTypeCount = [](const CustomOp*) { return kInputs; };
  op.GetOutputType = [](const CustomOp*, size_t i) { return kOutputTypes[i]; };
  op.GetOutputTypeCount = [](const CustomOp*) { return size_t{3}; };
  op.GetInputCharacteristic = [](const CustomOp*, size_t i) {  // optional: required
    return i == 1 || i == 2 || i == kBlockTable ? 1 : 0;
  };
  return op;
}

CustomOp g_op = make_op();
OrtCustomOpDomain* g_domain = nullptr;

}  // namespace

extern "C" __attribute__((visibility("default"))) OrtStatus* RegisterCustomOps(OrtSessionOptions* options, const OrtApiBase* base) {
  return register_ops(options, base, "ai.model_factory", &g_domain, {&g_op});
}
