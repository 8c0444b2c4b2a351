// Integer MatMuls for ONNX Runtime's CPU provider (custom operators of the domain ai.model_factory.int8_matmul): the
// factory's INT8 graphs' products on the CPU's integer dot products (AVX-512 VNNI, or AVX2), their weights repacked in
// tiles of 32 columns so that a task streams its columns in order.
//
// Why (docs/generation.md, "INT8 MatMuls on the factory's operator"): on Gemma 3 270M's INT8 dynamic build a decode step
// is its projections and its 262,144-column LM head. ONNX Runtime runs them as DynamicQuantizeLinear + MatMulInteger +
// Cast + Mul (fused to MatMulIntegerToFloat), reading the weights well below memory speed at a few rows; and the form
// of down_proj that passes the gate (a scale per row and per 256 inputs, build_engines/row_int8.py) is about 24 small
// nodes a layer whose fixed costs, not the arithmetic, were a quarter of a step.
//
// RowInt8MatMul: the grouped per-row form in one node (checked against it in tests/backend/test_int8_matmul.py):
//   inputs  0 X [..., K] float   1 W [N / 32, K / 4, 32, 4] int8: the 7-bit weight in tiles of 32 columns, each
//           tile's inputs in order, 4 consecutive inputs of a column together
//           2 column sums [K / G, N] int32 (each group's sum of W over its G inputs)   3 weight scales [K / G, N] float
//   output  0 Y [..., N] float
//   attribute group G (K % G == 0, G % 4 == 0; N % 32 == 0)
// For each row r and group g of G inputs: s = max(max|x[r, g]|, 1e-12) / 127, q = round_half_even(x / s) + 128 as
// uint8; the group's integer product sum_k (q - 128) W[k, n] in int32 (exact); then Y[r, n] = sum over g, in order,
// of (float(product) * wscale[g, n]) * s[r, g].
//
// Int8MatMulToFloat: MatMulInteger(A, W, a_zero, 0) -> Cast(float) -> Mul(scale) in one node, bit for bit:
//   inputs  0 A [..., K] uint8   1 a_zero uint8 (one value)   2 W as above   3 column sums [1, N] int32
//           4 scale float [N] or one value (the activation's scale times the weight's per column, as the graph has it)
//   output  0 Y [..., N] float = float(sum_k (A[k] - a_zero) W[k, n]) * scale[n]
//
// The weights are 7-bit (|W| <= 64: the rewrite checks), so on AVX2 without VNNI the u8 x s8 pairs (vpmaddubsw) sum
// within int16: 2 x 255 x 64 = 32640. Built on the serving host with the INT8-cache attention's machinery
// (int8_attention.library): -march=native picks the AVX-512 VNNI path or the AVX2 one; where it also has AMX, from
// kAmxMinRows rows the integer sums are AMX tile products over the same packed weight (the same exact sums).

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>
#include <string>
#include <vector>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#if defined(__AMX_TILE__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "ort_abi.h"

namespace {

using namespace ort_abi;

struct RowInt8 {
  int64_t group = 0;
};

// The weight comes in tiles of kTile columns, each tile's K inputs contiguous: [N / kTile, K / 4, kTile, 4], so a task
// (one tile, every row) streams its 64 KB (K = 2048) in order and a group's part of it stays in L1 across the rows.
constexpr int64_t kTile = 32;

constexpr int kUint8 = 2;  // ONNX's TensorProto.UINT8
constexpr int64_t kMaxTasks = 64;  // tiles are handed out in at most this many runs (the LM head has 8,192 tiles)

struct Step {
  const uint8_t* q = nullptr;       // [M, K] quantized activations
  const float* xs = nullptr;        // RowInt8MatMul: [M, K / G] the rows' scales; else null
  const int8_t* w = nullptr;        // [N / kTile, K / 4, kTile, 4]
  const int32_t* colsum = nullptr;  // [K / G, N]
  const float* ws = nullptr;        // RowInt8MatMul: [K / G, N]; Int8MatMulToFloat: [N], or [1] when scalar_scale
  float* y = nullptr;               // [M, N]
  int64_t M = 0, K = 0, N = 0, G = 0, tiles_per_task = 1;
  int32_t zero = 128;               // the activations' zero point
  bool scalar_scale = false;
};

inline float column_scale(const Step& st, int64_t g, int64_t n) {
  return st.scalar_scale ? st.ws[0] : st.ws[g * st.N + n];
}

// Group g's part of rows [r0, r0 + rows) in tile t: the portable form.
[[maybe_unused]] void group_scalar(const Step& st, int64_t t, int64_t g, int64_t r0, int64_t rows) {
  const int64_t groups = st.K / st.G;
  const int8_t* tile = st.w + t * (st.K / 4) * kTile * 4;
  for (int64_t r = r0; r < r0 + rows; ++r) {
    const uint8_t* q = st.q + r * st.K;
    for (int64_t c = 0; c < kTile; ++c) {
      const int64_t n = t * kTile + c;
      int32_t acc = 0;
      for (int64_t k = g * st.G; k < (g + 1) * st.G; ++k) acc += static_cast<int32_t>(q[k]) * tile[((k / 4) * kTile + c) * 4 + k % 4];
      acc -= st.zero * st.colsum[g * st.N + n];
      float& y = st.y[r * st.N + n];
      if (!st.xs) {
        y = static_cast<float>(acc) * column_scale(st, g, n);
        continue;
      }
      const float part = (static_cast<float>(acc) * st.ws[g * st.N + n]) * st.xs[r * groups + g];
      y = g == 0 ? part : y + part;
    }
  }
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
// 16 columns a vector: a tile is 2 vectors; 8 rows share each weight load (16 accumulators of the 32 registers).
constexpr int64_t kVec = 16;
constexpr int kRows = 8;
using VecI = __m512i;
using VecF = __m512;
inline VecI dot4(VecI acc, VecI a, VecI w) {
#if defined(__AVX512VNNI__)
  return _mm512_dpbusd_epi32(acc, a, w);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(a, w), _mm512_set1_epi16(1)));
#endif
}
inline VecI set1(int32_t v) { return _mm512_set1_epi32(v); }
inline VecI zero() { return _mm512_setzero_si512(); }
inline VecI load_i(const void* p) { return _mm512_loadu_si512(p); }
inline VecF load_f(const float* p) { return _mm512_loadu_ps(p); }
inline VecI sub(VecI a, VecI b) { return _mm512_sub_epi32(a, b); }
inline VecI mullo(VecI a, VecI b) { return _mm512_mullo_epi32(a, b); }
inline VecF to_float(VecI a) { return _mm512_cvtepi32_ps(a); }
inline VecF mul(VecF a, VecF b) { return _mm512_mul_ps(a, b); }
inline VecF add(VecF a, VecF b) { return _mm512_add_ps(a, b); }
inline VecF set1f(float v) { return _mm512_set1_ps(v); }
inline void store_f(float* p, VecF v) { _mm512_storeu_ps(p, v); }
#define MF_ROW_INT8_VECTOR 1
#elif defined(__AVX2__)
// 8 columns a vector: a tile is 4 vectors; 2 rows share each weight load (8 accumulators of the 16 registers).
constexpr int64_t kVec = 8;
constexpr int kRows = 2;
using VecI = __m256i;
using VecF = __m256;
inline VecI dot4(VecI acc, VecI a, VecI w) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(a, w), _mm256_set1_epi16(1)));
}
inline VecI set1(int32_t v) { return _mm256_set1_epi32(v); }
inline VecI zero() { return _mm256_setzero_si256(); }
inline VecI load_i(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
inline VecF load_f(const float* p) { return _mm256_loadu_ps(p); }
inline VecI sub(VecI a, VecI b) { return _mm256_sub_epi32(a, b); }
inline VecI mullo(VecI a, VecI b) { return _mm256_mullo_epi32(a, b); }
inline VecF to_float(VecI a) { return _mm256_cvtepi32_ps(a); }
inline VecF mul(VecF a, VecF b) { return _mm256_mul_ps(a, b); }
inline VecF add(VecF a, VecF b) { return _mm256_add_ps(a, b); }
inline VecF set1f(float v) { return _mm256_set1_ps(v); }
inline void store_f(float* p, VecF v) { _mm256_storeu_ps(p, v); }
#define MF_ROW_INT8_VECTOR 1
#endif

#ifdef MF_ROW_INT8_VECTOR
constexpr int kVecs = static_cast<int>(kTile / kVec);

// The float steps from a group's integer sums to the outputs, one vector of columns [n, n + kVec) at a time: both
// the vector path and the AMX tiles' end here, so their outputs are the same bit for bit.
// The zero point's term of the sums: zero x the column sums.
inline VecI zero_point_term(const Step& st, int64_t g, int64_t n) {
  return mullo(load_i(st.colsum + g * st.N + n), set1(st.zero));
}
// The weight's scales (Int8MatMulToFloat: one group, the scale per column or one value).
inline VecF weight_scale(const Step& st, int64_t g, int64_t n) {
  if (!st.xs) return st.scalar_scale ? set1f(st.ws[0]) : load_f(st.ws + n);
  return load_f(st.ws + g * st.N + n);
}
// Row `row`'s outputs from its sums: written (one group), or its group's part added in order (RowInt8MatMul).
inline void finish(const Step& st, int64_t g, int64_t row, int64_t n, VecI sums, VecI zero_term, VecF scale) {
  float* y = st.y + row * st.N + n;
  if (!st.xs) {
    store_f(y, mul(to_float(sub(sums, zero_term)), scale));
    return;
  }
  const VecF part = mul(mul(to_float(sub(sums, zero_term)), scale), set1f(st.xs[row * (st.K / st.G) + g]));
  store_f(y, g == 0 ? part : add(load_f(y), part));
}

// Group g's part of rows [r0, r0 + R) in tile t, added to Y (assigned for the first group: the groups summed in
// order); R a constant so that the accumulators stay in registers.
template <int R>
void group_vector(const Step& st, int64_t t, int64_t g, int64_t r0) {
  const int64_t steps = st.G / 4;
  VecI acc[R][kVecs];
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i)
#pragma GCC unroll 4
    for (int v = 0; v < kVecs; ++v) acc[i][v] = zero();
  const int8_t* w = st.w + (t * (st.K / 4) + g * steps) * kTile * 4;
  const uint8_t* q = st.q + r0 * st.K + g * st.G;
  for (int64_t s = 0; s < steps; ++s, w += kTile * 4, q += 4) {
    VecI wv[kVecs];
#pragma GCC unroll 4
    for (int v = 0; v < kVecs; ++v) wv[v] = load_i(w + v * kVec * 4);
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) {
      int32_t four;
      std::memcpy(&four, q + i * st.K, 4);
      const VecI a = set1(four);
#pragma GCC unroll 4
      for (int v = 0; v < kVecs; ++v) acc[i][v] = dot4(acc[i][v], a, wv[v]);
    }
  }
  const int64_t n0 = t * kTile;
#pragma GCC unroll 4
  for (int v = 0; v < kVecs; ++v) {
    const VecI c = zero_point_term(st, g, n0 + v * kVec);
    const VecF sc = weight_scale(st, g, n0 + v * kVec);
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) finish(st, g, r0 + i, n0 + v * kVec, acc[i][v], c, sc);
  }
}
#endif

#if defined(MF_ROW_INT8_VECTOR) && defined(__AMX_TILE__) && defined(__AMX_INT8__)
// Intel AMX (compiled where -march=native has it, used where the kernel was granted the tile state at registration):
// from kAmxMinRows rows a group's integer sums are tile products, 16 rows by the tile's 32 columns a time, the same
// exact int32 sums as the vector path's (u8 x s8 products, no saturation), then the same float steps (epilogue).
#define MF_AMX 1
constexpr int64_t kAmxRows = 16;     // an A tile's rows (fewer for the last rows)
constexpr int64_t kAmxK = 64;        // the inputs one tile product takes (an A tile's bytes a row)
constexpr int64_t kAmxMinRows = 2;  // one row stays on the vector path (on the LM head: 7.0 ms vector, 7.4 ms tiles; 2 rows: 8.4, 7.1)
bool g_amx = false;  // granted the tile state (amx_granted)

// Linux gives a process AMX's tile data state on request (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA);
// refused (an older kernel, a sandbox), or MF_INT8_MATMUL_TILES=off in the process's environment (to compare, or to
// rule the tiles out), the vector path runs.
constexpr int kArchReqXcompPerm = 0x1023;  // arch_prctl's ARCH_REQ_XCOMP_PERM (asm/prctl.h)
constexpr int kXfeatureXtiledata = 18;     // the AMX tile data state component (XFEATURE_XTILEDATA)
bool amx_granted() {
  const char* setting = std::getenv("MF_INT8_MATMUL_TILES");
  if (setting && std::strcmp(setting, "off") == 0) return g_amx = false;
  if (!g_amx) g_amx = syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  return g_amx;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0 and 1: the sums of columns 0-15 and 16-31 (rows x 16 int32); 2: the activations (rows x 64 inputs);
// 3 and 4: the weight's columns 0-15 and 16-31 (16 rows of 4 inputs x 16 columns: the packed tile read with a stride).
void amx_configure(int64_t rows) {
  TileConfig cfg;
  for (int i = 0; i < 5; ++i) {
    cfg.colsb[i] = 64;
    cfg.rows[i] = static_cast<uint8_t>(i < 3 ? rows : kAmxK / 4);
  }
  _tile_loadconfig(&cfg);
}

// Group g's sums of rows [r0, r0 + rows) in tile t into acc [rows, kTile] (int32, before the zero point's term).
void amx_sums(const Step& st, int64_t t, int64_t g, int64_t r0, int32_t* acc) {
  const int8_t* w = st.w + (t * (st.K / 4) + g * (st.G / 4)) * kTile * 4;
  const uint8_t* q = st.q + r0 * st.K + g * st.G;
  _tile_zero(0);
  _tile_zero(1);
  for (int64_t k = 0; k < st.G; k += kAmxK, q += kAmxK, w += (kAmxK / 4) * kTile * 4) {
    _tile_loadd(2, q, st.K);
    _tile_loadd(3, w, kTile * 4);
    _tile_loadd(4, w + 64, kTile * 4);
    _tile_dpbusd(0, 2, 3);
    _tile_dpbusd(1, 2, 4);
  }
  _tile_stored(0, acc, kTile * 4);
  _tile_stored(1, acc + 16, kTile * 4);
}

// The float steps (finish) for rows [r0, r0 + rows) from sums already made (acc [rows, kTile]).
void epilogue(const Step& st, int64_t t, int64_t g, int64_t r0, int64_t rows, const int32_t* acc) {
  const int64_t n0 = t * kTile;
  for (int v = 0; v < kVecs; ++v) {
    const VecI c = zero_point_term(st, g, n0 + v * kVec);
    const VecF sc = weight_scale(st, g, n0 + v * kVec);
    for (int64_t i = 0; i < rows; ++i) finish(st, g, r0 + i, n0 + v * kVec, load_i(acc + i * kTile + v * kVec), c, sc);
  }
}

// Task t's tiles on AMX; false where this step stays on the vector path.
bool columns_amx(const Step& st, int64_t t0, int64_t t1) {
  if (!g_amx || st.M < kAmxMinRows || st.G % kAmxK != 0) return false;
  alignas(64) int32_t acc[kAmxRows * kTile];
  int64_t configured = 0;
  for (int64_t t = t0; t < t1; ++t)
    for (int64_t g = 0; g < st.K / st.G; ++g)
      for (int64_t r0 = 0; r0 < st.M; r0 += kAmxRows) {
        const int64_t rows = std::min(kAmxRows, st.M - r0);
        if (rows != configured) amx_configure(configured = rows);  // per task: other code may use the tiles between
        amx_sums(st, t, g, r0, acc);
        epilogue(st, t, g, r0, rows, acc);
      }
  _tile_release();
  return true;
}
#endif

// Task t: its run of tiles, each for every row a group at a time (the group's weights read from L1 by every row tile).
void columns(void* data, size_t task) {
  const Step& st = *static_cast<const Step*>(data);
  const int64_t tiles = st.N / kTile;
#ifdef MF_AMX
  if (columns_amx(st, static_cast<int64_t>(task) * st.tiles_per_task,
                  std::min(tiles, (static_cast<int64_t>(task) + 1) * st.tiles_per_task)))
    return;
#endif
  for (int64_t t = static_cast<int64_t>(task) * st.tiles_per_task; t < std::min(tiles, (static_cast<int64_t>(task) + 1) * st.tiles_per_task); ++t)
    for (int64_t g = 0; g < st.K / st.G; ++g) {
#ifdef MF_ROW_INT8_VECTOR
      int64_t r0 = 0;
      for (; r0 + kRows <= st.M; r0 += kRows) group_vector<kRows>(st, t, g, r0);
      if (kRows > 4 && r0 + 4 <= st.M) group_vector<4>(st, t, g, r0), r0 += 4;
      if (r0 + 2 <= st.M) group_vector<2>(st, t, g, r0), r0 += 2;
      if (r0 < st.M) group_vector<1>(st, t, g, r0);
#else
      group_scalar(st, t, g, 0, st.M);
#endif
    }
}

OrtStatus* run_tiles(OrtKernelContext* context, Step& st) {
  const int64_t tiles = st.N / kTile;
  st.tiles_per_task = std::max<int64_t>(1, (tiles + kMaxTasks - 1) / kMaxTasks);
  const size_t tasks = static_cast<size_t>((tiles + st.tiles_per_task - 1) / st.tiles_per_task);
  auto parallel = fn<OrtStatus* (*)(const OrtKernelContext*, void (*)(void*, size_t), size_t, size_t, void*)>(kKernelContextParallelFor);
  return parallel(context, columns, tasks, 0, &st);
}

// One group of a row: its scale max(max|x|, 1e-12) / 127 returned, q = round_half_even(x / scale) + 128 written, the
// float operations those of the standard-op form (an exact division, the rounding of Round).
float quantize_group(const float* x, int64_t n, uint8_t* q) {
  int64_t k = 0;
  float peak = 0.f;
#if defined(__AVX512F__)
  __m512 vmax = _mm512_setzero_ps();
  for (; k + 16 <= n; k += 16) vmax = _mm512_max_ps(vmax, _mm512_abs_ps(_mm512_loadu_ps(x + k)));
  peak = _mm512_reduce_max_ps(vmax);
#elif defined(__AVX2__)
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 vmax = _mm256_setzero_ps();
  for (; k + 8 <= n; k += 8) vmax = _mm256_max_ps(vmax, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + k)));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, vmax);
  for (float v : lanes) peak = std::max(peak, v);
#endif
  for (; k < n; ++k) peak = std::max(peak, std::fabs(x[k]));
  const float scale = std::max(peak, 1e-12f) / 127.f;
  k = 0;
#if defined(__AVX512F__)
  const __m512 vs = _mm512_set1_ps(scale), zero = _mm512_set1_ps(128.f);
  for (; k + 16 <= n; k += 16) {
    const __m512 r = _mm512_roundscale_ps(_mm512_div_ps(_mm512_loadu_ps(x + k), vs), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + k), _mm512_cvtepi32_epi8(_mm512_cvttps_epi32(_mm512_add_ps(r, zero))));
  }
#elif defined(__AVX2__)
  const __m256 vs = _mm256_set1_ps(scale), zero = _mm256_set1_ps(128.f);
  alignas(32) int32_t ints[8];
  for (; k + 8 <= n; k += 8) {
    const __m256 r = _mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(x + k), vs), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm256_store_si256(reinterpret_cast<__m256i*>(ints), _mm256_cvttps_epi32(_mm256_add_ps(r, zero)));
    for (int j = 0; j < 8; ++j) q[k + j] = static_cast<uint8_t>(ints[j]);
  }
#endif
  for (; k < n; ++k) q[k] = static_cast<uint8_t>(std::nearbyint(x[k] / scale) + 128.f);
  return scale;
}

OrtStatus* create_rows(const CustomOp*, const OrtApi*, const OrtKernelInfo* info, void** kernel) {
  auto* op = new (std::nothrow) RowInt8();
  if (!op) return error(kOrtRuntimeException, "RowInt8MatMul: out of memory");
  OrtStatus* s = fn<OrtStatus* (*)(const OrtKernelInfo*, const char*, int64_t*)>(kKernelInfoGetAttributeInt64)(info, "group", &op->group);
  if (!s && (op->group <= 0 || op->group % 4 != 0)) s = error(kOrtInvalidArgument, "RowInt8MatMul: group must be a positive multiple of 4");
  if (s) {
    delete op;
    return s;
  }
  *kernel = op;
  return nullptr;
}

constexpr size_t kRowInputs = 4;
const int kRowInputTypes[kRowInputs] = {kFloat, kInt8, kInt32, kFloat};

OrtStatus* inputs(OrtKernelContext* context, const char* op, Tensor* in, size_t count) {
  for (size_t i = 0; i < count; ++i) {
    const OrtValue* value = nullptr;
    if (OrtStatus* s = fn<OrtStatus* (*)(const OrtKernelContext*, size_t, const OrtValue**)>(kKernelContextGetInput)(context, i, &value)) return s;
    if (!value) return error(kOrtInvalidArgument, std::string(op) + ": input " + std::to_string(i) + " is missing");
    if (OrtStatus* s = describe(value, &in[i])) return s;
  }
  return nullptr;
}

// The packed weight's shape for K inputs: its N, or -1.
int64_t packed_columns(const Tensor& w, int64_t K) {
  if (w.type != kInt8 || w.dims.size() != 4 || w.dims[1] * 4 != K || w.dims[2] != kTile || w.dims[3] != 4) return -1;
  return w.dims[0] * kTile;
}

OrtStatus* output(OrtKernelContext* context, const Tensor& x, int64_t N, Tensor* y) {
  std::vector<int64_t> out_dims(x.dims.begin(), x.dims.end());
  out_dims.back() = N;
  OrtValue* out = nullptr;
  if (OrtStatus* s = fn<OrtStatus* (*)(OrtKernelContext*, size_t, const int64_t*, size_t, OrtValue**)>(kKernelContextGetOutput)(
          context, 0, out_dims.data(), out_dims.size(), &out))
    return s;
  return describe(out, y);
}

OrtStatus* compute_rows(void* kernel, OrtKernelContext* context) {
  const RowInt8& op = *static_cast<RowInt8*>(kernel);
  Tensor in[kRowInputs];
  if (OrtStatus* s = inputs(context, "RowInt8MatMul", in, kRowInputs)) return s;
  const Tensor &x = in[0], &w = in[1], &colsum = in[2], &ws = in[3];
  const int64_t G = op.group;
  if (x.type != kFloat || x.dims.empty()) return error(kOrtInvalidArgument, "RowInt8MatMul: X must be float [..., K], got " + shape(x));
  const int64_t K = x.dims.back();
  if (K % G != 0) return error(kOrtInvalidArgument, "RowInt8MatMul: X's last dimension " + std::to_string(K) + " is not a multiple of group " + std::to_string(G));
  const int64_t N = packed_columns(w, K);
  if (N < 0) return error(kOrtInvalidArgument, "RowInt8MatMul: W must be int8 [N / 32, K / 4, 32, 4] with K = " + std::to_string(K) + ", got " + shape(w));
  for (const Tensor* t : {&colsum, &ws})
    if (t->dims.size() != 2 || t->dims[0] != K / G || t->dims[1] != N)
      return error(kOrtInvalidArgument, "RowInt8MatMul: column sums and weight scales must be [K / group, N] = [" +
                                            std::to_string(K / G) + ", " + std::to_string(N) + "], got " + shape(*t));
  if (colsum.type != kInt32 || ws.type != kFloat) return error(kOrtInvalidArgument, "RowInt8MatMul: column sums are int32, weight scales float");
  int64_t M = 1;
  for (size_t i = 0; i + 1 < x.dims.size(); ++i) M *= x.dims[i];
  Tensor y;
  if (OrtStatus* s = output(context, x, N, &y)) return s;
  if (M == 0 || N == 0) return nullptr;

  // The rows' quantization: as the standard-op form computes it, in its order of float operations.
  const int64_t groups = K / G;
  thread_local std::vector<uint8_t> q;
  thread_local std::vector<float> xs;
  q.resize(static_cast<size_t>(M * K));
  xs.resize(static_cast<size_t>(M * groups));
  const float* xf = static_cast<const float*>(x.data);
  for (int64_t r = 0; r < M; ++r)
    for (int64_t g = 0; g < groups; ++g) {
      const float* row = xf + r * K + g * G;
      xs[r * groups + g] = quantize_group(row, G, q.data() + r * K + g * G);
    }

  Step st;
  st.q = q.data();
  st.xs = xs.data();
  st.w = static_cast<const int8_t*>(w.data);
  st.colsum = static_cast<const int32_t*>(colsum.data);
  st.ws = static_cast<const float*>(ws.data);
  st.y = static_cast<float*>(y.data);
  st.M = M;
  st.K = K;
  st.N = N;
  st.G = G;
  return run_tiles(context, st);
}

constexpr size_t kFloatInputs = 5;
const int kFloatInputTypes[kFloatInputs] = {kUint8, kUint8, kInt8, kInt32, kFloat};

OrtStatus* compute_to_float(void*, OrtKernelContext* context) {
  Tensor in[kFloatInputs];
  if (OrtStatus* s = inputs(context, "Int8MatMulToFloat", in, kFloatInputs)) return s;
  const Tensor &a = in[0], &zero = in[1], &w = in[2], &colsum = in[3], &scale = in[4];
  if (a.type != kUint8 || a.dims.empty()) return error(kOrtInvalidArgument, "Int8MatMulToFloat: A must be uint8 [..., K], got " + shape(a));
  const int64_t K = a.dims.back();
  const int64_t N = packed_columns(w, K);
  if (N < 0) return error(kOrtInvalidArgument, "Int8MatMulToFloat: W must be int8 [N / 32, K / 4, 32, 4] with K = " + std::to_string(K) + ", got " + shape(w));
  int64_t zeros = 1, scales = 1;
  for (int64_t d : zero.dims) zeros *= d;
  for (int64_t d : scale.dims) scales *= d;
  if (zeros != 1) return error(kOrtInvalidArgument, "Int8MatMulToFloat: a_zero must be one uint8 value, got " + shape(zero));
  if (colsum.type != kInt32 || colsum.dims.size() != 2 || colsum.dims[0] != 1 || colsum.dims[1] != N)
    return error(kOrtInvalidArgument, "Int8MatMulToFloat: column sums must be int32 [1, " + std::to_string(N) + "], got " + shape(colsum));
  if (scale.type != kFloat || (scales != 1 && scales != N))
    return error(kOrtInvalidArgument, "Int8MatMulToFloat: scale must be float [" + std::to_string(N) + "] or one value, got " + shape(scale));
  int64_t M = 1;
  for (size_t i = 0; i + 1 < a.dims.size(); ++i) M *= a.dims[i];
  Tensor y;
  if (OrtStatus* s = output(context, a, N, &y)) return s;
  if (M == 0 || N == 0) return nullptr;
  Step st;
  st.q = static_cast<const uint8_t*>(a.data);
  st.w = static_cast<const int8_t*>(w.data);
  st.colsum = static_cast<const int32_t*>(colsum.data);
  st.ws = static_cast<const float*>(scale.data);
  st.scalar_scale = scales == 1;
  st.zero = static_cast<const uint8_t*>(zero.data)[0];
  st.y = static_cast<float*>(y.data);
  st.M = M;
  st.K = K;
  st.N = N;
  st.G = K;
  return run_tiles(context, st);
}

CustomOp make_rows_op() {
  CustomOp op = cpu_op(create_rows, compute_rows,
                        [](void* k) { delete static_cast<RowInt8*>(k); });
  op.GetName = [](const CustomOp*) { return "RowInt8MatMul"; };
  op.GetInputType = [](const CustomOp*, size_t i) { return kRowInputTypes[i]; };
  op.GetInputTypeCount = [](const CustomOp*) { return kRowInputs; };
  op.GetOutputType = [](const CustomOp*, size_t) { return static_cast<int>(kFloat); };
  op.GetOutputTypeCount = [](const CustomOp*) { return size_t{1}; };
  return op;
}

OrtStatus* create_to_float(const CustomOp*, const OrtApi*, const OrtKernelInfo*, void** kernel) {
  *kernel = nullptr;  // no attributes: nothing to keep
  return nullptr;
}

CustomOp make_to_float_op() {
  CustomOp op = cpu_op(create_to_float, compute_to_float,
                        [](void*) {});
  op.GetName = [](const CustomOp*) { return "Int8MatMulToFloat"; };
  op.GetInputType = [](const CustomOp*, size_t i) { return kFloatInputTypes[i]; };
  op.GetInputTypeCount = [](const CustomOp*) { return kFloatInputs; };
  op.GetOutputType = [](const CustomOp*, size_t) { return static_cast<int>(kFloat); };
  op.GetOutputTypeCount = [](const CustomOp*) { return size_t{1}; };
  return op;
}

CustomOp g_rows = make_rows_op();
CustomOp g_to_float = make_to_float_op();
OrtCustomOpDomain* g_domain = nullptr;

}  // namespace

extern "C" __attribute__((visibility("default"))) OrtStatus* RegisterCustomOps(OrtSessionOptions* options, const OrtApiBase* base) {
#ifdef MF_AMX
  amx_granted();
#endif
  return register_ops(options, base, "ai.model_factory.int8_matmul", &g_domain, {&g_rows, &g_to_float});
}

// The fewest rows the operators multiply on AMX tiles here; 0 where they do not (not compiled with them, or the tile
// state refused). The load line says it (int8_matmul.tile_rows).
extern "C" __attribute__((visibility("default"))) int MfInt8MatMulTileRows() {
#ifdef MF_AMX
  return amx_granted() ? static_cast<int>(kAmxMinRows) : 0;
#else
  return 0;
#endif
}
