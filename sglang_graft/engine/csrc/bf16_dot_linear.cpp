// y = x @ w^T + b for bf16 activations and weights on CPUs with AVX512-BF16 but no AMX,
// reading the weights as loaded. A model's layers run on their weights repacked into panels
// instead (bf16_panel_linear.cpp, faster at every row count); this kernel serves the calls
// on weights that are not repacked (cpu_linear).
//
// Why: on such CPUs (AMD Zen 4 and 5, Intel Cooper Lake) PyTorch's bf16 linear is slow for
// one row (a one-token decode step of a 1.5B model cost more than a two-token verify on a
// Zen 4 EPYC) and grows steeply from 8 rows on, and the project's AVX2 kernel
// (cpu_linear.cpp) is compute-bound from 4 rows on: it widens every bf16 weight to float32
// and runs 8-lane FMAs. VDPBF16PS multiplies 32 bf16 pairs per instruction, accumulating in
// float32, straight from the weights as loaded (bf16, row-major [N, K], no copy).
//
// Numerics: lane l of a 16-lane float32 accumulator takes the bf16 pairs k = 32j + 2l and
// 32j + 2l + 1 in order of j (the product of two bf16 is exact in float32; VDPBF16PS adds
// both products to the lane, flushing subnormals); past the last full 32, the tail is a
// masked step whose missing k count as zeros. The sixteen lanes are then summed in a fixed
// tree, then the bias is added and the sum rounded to bf16 (nearest even, as PyTorch rounds).
// Which rows share a call, and how the loops below are blocked, never changes that order,
// so a token's outputs are bitwise the same whether it is decoded alone or verified among
// a tree's tokens.
//
// Blocking: a register block is MR activation rows by NR weight rows. From three rows on
// the kernel is compute-bound: 4 x 6 (24 accumulators, 4 activation vectors, 1 weight
// vector of the 32 registers). One or two rows only stream the weights: 2 x 8 (more loads
// in flight). Each thread owns chunks of weight rows; a block of NR weight rows runs
// against every activation row before the next block, so each weight byte comes from
// memory once per call and is reused from the L1 cache (on a 2-core Zen 4 this order made
// a 16-row call 1.4x faster than running each activation block over a whole L2-sized
// chunk); while the later passes over a block multiply, the next block's rows are
// prefetched (see Prefetch). Calls of 5 to 12 rows (two or three passes) go through each
// block in segments of k instead, so the weight stream never waits for a whole pass (see
// kSegment). The main loop's loads are unmasked: masked ones halved its speed.
// Threads: OpenMP, sharing PyTorch's runtime, so torch.set_num_threads applies.
#include <immintrin.h>

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "linear_common.h"

namespace {

using bf16 = uint16_t;

// Sixteen lanes: the two halves added, then the eight-lane tree.
inline float lane_sum(__m512 v) {
  const __m256 hi = _mm256_castsi256_ps(_mm512_extracti64x4_epi64(_mm512_castps_si512(v), 1));
  return ::lane_sum(_mm256_add_ps(_mm512_castps512_ps256(v), hi));
}

// One k-step of 32 for a register block: acc[i][j] += x[i][k:k+32] . w[j][k:k+32] pairwise.
// The tail step loads only the `tail` k that exist (masked, the rest zeros).
template <int MR, int NR, bool Tail>
inline void step(const bf16* x, long ldx, const bf16* w, long K, long k, __mmask32 tail, __m512 acc[MR][NR]) {
  const auto load = [tail](const bf16* p) {
    return (__m512bh)(Tail ? _mm512_maskz_loadu_epi16(tail, p) : _mm512_loadu_si512(p));
  };
  __m512bh xv[MR];
  for (int i = 0; i < MR; ++i) xv[i] = load(x + i * ldx + k);
  for (int j = 0; j < NR; ++j) {
    const __m512bh wv = load(w + j * K + k);
    for (int i = 0; i < MR; ++i) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv[i], wv);
  }
}

// What a register block prefetches while it multiplies. kAhead: its own weight rows,
// kPrefetchBytes ahead (a call's only pass over them, the first block of a thread's chunk,
// or a segment's first pass). kNext: three rows of the next block at the same k (addresses
// as integers: past the last row they point past the weights, and prefetches never fault),
// so that block's memory traffic overlaps this block's compute-only passes instead of
// following them. kNone: nothing (a segment's later passes).
struct Prefetch {
  enum Mode { kAhead, kNext, kNone } mode;
  uintptr_t rows[3];
};

// The full k-steps [k0, k1) of a register block of MR activation rows (`ldx` apart) by NR
// weight rows (`K` apart), added to acc.
template <int MR, int NR>
inline void steps(const bf16* x, long ldx, const bf16* w, long K, long k0, long k1, const Prefetch& pf,
                  __m512 acc[MR][NR]) {
  for (long k = k0; k < k1; k += 32) {
    if (pf.mode == Prefetch::kAhead) {
      prefetch_rows<NR>(w, K, k);
    } else if (pf.mode == Prefetch::kNext) {
      const uintptr_t at = k * sizeof(bf16);
      for (const uintptr_t row : pf.rows) _mm_prefetch(reinterpret_cast<const char*>(row + at), _MM_HINT_T0);
    }
    step<MR, NR, false>(x, ldx, w, K, k, 0, acc);
  }
}

struct Call {
  const bf16* x;  // activations [M, K]
  const bf16* w;  // weights [N, K]
  const bf16* bias;  // [N] or null
  bf16* y;  // outputs [M, N]
  long M, N, K;
};

// A register block's last steps: the masked tail past the last full 32 k, the lane sums,
// the bias, the bf16 rounding into y.
template <int MR, int NR>
inline void finish(const Call& c, long m, long n, __m512 acc[MR][NR]) {
  const long k = c.K / 32 * 32;
  if (k < c.K) {
    const __mmask32 tail = static_cast<__mmask32>((1u << (c.K - k)) - 1);
    step<MR, NR, true>(c.x + m * c.K, c.K, c.w + n * c.K, c.K, k, tail, acc);
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) {
      const float b = c.bias != nullptr ? bf16_to_f32(c.bias[n + j]) : 0.0f;
      c.y[(m + i) * c.N + n + j] = f32_to_bf16(lane_sum(acc[i][j]) + b);
    }
}

// One register block over all of k: activation rows [m, m + MR), weight rows [n, n + NR).
template <int MR, int NR>
inline void block(const Call& c, long m, long n, const Prefetch& pf) {
  __m512 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
  steps<MR, NR>(c.x + m * c.K, c.K, c.w + n * c.K, c.K, 0, c.K / 32 * 32, pf, acc);
  finish<MR, NR>(c, m, n, acc);
}

// The last c.M - m < MR activation rows (R or fewer) against weight rows [n, n + NR).
template <int R, int NR>
inline void partial(const Call& c, long m, long n, const Prefetch& pf) {
  if constexpr (R > 0) {
    if (c.M - m == R)
      block<R, NR>(c, m, n, pf);
    else
      partial<R - 1, NR>(c, m, n, pf);
  }
}

// Weight rows [n0, n1), NR at a time, each against every activation row (MR at a time),
// so a weight row comes from memory once and then from the L1 cache. With several passes
// (more than MR activation rows), pass p prefetches rows p, p + passes and p + 2 passes of
// the next block: blocks of several passes are 6 rows or fewer, so the passes cover all of
// its rows (2 x 8 blocks only serve calls of one pass). On a 2-core Zen 5 EPYC this made
// the 1.5B target's 8- to 16-token forwards ~5% faster, one to four tokens unchanged (calls
// of 5 to 12 rows now take segments instead, below).
template <int MR, int NR>
inline void rows(const Call& c, long n0, long n1) {
  const long passes = (c.M + MR - 1) / MR;
  const uintptr_t w = reinterpret_cast<uintptr_t>(c.w);
  const uintptr_t row_bytes = c.K * sizeof(bf16);
  for (long n = n0; n < n1; n += NR) {
    const auto plan = [&](long pass) {
      Prefetch pf{passes == 1 || (n == n0 && pass == 0) ? Prefetch::kAhead : Prefetch::kNext, {}};
      for (long i = 0; i < 3; ++i) {
        const long row = pass < NR ? n + NR + std::min<long>(NR - 1, pass + i * passes) : n;
        pf.rows[i] = w + row * row_bytes;
      }
      return pf;
    };
    long m = 0;
    for (; m + MR <= c.M; m += MR) block<MR, NR>(c, m, n, plan(m / MR));
    partial<MR - 1, NR>(c, m, n, plan(m / MR));
  }
}

// Segments: a call of two or three passes (5 to 12 rows in 4 x 6 blocks) runs each block
// kSegment k at a time, every pass over a segment before the next segment, the passes'
// accumulators parked in memory in between. The first pass of a segment streams its
// weights from memory, prefetching kPrefetchBytes ahead, and the later passes multiply the
// same 256 bytes a row from the L1 cache while those prefetches are in flight, so the weight
// stream no longer stops for a block's compute-only passes. Each accumulator still takes its
// k in the same order, so the outputs are bitwise those of whole-k blocks. On a 2-core Zen 5
// EPYC (28 layers of a 1.5B target's shapes, while its memory was fast) 6 rows took 49.5 ms
// instead of 54.9, 8 rows 52.7 instead of 59.4, 12 rows 64.2 instead of 69.7 (while it was
// slow: -4% to +1%); 96-k segments were about as fast as 128, 32, 64 and 192 slower, four
// passes (16 rows) slower than whole-k blocks (88.2 against 83.9 ms).
constexpr long kSegment = 128;
constexpr long kMaxSegmentPasses = 3;

// A pass of R activation rows over segment [k0, k1) of a block, its accumulators taken from
// and parked back in `park`; with `last`, the block's finish instead of parking.
template <int R, int NR>
inline void segment(const Call& c, long m, long n, long k0, long k1, const Prefetch& pf, __m512* park, bool last) {
  __m512 acc[R][NR];
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = park[i * NR + j];
  steps<R, NR>(c.x + m * c.K, c.K, c.w + n * c.K, c.K, k0, k1, pf, acc);
  if (last) {
    finish<R, NR>(c, m, n, acc);
    return;
  }
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < NR; ++j) park[i * NR + j] = acc[i][j];
}

// The pass at activation row m: MR rows, or the R or fewer left.
template <int R, int NR>
inline void segment_rows(const Call& c, long m, long n, long k0, long k1, const Prefetch& pf, __m512* park, bool last) {
  if constexpr (R > 0) {
    if (c.M - m >= R)
      segment<R, NR>(c, m, n, k0, k1, pf, park, last);
    else
      segment_rows<R - 1, NR>(c, m, n, k0, k1, pf, park, last);
  }
}

template <int MR, int NR>
inline void segmented_rows(const Call& c, long n0, long n1) {
  static_assert(MR * kMaxSegmentPasses >= 12, "segments serve calls of up to 12 rows");
  const long passes = (c.M + MR - 1) / MR;
  const long full = c.K / 32 * 32;
  const Prefetch ahead{Prefetch::kAhead, {}}, none{Prefetch::kNone, {}};
  __m512 park[kMaxSegmentPasses][MR * NR];
  for (long n = n0; n < n1; n += NR) {
    for (long p = 0; p < passes; ++p)
      for (int t = 0; t < MR * NR; ++t) park[p][t] = _mm512_setzero_ps();
    for (long k0 = 0; k0 < full; k0 += kSegment)
      for (long p = 0; p < passes; ++p)
        segment_rows<MR, NR>(c, p * MR, n, k0, std::min(full, k0 + kSegment), p == 0 ? ahead : none, park[p], false);
    for (long p = 0; p < passes; ++p) segment_rows<MR, NR>(c, p * MR, n, full, full, none, park[p], true);
  }
}

template <int MR, int NR, bool Segmented>
void blocked(const Call& c) {
  const long main_rows = c.N / NR * NR;
  // Weight rows per chunk: at most ~256 KB, at least four chunks per thread.
  const long threads = omp_get_max_threads();
  const long fit = (256L << 10) / std::max<long>(1, c.K * static_cast<long>(sizeof(bf16)));
  const long spread = (main_rows + 4 * threads - 1) / (4 * threads);
  const long chunk = std::max<long>(NR, std::min(fit, spread) / NR * NR);
  const long chunks = (main_rows + chunk - 1) / chunk;
#pragma omp parallel for schedule(static)
  for (long b = 0; b < chunks; ++b) {
    const long n1 = std::min(main_rows, (b + 1) * chunk);
    if constexpr (Segmented)
      segmented_rows<MR, NR>(c, b * chunk, n1);
    else
      rows<MR, NR>(c, b * chunk, n1);
  }
  if (main_rows < c.N) rows<MR, 1>(c, main_rows, c.N);
}

}  // namespace

extern "C" {

// x: [M, K] activations, y: [M, N] outputs, w: [N, K] weights, bias: [N] (or null): all
// bf16 and contiguous. Long prompts go through in passes of at most 64 rows, so a pass's
// activations stay in the L2 cache while a chunk of weights runs over them.
void graft_bf16_dot_linear(const void* x, const void* w, const void* bias, void* y, long M, long N, long K) {
  constexpr long kPass = 64;
  for (long m0 = 0; m0 < M; m0 += kPass) {
    const Call c{static_cast<const bf16*>(x) + m0 * K, static_cast<const bf16*>(w), static_cast<const bf16*>(bias),
                 static_cast<bf16*>(y) + m0 * N, std::min(kPass, M - m0), N, K};
    if (c.M <= 2)
      blocked<2, 8, false>(c);
    else if (c.M <= 4 || c.M > 4 * kMaxSegmentPasses)
      blocked<4, 6, false>(c);
    else
      blocked<4, 6, true>(c);
  }
}
}
