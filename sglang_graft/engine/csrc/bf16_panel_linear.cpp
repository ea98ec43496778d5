// y = x @ w^T + b for bf16 activations and weights repacked into column panels, on CPUs
// with AVX512-BF16 (AMD Zen 4 and 5, Intel Cooper Lake).
//
// Why: bf16_dot_linear.cpp reads the weights as loaded ([N, K], row-major), so each output
// is a dot product along k in sixteen lanes that are summed at the end, and a register block
// streams six or eight weight rows at once. Repacked once into panels of 32 output columns,
// with each k pair of the 32 columns side by side, a panel is one sequential stream, a
// weight load serves every activation row of the call (up to 12 in registers, the pair of
// each row broadcast), and no lane sums are needed. On a 2-core Zen 5 EPYC the 1.5B
// target's linear layers (its own weights, best of 7) took 38.7 + 5.6 ms (decoder + LM head)
// instead of 46.3 + 7.4 for one row, 56.3 + 8.8 instead of 69.2 + 11.6 for twelve; over a
// 384-row prefill chunk, four layers of its shapes took 157 ms against oneDNN's 171.
// The price: the panels are a second copy of the weights.
//
// Layout: panel q holds output columns [32q, 32q + 32); within it, k pair p (k = 2p, 2p + 1)
// of those columns is 64 consecutive bf16: column c's pair at 2c. Columns past N and the k
// past an odd K are zeros.
//
// Numerics: output (m, n) is one float32 lane that takes the k pairs in order p = 0, 1, ...
// (VDPBF16PS: both products added to the lane, subnormals flushed); then the bias is added
// and the sum rounded to bf16 (nearest even, as PyTorch rounds). How many rows share a call
// and how they are blocked never changes that order, so a token's outputs are bitwise the
// same in a one-token decode step, a tree verify and a prefill chunk.
// Threads: OpenMP over panels, sharing PyTorch's runtime, so torch.set_num_threads applies.
#include <immintrin.h>

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "linear_common.h"

namespace {

using bf16 = uint16_t;

constexpr long kPanel = 32;  // output columns per panel: two 16-lane accumulators a row
constexpr long kRows = 12;  // activation rows in registers: 24 accumulators of the 32

// Activation rows [0, R) of a block, pair p of row r at xp[p * R + r] (a 32-bit broadcast).
void pack_rows(const bf16* x, long R, long K, int32_t* xp) {
  const long pairs = (K + 1) / 2;
  for (long r = 0; r < R; ++r) {
    const bf16* row = x + r * K;
    for (long p = 0; p < pairs; ++p) {
      const uint32_t lo = row[2 * p], hi = 2 * p + 1 < K ? row[2 * p + 1] : 0;
      xp[p * R + r] = static_cast<int32_t>(lo | hi << 16);
    }
  }
}

// R rows (packed) against panel q: 2R accumulators over every k pair, then bias and bf16.
template <int R>
void panel(const int32_t* xp, const bf16* pw, const bf16* bias, bf16* y, long N, long pairs, long q) {
  __m512 lo[R], hi[R];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm512_setzero_ps();
  for (long p = 0; p < pairs; ++p) {
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(pw + p * 2 * kPanel);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(pw + p * 2 * kPanel + kPanel);
    const int32_t* xr = xp + p * R;
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(xr[r]);
      lo[r] = _mm512_dpbf16_ps(lo[r], xb, w0);
      hi[r] = _mm512_dpbf16_ps(hi[r], xb, w1);
    }
  }
  const long n0 = q * kPanel, cols = std::min(kPanel, N - n0);
  alignas(64) float sums[kPanel];
  for (int r = 0; r < R; ++r) {
    _mm512_store_ps(sums, lo[r]);
    _mm512_store_ps(sums + 16, hi[r]);
    for (long c = 0; c < cols; ++c) {
      const float b = bias != nullptr ? bf16_to_f32(bias[n0 + c]) : 0.0f;
      y[r * N + n0 + c] = f32_to_bf16(sums[c] + b);
    }
  }
}

// The block's R rows (1 to kRows) through the matching register block.
template <int R>
void panel_rows(long rows, const int32_t* xp, const bf16* pw, const bf16* bias, bf16* y, long N, long pairs, long q) {
  if constexpr (R > 0) {
    if (rows == R)
      panel<R>(xp, pw, bias, y, N, pairs, q);
    else
      panel_rows<R - 1>(rows, xp, pw, bias, y, N, pairs, q);
  }
}

}  // namespace

extern "C" {

// Bytes of the packed form of a [N, K] bf16 weight.
long graft_bf16_panel_bytes(long N, long K) {
  return (N + kPanel - 1) / kPanel * kPanel * ((K + 1) / 2) * 2 * static_cast<long>(sizeof(bf16));
}

// w: [N, K] bf16, row-major; wp: graft_bf16_panel_bytes(N, K) bytes.
void graft_bf16_pack_panels(const void* w, void* wp, long N, long K) {
  const bf16* src = static_cast<const bf16*>(w);
  bf16* dst = static_cast<bf16*>(wp);
  const long panels = (N + kPanel - 1) / kPanel, pairs = (K + 1) / 2;
#pragma omp parallel for schedule(static)
  for (long q = 0; q < panels; ++q)
    for (long p = 0; p < pairs; ++p)
      for (long c = 0; c < kPanel; ++c)
        for (long t = 0; t < 2; ++t) {
          const long n = q * kPanel + c, k = 2 * p + t;
          dst[((q * pairs + p) * kPanel + c) * 2 + t] = n < N && k < K ? src[n * K + k] : 0;
        }
}

// x: [M, K] activations, wp: the packed weights, bias: [N] (or null), y: [M, N]; all bf16,
// x and y contiguous. Each thread takes whole panels and runs every block of kRows
// activation rows against a panel before the next, so the panel comes from memory once
// and then from its L2 cache.
void graft_bf16_panel_linear(const void* x, const void* wp, const void* bias, void* y, long M, long N, long K) {
  const long pairs = (K + 1) / 2, panels = (N + kPanel - 1) / kPanel, blocks = (M + kRows - 1) / kRows;
  const bf16* xs = static_cast<const bf16*>(x);
  // Kept between calls (it only grows, to the longest prefill chunk's rows), so no call pays
  // for fresh pages; named here, on the calling thread, not inside the parallel region.
  static thread_local std::vector<int32_t> packed_rows;
  packed_rows.resize(std::max<size_t>(packed_rows.size(), blocks * kRows * pairs));
  int32_t* xp = packed_rows.data();
  for (long b = 0; b < blocks; ++b) pack_rows(xs + b * kRows * K, std::min(kRows, M - b * kRows), K, xp + b * kRows * pairs);
  const bf16* w = static_cast<const bf16*>(wp);
  const bf16* bs = static_cast<const bf16*>(bias);
  bf16* ys = static_cast<bf16*>(y);
#pragma omp parallel for schedule(static)
  for (long q = 0; q < panels; ++q)
    for (long b = 0; b < blocks; ++b)
      panel_rows<kRows>(std::min(kRows, M - b * kRows), xp + b * kRows * pairs, w + q * pairs * 2 * kPanel, bs,
                        ys + b * kRows * N, N, pairs, q);
}
}
