// One token drawn from a row of logits: softmax(x / T), top-k, top-p, by the inverse CDF in token order
// (generation/sampling_kernel.py loads it with ctypes; generation/sampling.py's sample_token is the same draw in numpy,
// kept where this cannot be compiled).
//
// A 262,144-token row is 1 MiB; numpy's draw makes five passes over it (maximum, subtract, scale, exp, the blocks'
// sums) and a sixth for each top-p check. Here:
//   - one pass for the maxima of 256-token blocks (the row's peak, and where top-k's candidates lie);
//   - one pass for the blocks' sums of exp((x - peak) / T) over the tokens still in play (only the blocks that hold
//     any: with top-k, a few), the probabilities never stored;
//   - a draw: the block whose running sum passes u of the total, then the token inside it (its 256 weights again);
//   - top-p by rejection, as numpy's path and FlashInfer do it, ordered by the logits themselves: a drawn token is in
//     the nucleus when the tokens before it (a larger logit, or the same logit and earlier) hold less than top_p of
//     the mass, summed over the blocks whose maximum reaches its logit only. A token outside takes every token after
//     it out of play (a smaller logit, or the same and later) and the draw is made again with the next uniform: what
//     is accepted follows the nucleus' distribution exactly.
// Tokens in play: x > lo, or x == lo and index < lo_pos (initially all; top-k: x >= its k-th largest value, ties kept).
//
// The exponential is Cephes' expf polynomial (within 2 ulp; 0 below e^-87.3, where float32 has no normal number).
// Not int8_kv_attention.cc's exp_nonpositive: that one clamps at -87 (a masked token, -inf, would weigh 2^-125.5 and
// could be drawn where rounding lands on it) and rounds with std::floor, which keeps GCC's loop scalar here.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#define MF_EXPORT extern "C" __attribute__((visibility("default")))

namespace {

constexpr int64_t kBlock = 256;

// state[] the calls share: the row's peak, lo, lo_pos, the total of the draw's first distribution (top-p's mass is a
// share of it), and the total of what is in play now.
enum { kPeak = 0, kLo = 1, kLoPos = 2, kTotal = 3, kInPlay = 4, kStateSize = 5 };

inline float exp_nonpositive(float v) {
    const float floor_v = -87.3f;
    float c = v < floor_v ? floor_v : v;
    // n = round(c / ln 2) by the 1.5 * 2^23 trick: floorf would keep the loop scalar under GCC's default trapping math.
    float n = (c * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    float r = c - n * 0.693359375f;
    r = r + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    float y = p * (r * r) + r + 1.0f;
    int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
    return v < floor_v ? 0.0f : y * __builtin_bit_cast(float, bits);
}

inline int64_t blocks_of(int64_t n) { return (n + kBlock - 1) / kBlock; }

// The maxima of x's 256-token blocks into bmax, and the row's: NaN where a logit is NaN.
float block_maxima(const float* x, int64_t n, float* bmax) {
    const float ninf = -std::numeric_limits<float>::infinity();
    float peak = ninf;
    bool nan = false;
    for (int64_t b = 0, nb = blocks_of(n); b < nb; ++b) {
        const int64_t begin = b * kBlock, end = std::min(n, begin + kBlock);
        float m = ninf;
        int bad = 0;
#pragma omp simd reduction(max : m) reduction(| : bad)
        for (int64_t j = begin; j < end; ++j) {
            m = x[j] > m ? x[j] : m;  // not std::max: its NaN rule keeps the loop scalar
            bad |= x[j] != x[j] ? 1 : 0;
        }
        bmax[b] = m;
        peak = m > peak ? m : peak;
        nan = nan || bad;
    }
    return nan ? std::numeric_limits<float>::quiet_NaN() : peak;
}

// The tokens of block b in play: their weights' sum (0 for a block wholly out of play).
double block_sum(const float* x, int64_t n, int64_t b, float inv_temp, float peak, float lo, int64_t lo_pos,
                 const float* bmax) {
    if (bmax[b] < lo) return 0.0;
    const int64_t begin = b * kBlock, end = std::min(n, begin + kBlock);
    float s = 0.0f;
    if (lo == -std::numeric_limits<float>::infinity() && lo_pos >= end) {
#pragma omp simd reduction(+ : s)
        for (int64_t j = begin; j < end; ++j) s += exp_nonpositive((x[j] - peak) * inv_temp);
    } else {
#pragma omp simd reduction(+ : s)
        for (int64_t j = begin; j < end; ++j) {
            const float w = exp_nonpositive((x[j] - peak) * inv_temp);
            const bool in_play = x[j] > lo || (x[j] == lo && j < lo_pos);
            s += in_play ? w : 0.0f;
        }
    }
    return s;
}

double block_sums(const float* x, int64_t n, float inv_temp, const double* state, const float* bmax, double* bsum) {
    const float peak = static_cast<float>(state[kPeak]), lo = static_cast<float>(state[kLo]);
    const int64_t lo_pos = static_cast<int64_t>(state[kLoPos]);
    double total = 0.0;
    for (int64_t b = 0, nb = blocks_of(n); b < nb; ++b) {
        bsum[b] = block_sum(x, n, b, inv_temp, peak, lo, lo_pos, bmax);
        total += bsum[b];
    }
    return total;
}

// The position u draws by the inverse CDF in token order over the tokens in play: the block whose running sum passes
// u of the total, then the token inside it; where rounding carries a draw past a block's weights or onto a zero, the
// last positive one before it.
int64_t draw(const float* x, int64_t n, float inv_temp, const double* state, const double* bsum, double u) {
    const float peak = static_cast<float>(state[kPeak]), lo = static_cast<float>(state[kLo]);
    const int64_t lo_pos = static_cast<int64_t>(state[kLoPos]), nb = blocks_of(n);
    const double target = u * state[kInPlay];
    double running = 0.0;
    int64_t b = 0, last = -1;
    for (; b < nb; ++b) {
        if (bsum[b] > 0.0) {
            if (running + bsum[b] > target) break;
            last = b;
        }
        running += bsum[b];
    }
    if (b == nb) {  // rounding carried it past the end: the last block with weight
        b = last;
        running -= bsum[b];
    }
    const int64_t begin = b * kBlock, end = std::min(n, begin + kBlock);
    const double rest = target - running;
    double cum = 0.0;
    int64_t positive = -1;
    for (int64_t j = begin; j < end; ++j) {
        const bool in_play = x[j] > lo || (x[j] == lo && j < lo_pos);
        const float w = in_play ? exp_nonpositive((x[j] - peak) * inv_temp) : 0.0f;
        if (w > 0.0f) {
            cum += w;
            if (cum > rest) return j;
            positive = j;
        }
    }
    return positive;  // the block's sum rounded a hair above its weights: its last positive one
}

// Whether the tokens before pos (a larger logit, or the same and earlier) hold less than top_p of the first
// distribution's mass: only the blocks whose maximum reaches x[pos] hold any.
bool in_nucleus(const float* x, int64_t n, float inv_temp, const double* state, const float* bmax, int64_t pos,
                double top_p) {
    const float peak = static_cast<float>(state[kPeak]), edge = x[pos];
    const double need = top_p * state[kTotal];
    double before = 0.0;
    int64_t ties = 0;
    for (int64_t b = 0, nb = blocks_of(n); b < nb; ++b) {
        if (bmax[b] < edge) continue;
        const int64_t begin = b * kBlock, end = std::min(n, begin + kBlock);
        float s = 0.0f;
#pragma omp simd reduction(+ : s, ties)
        for (int64_t j = begin; j < end; ++j) {
            const float w = exp_nonpositive((x[j] - peak) * inv_temp);
            s += x[j] > edge ? w : 0.0f;
            ties += (x[j] == edge && j < pos) ? 1 : 0;
        }
        before += s;
        if (before >= need) return false;
    }
    before += static_cast<double>(ties) * exp_nonpositive((edge - peak) * inv_temp);
    return before < need;
}

int64_t draw_or_reject(const float* x, int64_t n, float inv_temp, double top_p, double u, const float* bmax,
                       double* bsum, double* state) {
    const int64_t pos = draw(x, n, inv_temp, state, bsum, u);
    if (top_p >= 1.0 || in_nucleus(x, n, inv_temp, state, bmax, pos, top_p)) return pos;
    state[kLo] = x[pos];  // pos and every token after it in the logits' order: out of play
    state[kLoPos] = static_cast<double>(pos);
    state[kInPlay] = block_sums(x, n, inv_temp, state, bmax, bsum);
    return -2;
}

}  // namespace

// One draw from row x of n logits with uniform u in [0, 1): the token, -1 where no logit is finite or one is NaN
// (the caller takes the argmax), or -2 where top-p rejected the draw (call mf_sample_again with the next uniform).
// Scratch: bmax float[ceil(n / 256)], bsum double[ceil(n / 256)], work float[n], state double[5].
MF_EXPORT int64_t mf_sample(const float* x, int64_t n, float inv_temp, int64_t top_k, double top_p, double u,
                            float* bmax, double* bsum, float* work, double* state) {
    const int64_t nb = blocks_of(n);
    const float ninf = -std::numeric_limits<float>::infinity();
    const float peak = block_maxima(x, n, bmax);
    if (!std::isfinite(peak)) return -1;
    float lo = ninf;
    if (top_k > 0 && top_k < n) {
        // The k-th largest value: the top k lie in the k blocks of the largest maxima, and are at least the k-th
        // largest maximum (those k blocks hold k values at least it).
        float bar = ninf;
        if (nb > top_k) {
            std::copy(bmax, bmax + nb, work);
            std::nth_element(work, work + (nb - top_k), work + nb);
            bar = work[nb - top_k];
        }
        int64_t c = 0;
        for (int64_t b = 0; b < nb; ++b) {
            if (bmax[b] < bar) continue;
            for (int64_t j = b * kBlock, end = std::min(n, j + kBlock); j < end; ++j)
                if (x[j] >= bar) work[c++] = x[j];
        }
        std::nth_element(work, work + (c - top_k), work + c);
        lo = work[c - top_k];
    }
    state[kPeak] = peak;
    state[kLo] = lo;
    state[kLoPos] = static_cast<double>(n);
    state[kTotal] = state[kInPlay] = block_sums(x, n, inv_temp, state, bmax, bsum);
    return draw_or_reject(x, n, inv_temp, top_p, u, bmax, bsum, state);
}

// The draw again after a rejection (the state mf_sample left), with the next uniform: the token, or -2 again.
MF_EXPORT int64_t mf_sample_again(const float* x, int64_t n, float inv_temp, double top_p, double u,
                                  const float* bmax, double* bsum, double* state) {
    return draw_or_reject(x, n, inv_temp, top_p, u, bmax, bsum, state);
}

// The log of softmax's normalizer over row x of n logits, log(sum(exp(x))), in two passes (the blocks' maxima into
// bmax, float[ceil(n / 256)], then the sums of exp(x - peak)); NaN where no logit is finite or one is NaN or +inf (as
// numpy's log-softmax reads then). A token's log-probability is x[token] minus it; bmax serves top_ids.
MF_EXPORT double mf_log_normalizer(const float* x, int64_t n, float* bmax) {
    const float peak = block_maxima(x, n, bmax);
    if (!std::isfinite(peak)) return std::numeric_limits<double>::quiet_NaN();
    const int64_t nb = blocks_of(n);
    double total = 0.0;
    for (int64_t b = 0; b < nb; ++b) {
        const int64_t begin = b * kBlock, end = std::min(n, begin + kBlock);
        float s = 0.0f;
#pragma omp simd reduction(+ : s)
        for (int64_t j = begin; j < end; ++j) s += exp_nonpositive(x[j] - peak);
        total += s;
    }
    return static_cast<double>(peak) + std::log(total);
}
