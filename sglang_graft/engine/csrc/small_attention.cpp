// Grouped-query attention of a few queries (decode steps, draft levels, tree verifies) over
// a long KV cache, on CPUs with AVX512F.
//
// Why: PyTorch runs this as a chain of small ops (widen K and V to float32, two batched
// matmuls, scale, mask, softmax), each paying its own dispatch and memory pass: 8 queries
// of Qwen2.5-Coder-1.5B (12 heads over 2 KV heads of 128) over 700 cached tokens took
// 236-260 us a layer on a 2-core Zen 5 EPYC, one query 80-94 us. Here one pass per KV head
// does it all (92-98 and 30 us): every key and value row is widened once and serves the
// whole group of query heads, keys are transposed in 16 x 16 register tiles, and every
// product is a 16-lane FMA (about 80% of the FMA peak at 8 queries).
//
// Numerics: float32 throughout (bf16 inputs widen exactly). Scores are q . k summed over d
// in order, times `scale` (built with AVX512-BF16, `-mavx512bf16`, bf16 scores come from
// VDPBF16PS instead: the same exact products of bf16 pairs, added into float32 two at a
// time, a pair's odd element first, with denormals flushed; half the multiply instructions
// and no widening of the keys: a layer of the 1.5B target, 12 queries over 700 keys, 334
// against 406 us, one query over 2000 keys 124 against 185, on a 2-core Zen 4 EPYC);
// masked keys score the float's lowest, so they get probability 0 exactly and an
// all-masked row comes out uniform, as PyTorch's softmax of such a row does; an additive
// mask's terms are added to the scaled scores (its dtype's lowest, as the engine passes for
// hidden keys, again gives 0 exactly).
// exp is a degree-6 polynomial after range reduction (about 1 ulp). A query's output depends
// only on its own row and the keys it sees, in their order: not on which other queries share
// the call, nor on the keys it does not see, wherever they sit (a tree's other branches,
// padding): they weigh exactly 0, the softmax's denominator sums the nonzero terms packed in
// key order, and the weighted sum adds values in key order. With the project's linear
// kernels (also fixed-order per row), a tree verify then gives a token the bits a one-token
// decode step gives it.
//
// Layout: q [bs, heads, q_len, d], k and v [bs, kv_heads, L, d] and mask [bs, q_len, L]
// (bytes, nonzero attends; or additive terms in the inputs' dtype; or none: attend to all)
// by strides in elements, the last dim contiguous; out [bs, q_len, heads, d] contiguous, the
// layout attention hands to o_proj.
// Threads: OpenMP over (batch row, KV head, block of query rows), sharing PyTorch's runtime.
#include <immintrin.h>

#include <omp.h>

#include <algorithm>
#include <cfloat>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "avx512_exp.h"

namespace {

using bf16 = uint16_t;

constexpr long kKeys = 64;  // keys per block: a widened K or V block of d <= 256 fits L1/L2
constexpr int kRows = 4;    // query rows per register block
constexpr int kLanes = 16;

// bf16 -> float32 is exact: the 16 bits become the float's top half.
inline __m512 widen(__m256i halves) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(halves), 16)); }

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const bf16* p) { return widen(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }

inline void store16(float* p, __m512 x) { _mm512_storeu_ps(p, x); }
// Rounded to nearest even, as PyTorch rounds float32 to bf16.
inline void store16(bf16* p, __m512 x) {
  __m512i bits = _mm512_castps_si512(x);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  bits = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(_mm512_srli_epi32(bits, 16)));
}

// Transposes a 16 x 16 float32 tile held as 16 rows in place (in registers: unpacks within
// 128-bit lanes, then 128-bit lane shuffles).
inline void transpose16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int h = 0; h < 16; h += 8)
    for (int i = 0; i < 4; ++i) {
      t[h + i] = _mm512_shuffle_f32x4(r[h + i], r[h + 4 + i], 0x88);
      t[h + 4 + i] = _mm512_shuffle_f32x4(r[h + i], r[h + 4 + i], 0xdd);
    }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[8 + i], 0x88);
    r[8 + i] = _mm512_shuffle_f32x4(t[i], t[8 + i], 0xdd);
  }
}

struct Call {
  const void* q;
  const void* k;
  const void* v;
  const void* mask;
  int mask_kind;
  void* out;
  long heads, kv_heads, q_len, L, d;
  const long* qs;  // strides of q: batch, head, query
  const long* ks;  // of k: batch, KV head, key
  const long* vs;
  const long* ms;  // of mask: batch, query (keys contiguous)
  float scale;
};

// Per thread, reused across calls: widened queries, scores, a widened K (transposed) or V
// block, output accumulators.
struct Scratch {
  std::vector<float> q, scores, block, acc, packed;
  std::vector<uint32_t> pairs;  // bf16 queries as pairs of elements (AVX512-BF16 builds)
};

// One multiply-add of a score block: 16 keys' float elements times a query element (FMA),
// or, in AVX512-BF16 builds, 16 keys' bf16 pairs times a query pair (VDPBF16PS).
inline __m512 score_step(__m512 acc, float q, __m512 keys) { return _mm512_fmadd_ps(_mm512_set1_ps(q), keys, acc); }
#ifdef __AVX512BF16__
inline __m512 score_step(__m512 acc, uint32_t q, __m512 keys) {
  return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_set1_epi32(q), (__m512bh)_mm512_castps_si512(keys));
}
#endif

// scores[r][kb0 + c] = q[r] . key[kb0 + c] for a register block of R query rows against a
// key block transposed to kt[steps][kKeys]: `Elem` float (a step is an element of d) or
// uint32_t (a step is a pair of bf16 elements, each word two of one key).
template <int R, typename Elem>
inline void score_block(const Elem* q, long steps, const Elem* kt, float* scores, long stride) {
  __m512 acc[R][kKeys / kLanes];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < kKeys / kLanes; ++j) acc[r][j] = _mm512_setzero_ps();
  for (long e = 0; e < steps; ++e) {
    __m512 kv[kKeys / kLanes];
    for (int j = 0; j < kKeys / kLanes; ++j)
      kv[j] = _mm512_loadu_ps(reinterpret_cast<const float*>(kt + e * kKeys + j * kLanes));
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < kKeys / kLanes; ++j) acc[r][j] = score_step(acc[r][j], q[r * steps + e], kv[j]);
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < kKeys / kLanes; ++j) _mm512_storeu_ps(scores + r * stride + j * kLanes, acc[r][j]);
}

// acc[r][chunk] += sum_c probs[r][c] * vb[c][chunk] over a value block of n keys, for a
// register block of R rows and one chunk of 64 output dims.
template <int R>
inline void value_block(const float* probs, long stride, const float* vb, long d, long n, float* acc) {
  __m512 a[R][4];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) a[r][j] = _mm512_loadu_ps(acc + r * d + j * kLanes);
  for (long c = 0; c < n; ++c) {
    __m512 vv[4];
    for (int j = 0; j < 4; ++j) vv[j] = _mm512_loadu_ps(vb + c * d + j * kLanes);
    for (int r = 0; r < R; ++r) {
      const __m512 p = _mm512_set1_ps(probs[r * stride + c]);
      for (int j = 0; j < 4; ++j) a[r][j] = _mm512_fmadd_ps(p, vv[j], a[r][j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) _mm512_storeu_ps(acc + r * d + j * kLanes, a[r][j]);
}

template <typename F>
inline void by_row_blocks(long rows, F&& f) {
  long r = 0;
  for (; r + kRows <= rows; r += kRows) f(r, std::integral_constant<int, kRows>{});
  switch (rows - r) {
    case 3: f(r, std::integral_constant<int, 3>{}); break;
    case 2: f(r, std::integral_constant<int, 2>{}); break;
    case 1: f(r, std::integral_constant<int, 1>{}); break;
    default: break;
  }
}

// How the mask reads: none, bytes (nonzero attends) or additive terms in the inputs' dtype.
enum MaskKind : int { kNoMask = 0, kBoolMask = 1, kAdditiveMask = 2 };

inline __mmask16 lanes_below(long left) {
  return left >= kLanes ? __mmask16(0xffff) : __mmask16((1u << std::max<long>(left, 0)) - 1);
}

inline __m512 load16_masked(const float* p, __mmask16 in) { return _mm512_maskz_loadu_ps(in, p); }
inline __m512 load16_masked(const bf16* p, __mmask16 in) { return widen(_mm256_maskz_loadu_epi16(in, p)); }

// Masked softmax of one row of scores in place (times `scale`, then masked: a bool mask's
// hidden keys score the float's lowest, an additive mask's terms are added); lanes past L
// end as 0. The mask row is contiguous over the keys; `packed` holds `padded` + 16 floats.
template <MaskKind Kind, typename T>
inline void softmax_row(float* s, long L, long padded, const void* mask, float scale, float* packed) {
  const __m512 lowest = _mm512_set1_ps(-FLT_MAX);
  __m512 vmax = lowest;
  for (long l = 0; l < padded; l += kLanes) {
    const __mmask16 in = lanes_below(L - l);
    __m512 x = _mm512_mul_ps(_mm512_loadu_ps(s + l), _mm512_set1_ps(scale));
    if constexpr (Kind == kBoolMask) {
      const __m512i m = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(in, static_cast<const uint8_t*>(mask) + l));
      x = _mm512_mask_mov_ps(lowest, _mm512_mask_test_epi32_mask(in, m, m), x);
    } else if constexpr (Kind == kAdditiveMask) {
      x = _mm512_add_ps(x, load16_masked(static_cast<const T*>(mask) + l, in));
    }
    _mm512_storeu_ps(s + l, x);
    vmax = _mm512_mask_max_ps(vmax, in, vmax, x);
  }
  const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(vmax));
  // The denominator sums the nonzero terms packed in key order, so the keys a row does not
  // see (zeros wherever they sit: a tree's siblings, padding) leave its bits alone.
  long count = 0;
  for (long l = 0; l < padded; l += kLanes) {
    const __m512 x = _mm512_sub_ps(_mm512_loadu_ps(s + l), top);
    const __m512 e = _mm512_maskz_mov_ps(lanes_below(L - l), exp_nonpositive(x));
    _mm512_storeu_ps(s + l, e);
    const __mmask16 nonzero = _mm512_cmp_ps_mask(e, _mm512_setzero_ps(), _CMP_NEQ_OQ);
    _mm512_storeu_ps(packed + count, _mm512_maskz_compress_ps(nonzero, e));
    count += __builtin_popcount(nonzero);
  }
  __m512 vsum = _mm512_setzero_ps();
  for (long l = 0; l < count; l += kLanes)
    vsum = _mm512_add_ps(vsum, _mm512_maskz_loadu_ps(lanes_below(count - l), packed + l));
  const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(vsum));
  for (long l = 0; l < padded; l += kLanes) _mm512_storeu_ps(s + l, _mm512_mul_ps(_mm512_loadu_ps(s + l), inv));
}

// A key block transposed to kt[steps][kKeys] in 16 x 16 tiles: `load(key, e)` gives steps
// [e, e + 16) of the block's key `key` (< n) as one register; keys n..kKeys are zeros.
template <typename Load>
inline void transpose_keys(float* kt, long steps, long n, Load&& load) {
  for (long c0 = 0; c0 < kKeys; c0 += kLanes)
    for (long e = 0; e < steps; e += kLanes) {
      __m512 tile[kLanes];
      for (long cc = 0; cc < kLanes; ++cc) tile[cc] = c0 + cc < n ? load(c0 + cc, e) : _mm512_setzero_ps();
      transpose16(tile);
      for (long j = 0; j < kLanes; ++j) _mm512_storeu_ps(kt + (e + j) * kKeys + c0, tile[j]);
    }
}

// Task row `row` of KV head h of batch row b: query head h * group + row / q_len at query
// position row % q_len.
template <typename T>
inline const T* query_row(const Call& c, long b, long h, long row) {
  const long head = h * (c.heads / c.kv_heads) + row / c.q_len, i = row % c.q_len;
  return static_cast<const T*>(c.q) + b * c.qs[0] + head * c.qs[1] + i * c.qs[2];
}

// The scores of `task`'s rows [r0, r0 + rows), a key block at a time: queries and the block
// widened to float32, the block transposed to [d][kKeys].
template <typename T>
void widened_scores(const Call& c, Scratch& w, const T* k, long b, long h, long r0, long rows, long padded) {
  const long d = c.d, L = c.L;
  w.q.resize(rows * d);
  for (long r = 0; r < rows; ++r) {
    const T* src = query_row<T>(c, b, h, r0 + r);
    for (long e = 0; e < d; e += kLanes) _mm512_storeu_ps(&w.q[r * d + e], load16(src + e));
  }
  float* kt = w.block.data();
  for (long kb = 0; kb < padded; kb += kKeys) {
    transpose_keys(kt, d, std::min(kKeys, L - kb),
                   [&](long key, long e) { return load16(k + (kb + key) * c.ks[2] + e); });
    by_row_blocks(rows, [&](long r, auto R) {
      score_block<decltype(R)::value>(&w.q[r * d], d, static_cast<const float*>(kt), &w.scores[r * padded + kb],
                                      padded);
    });
  }
}

#ifdef __AVX512BF16__
// The same scores for bf16 inputs through VDPBF16PS: queries copied as pairs of elements,
// the key block's pairs transposed (as 32-bit words, no widening) to [d / 2][kKeys].
inline void pair_scores(const Call& c, Scratch& w, const bf16* k, long b, long h, long r0, long rows, long padded) {
  const long L = c.L, pairs = c.d / 2;
  w.pairs.resize(rows * pairs);
  for (long r = 0; r < rows; ++r)
    std::memcpy(&w.pairs[r * pairs], query_row<bf16>(c, b, h, r0 + r), pairs * sizeof(uint32_t));
  uint32_t* kt = reinterpret_cast<uint32_t*>(w.block.data());  // kKeys * d floats: room to spare
  for (long kb = 0; kb < padded; kb += kKeys) {
    transpose_keys(reinterpret_cast<float*>(kt), pairs, std::min(kKeys, L - kb), [&](long key, long e) {
      return _mm512_castsi512_ps(_mm512_loadu_si512(k + (kb + key) * c.ks[2] + 2 * e));
    });
    by_row_blocks(rows, [&](long r, auto R) {
      score_block<decltype(R)::value>(&w.pairs[r * pairs], pairs, static_cast<const uint32_t*>(kt),
                                      &w.scores[r * padded + kb], padded);
    });
  }
}
#endif

// One task: query rows [r0, r1) of KV head h of batch row b. Row r is query head
// h * group + r / q_len at query position r % q_len.
template <typename T>
void task(const Call& c, Scratch& w, long b, long h, long r0, long r1) {
  const long d = c.d, L = c.L, rows = r1 - r0;
  const long padded = (L + kKeys - 1) / kKeys * kKeys;
  w.scores.resize(rows * padded);
  w.block.resize(kKeys * d);
  w.acc.assign(rows * d, 0.0f);
  w.packed.resize(padded + kLanes);
  const T* k = static_cast<const T*>(c.k) + b * c.ks[0] + h * c.ks[1];
  const T* v = static_cast<const T*>(c.v) + b * c.vs[0] + h * c.vs[1];
#ifdef __AVX512BF16__
  if constexpr (std::is_same_v<T, bf16>)
    pair_scores(c, w, k, b, h, r0, rows, padded);
  else
#endif
    widened_scores(c, w, k, b, h, r0, rows, padded);
  for (long r = 0; r < rows; ++r) {
    const long i = (r0 + r) % c.q_len;
    float* row = &w.scores[r * padded];
    const long at = b * c.ms[0] + i * c.ms[1];
    if (c.mask_kind == kBoolMask)
      softmax_row<kBoolMask, T>(row, L, padded, static_cast<const uint8_t*>(c.mask) + at, c.scale, w.packed.data());
    else if (c.mask_kind == kAdditiveMask)
      softmax_row<kAdditiveMask, T>(row, L, padded, static_cast<const T*>(c.mask) + at, c.scale, w.packed.data());
    else
      softmax_row<kNoMask, T>(row, L, padded, nullptr, c.scale, w.packed.data());
  }
  // Weighted values, a value block at a time (widened to [kKeys][d]).
  for (long kb = 0; kb < L; kb += kKeys) {
    const long n = std::min(kKeys, L - kb);
    float* vb = w.block.data();
    for (long cc = 0; cc < n; ++cc)
      for (long e = 0; e < d; e += kLanes) _mm512_storeu_ps(vb + cc * d + e, load16(v + (kb + cc) * c.vs[2] + e));
    for (long e = 0; e < d; e += 4 * kLanes)
      by_row_blocks(rows, [&](long r, auto R) {
        value_block<decltype(R)::value>(&w.scores[r * padded + kb], padded, vb + e, d, n, &w.acc[r * d + e]);
      });
  }
  T* out = static_cast<T*>(c.out);
  const long group = c.heads / c.kv_heads;
  for (long r = 0; r < rows; ++r) {
    const long head = h * group + (r0 + r) / c.q_len, i = (r0 + r) % c.q_len;
    T* dst = out + ((b * c.q_len + i) * c.heads + head) * d;
    for (long e = 0; e < d; e += kLanes) store16(dst + e, _mm512_loadu_ps(&w.acc[r * d + e]));
  }
}

template <typename T>
void run(const Call& c, long bs) {
  const long rows = c.heads / c.kv_heads * c.q_len;
  const long units = bs * c.kv_heads;
  const long threads = omp_get_max_threads();
  // Split a KV head's rows only when there are fewer (batch row, KV head) pairs than threads:
  // each split widens the head's keys and values again.
  const long splits = std::min<long>((threads + units - 1) / units, (rows + kRows - 1) / kRows);
  const long per = (rows + splits - 1) / splits;
#pragma omp parallel
  {
    static thread_local Scratch scratch;
#pragma omp for schedule(static)
    for (long t = 0; t < units * splits; ++t) {
      const long unit = t / splits, s = t % splits;
      const long r0 = s * per, r1 = std::min(rows, r0 + per);
      if (r0 < r1) task<T>(c, scratch, unit / c.kv_heads, unit % c.kv_heads, r0, r1);
    }
  }
}

}  // namespace

extern "C" {

// See the file comment for the layouts; `strides` holds q's three, then k's, v's and the
// mask's. d must be a multiple of 64 and at most 256; `bf16_inputs` selects bf16 q, k, v and
// out (else float32).
void graft_small_attention(const void* q, const void* k, const void* v, const void* mask, int mask_kind, void* out,
                           long bs, long heads, long kv_heads, long q_len, long L, long d, const long* strides,
                           float scale, int bf16_inputs) {
  const Call c{q, k, v, mask, mask_kind, out, heads, kv_heads, q_len, L, d,
               strides, strides + 3, strides + 6, strides + 9, scale};
  if (bf16_inputs)
    run<bf16>(c, bs);
  else
    run<float>(c, bs);
}
}
