// What the CPU linear kernels share: bf16 <-> float32 scalars, the fixed-order sum of eight
// float32 lanes, and the weight-row prefetch.
#pragma once

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>

// bf16 -> float32 is exact (the 16 bits are the float's top half).
inline float bf16_to_f32(uint16_t v) {
  const uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// float32 -> bf16, rounded to nearest even as PyTorch rounds.
inline uint16_t f32_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  if (std::isnan(f)) return 0x7fc0;
  bits += 0x7fff + ((bits >> 16) & 1);
  return static_cast<uint16_t>(bits >> 16);
}

// The eight lanes summed in a fixed tree (the same order whatever the call).
inline float lane_sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Software prefetch of weight-row streams. Why: the hardware prefetchers lose the stream at
// every short weight row (a 1536-wide bf16 row is 3 KB), and from a few activation rows up
// the multiply work keeps too few loads in flight; without it a 4-row product cost 1.4x a
// 1-row one on a Zen 2 core instead of ~1.0x.

// Bytes ahead of the current k that each weight row stream prefetches.
constexpr long kPrefetchBytes = 1024;

// One cache line for each of a register block's NR weight rows (`K` elements apart, from
// `w`), kPrefetchBytes past element k; past a row's end it runs into the same stream of the
// next register block (rows NR further on). Prefetches never fault, so running past the last
// row is harmless; the address is formed as an integer.
template <int NR, typename T>
inline void prefetch_rows(const T* w, long K, long k) {
  const uintptr_t base = reinterpret_cast<uintptr_t>(w);
  const long ahead = k + kPrefetchBytes / static_cast<long>(sizeof(T));
  for (int j = 0; j < NR; ++j) {
    const long at = ahead < K ? j * K + ahead : (j + NR) * K + (ahead - K);
    _mm_prefetch(reinterpret_cast<const char*>(base + at * sizeof(T)), _MM_HINT_T0);
  }
}
