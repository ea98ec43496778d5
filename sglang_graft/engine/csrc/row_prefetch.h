// Software prefetch of weight-row streams, shared by the CPU linear kernels.
//
// Why: the hardware prefetchers lose the stream at every short weight row (a 1536-wide bf16
// row is 3 KB), and from a few activation rows up the multiply work keeps too few loads in
// flight; without it a 4-row product cost 1.4x a 1-row one on a Zen 2 core instead of ~1.0x.
#pragma once

#include <immintrin.h>

#include <cstdint>

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
