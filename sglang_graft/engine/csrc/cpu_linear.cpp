// y = x @ w^T + b for the reference engine's linear layers on AVX2 CPUs.
//
// Why: on CPUs without native bf16 matrix instructions (AMD Zen 2/3, Intel before Cooper
// Lake) PyTorch's bf16 linear runs at ~12 GFLOP/s whatever the row count, so a verify over
// 8 tokens costs 6x a one-token decode step and speculation cannot pay; its float32 linear
// (MKL) is slow for 2-16 rows too. Here weights stay as loaded (bf16 or float32, row-major
// [N, K], no copy) and every product is computed in float32.
//
// Numerics: each output is one fixed-order float32 dot product: lane l of an 8-wide
// accumulator takes k = 8j + l in order of j, the eight lanes are then summed in a fixed
// tree, then the k % 8 tail, then the bias. Which rows share a call, and how the loops
// below are blocked, never changes that order, so a token's outputs are bitwise the same
// whether it is decoded alone or verified among a tree's tokens. bf16 outputs are rounded
// to nearest even, as PyTorch rounds. bf16 -> float32 is exact (the 16 bits are the
// float's top half: zero-extend, shift left by 16).
//
// Blocking: a register block is MR = 4 activation rows by NR = 3 weight rows (12
// accumulators, 4 activation vectors, 1 weight vector: the 16 AVX2 registers), which
// keeps the FMA units ~95% busy on a Zen 2 core (67-71 of 72 GFLOP/s in cache); one or two
// rows, which only stream the weights, take 2 x 6 blocks (more loads in flight). Each
// thread owns chunks of weight rows small enough to stay in its L2 cache and runs every
// activation row over a chunk before the next, so each weight byte comes from memory once
// per pass, and a pass's activations (~4 MB) from the L3 cache once per chunk. Threads:
// OpenMP, sharing the process's runtime (PyTorch's libgomp), so torch.set_num_threads
// applies.
#include <immintrin.h>

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "linear_common.h"

namespace {

inline float to_f32(float v) { return v; }
inline float to_f32(uint16_t v) { return bf16_to_f32(v); }

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

inline __m256 load8(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// One k-step of 8 for a register block: acc[i][j] += x[i][k:k+8] * w[j][k:k+8] lane-wise.
template <int MR, int NR, typename T>
inline void step(const float* x, const T* w, long K, long k, __m256 acc[MR][NR]) {
  __m256 xv[MR];
  for (int i = 0; i < MR; ++i) xv[i] = _mm256_loadu_ps(x + i * K + k);
  for (int j = 0; j < NR; ++j) {
    const __m256 wv = load8(w + j * K + k);
    for (int i = 0; i < MR; ++i) acc[i][j] = _mm256_fmadd_ps(xv[i], wv, acc[i][j]);
  }
}

// One register block: MR activation rows by NR weight rows (rows `K` apart) over k < K & ~7;
// the lane sums land in out[i][j].
template <int MR, int NR, typename T>
inline void dots(const float* x, const T* w, long K, float out[MR][NR]) {
  __m256 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_setzero_ps();
  long k = 0;
  for (; k + 32 <= K; k += 32) {
    prefetch_rows<NR>(w, K, k);  // one line per weight row per 32 k
    for (long kk = k; kk < k + 32; kk += 8) step<MR, NR>(x, w, K, kk, acc);
  }
  for (; k + 8 <= K; k += 8) step<MR, NR>(x, w, K, k, acc);
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) out[i][j] = lane_sum(acc[i][j]);
}

template <typename A>
inline void store(A* y, float v);
template <>
inline void store<float>(float* y, float v) { *y = v; }
template <>
inline void store<uint16_t>(uint16_t* y, float v) { *y = f32_to_bf16(v); }

struct Call {
  const float* x;  // activations [M, K] in float32 (a pass's rows)
  long M, N, K;
};

template <int MR, int NR, typename T, typename A>
inline void block(const Call& c, const T* w, const T* bias, A* y, long m, long n) {
  float out[MR][NR];
  dots<MR, NR>(c.x + m * c.K, w + n * c.K, c.K, out);
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) {
      float s = out[i][j];
      const T* wr = w + (n + j) * c.K;
      const float* xr = c.x + (m + i) * c.K;
      for (long k = c.K & ~7L; k < c.K; ++k) s = std::fmaf(xr[k], to_f32(wr[k]), s);
      if (bias != nullptr) s += to_f32(bias[n + j]);
      store(y + (m + i) * c.N + n + j, s);
    }
}

// Activation rows [m, M) in blocks of MR (the remainder in one smaller block) against the
// weight rows [n0, n1), NR at a time.
template <int MR, int NR, typename T, typename A>
inline void rows(const Call& c, const T* w, const T* bias, A* y, long n0, long n1) {
  long m = 0;
  for (; m + MR <= c.M; m += MR)
    for (long n = n0; n < n1; n += NR) block<MR, NR>(c, w, bias, y, m, n);
  const long left = c.M - m;
  for (long n = n0; n < n1; n += NR) {
    if (MR > 3 && left == 3) block<3, NR>(c, w, bias, y, m, n);
    if (MR > 2 && left == 2) block<2, NR>(c, w, bias, y, m, n);
    if (left == 1) block<1, NR>(c, w, bias, y, m, n);
  }
}

template <int MR, int NR, typename T, typename A>
void blocked(const float* x, const T* w, const T* bias, A* y, long M, long N, long K) {
  const long main_rows = N / NR * NR;
  // Weight rows per chunk: at most ~256 KB (an L2 share), at least four chunks per thread.
  const long threads = omp_get_max_threads();
  const long fit = (256L << 10) / std::max<long>(1, K * static_cast<long>(sizeof(T)));
  const long spread = (main_rows + 4 * threads - 1) / (4 * threads);
  const long chunk = std::max<long>(NR, std::min(fit, spread) / NR * NR);
  const long chunks = (main_rows + chunk - 1) / chunk;
  // Activation rows per pass over the weights: at most ~4 MB (an L3 share), so that every
  // chunk re-reads them from the cache (a long prompt's prefill takes several passes).
  const long pass = std::max<long>(MR, (4L << 20) / std::max<long>(1, K * static_cast<long>(sizeof(float))) / MR * MR);
  for (long m0 = 0; m0 < M; m0 += pass) {
    const Call c{x + m0 * K, std::min(pass, M - m0), N, K};
    A* yp = y + m0 * N;
#pragma omp parallel for schedule(static)
    for (long b = 0; b < chunks; ++b) rows<MR, NR>(c, w, bias, yp, b * chunk, std::min(main_rows, (b + 1) * chunk));
    if (main_rows < N) rows<MR, 1>(c, w, bias, yp, main_rows, N);
  }
}

template <typename T, typename A>
void linear(const A* x_in, const T* w, const T* bias, A* y, long M, long N, long K) {
  std::vector<float> converted;
  const float* x = nullptr;
  if constexpr (std::is_same_v<A, float>) {
    x = x_in;
  } else {
    converted.resize(static_cast<size_t>(M * K));
    for (long i = 0; i < M * K; ++i) converted[i] = to_f32(x_in[i]);
    x = converted.data();
  }
  // One or two rows stream the weights from memory: more weight rows per block keep more
  // loads in flight. More rows are compute-bound: 4 x 3 keeps the FMA units busiest.
  if (M <= 2)
    blocked<2, 6>(x, w, bias, y, M, N, K);
  else
    blocked<4, 3>(x, w, bias, y, M, N, K);
}

// The activations' dtype, for weights of type T.
template <typename T>
void by_activation(const void* x, const T* w, const T* bias, void* y, long M, long N, long K, int act_bf16) {
  if (act_bf16)
    linear(static_cast<const uint16_t*>(x), w, bias, static_cast<uint16_t*>(y), M, N, K);
  else
    linear(static_cast<const float*>(x), w, bias, static_cast<float*>(y), M, N, K);
}

}  // namespace

extern "C" {

// x: [M, K] activations, y: [M, N] outputs, both float32 (act_bf16 = 0) or bf16 (1);
// w: [N, K] and bias: [N] (or null), both float32 (w_bf16 = 0) or bf16 (1). All contiguous.
void graft_linear(const void* x, const void* w, const void* bias, void* y, long M, long N, long K, int act_bf16,
                  int w_bf16) {
  if (w_bf16)
    by_activation(x, static_cast<const uint16_t*>(w), static_cast<const uint16_t*>(bias), y, M, N, K, act_bf16);
  else
    by_activation(x, static_cast<const float*>(w), static_cast<const float*>(bias), y, M, N, K, act_bf16);
}
}
