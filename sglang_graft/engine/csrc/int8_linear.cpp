// y = x @ w^T + b for an int8 draft's linear layers on x86 CPUs with AVX512-VNNI or AMX:
// int8 weights, activations quantized per call, exact int32 sums.
//
// Why: a draft level feeds 1-20 tokens at once, and PyTorch's dynamic int8 linear (FBGEMM)
// is slow at both ends: the 0.5B draft's 168 matmuls took 24 ms for 1 row, 37 for 8 and 47
// for 19 on a 2-core Sapphire Rapids Xeon, while reading its 358 MB of int8 weights takes
// ~16 ms. Two paths over one weight layout:
//
// * AMX (Intel Sapphire Rapids and later): one tile product (TDPBSSD) multiplies 16 rows by
//   16 columns over 64 bytes of K, 16x the work of a VNNI instruction, so every row count up
//   to 32 streams the weights at memory speed: 16, 18 and 23 ms for the same 1, 8 and 19 rows.
// * AVX512-VNNI (AMD Zen 4, Intel Cascade/Ice Lake): one VPDPBUSD multiplies one row by 16
//   columns over 4 bytes of K, unsigned activations by signed weights, so activations are
//   stored shifted by +128 and 128 * (column sum of w) is subtracted from each sum. Blocks of
//   up to 8 rows x 32 columns keep 16 accumulators in registers, one weight load serving 8
//   rows: on a 2-core Zen 4 EPYC 12 / 16 / 24 ms for 1 / 8 / 16 rows against FBGEMM's 19 / 24 / 30.
//
// Numerics: weights are int8 per output channel (symmetric, scale = max|w| / 127, done in
// Python); each call quantizes every activation row on its own (symmetric, scale = max|x| /
// 127), so one row's outliers never clip another's (FBGEMM's dynamic path shares one
// scale per call). Integer sums are exact, so both paths give the same sums; y = sum *
// x_scale * w_scale + b in float32.
//
// Layouts: activations row-major int8 [M, K]; weights packed once as [N / 16][K / 4][16][4]
// (16 columns of 4 K-bytes: a B tile row for TDPBSSD, one zmm for VPDPBUSD; 16 consecutive K
// groups of one column block are 1 KB contiguous). Needs N % 32 == 0 and K % 64 == 0 (the
// Python side only sends such layers).
//
// AMX blocking: tiles 0 and 3 hold activation rows 0-15 and 16-31 of a 32-row chunk, tiles 1
// and 2 two 16-column weight blocks, tiles 4-7 the four int32 products; OpenMP threads
// (PyTorch's runtime, so torch.set_num_threads applies) split the 32-column pairs, on both
// paths. The tile configuration is per thread, so each thread loads it inside the parallel
// region.
#include <immintrin.h>
#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr long kRowsPerTile = 16;
constexpr long kColsPerTile = 16;   // int32 outputs per C tile row
constexpr long kTileBytes = 64;     // bytes per tile row
constexpr int kArchReqXcompPerm = 0x1023;
constexpr int kXfeatureXtiledata = 18;

struct TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Row m of x -> q[m] = round(x * 127 / max|x[m]|) (+128 as uint8 when `shifted`), scale[m] = max|x[m]| / 127.
void quantize_rows(const float* x, int8_t* q, float* scale, long M, long K, bool shifted) {
  const __m128i flip = _mm_set1_epi8(shifted ? static_cast<char>(0x80) : 0);
  for (long m = 0; m < M; ++m) {
    const float* row = x + m * K;
    __m512 amax = _mm512_setzero_ps();
    long k = 0;
    for (; k + 16 <= K; k += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(_mm512_loadu_ps(row + k)));
    float a = _mm512_reduce_max_ps(amax);
    for (; k < K; ++k) a = std::max(a, std::fabs(row[k]));
    const float inv = a > 0.f ? 127.f / a : 0.f;
    scale[m] = a / 127.f;
    const __m512 vinv = _mm512_set1_ps(inv);
    int8_t* out = q + m * K;
    for (k = 0; k + 16 <= K; k += 16) {
      const __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(row + k), vinv));  // round to nearest even
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + k), _mm_xor_si128(_mm512_cvtsepi32_epi8(v), flip));
    }
    for (; k < K; ++k) out[k] = static_cast<int8_t>(static_cast<int>(std::nearbyint(row[k] * inv)) ^ (shifted ? 0x80 : 0));
  }
}

// Rows [0, rows) of one 16 x 16 int32 product into y's columns [n0, n0 + 16).
void dequantize(const int32_t* c, const float* x_scale, const float* w_scale, const float* bias, float* y, long rows,
                long N, long n0) {
  const __m512 ws = _mm512_loadu_ps(w_scale + n0);
  const __m512 b = bias ? _mm512_loadu_ps(bias + n0) : _mm512_setzero_ps();
  for (long r = 0; r < rows; ++r) {
    const __m512 v = _mm512_cvtepi32_ps(_mm512_loadu_si512(c + r * kColsPerTile));
    _mm512_storeu_ps(y + r * N + n0, _mm512_fmadd_ps(v, _mm512_mul_ps(ws, _mm512_set1_ps(x_scale[r])), b));
  }
}

constexpr int kVnniRows = 8;  // rows per VNNI block: 2 x 8 accumulators + 2 weights + 1 broadcast fit 32 zmm

// Bytes ahead of the current K group that each of a VNNI block's two weight streams
// prefetches. Why: from a few rows on, the multiply work between two weight loads keeps too
// few of them in flight for the hardware prefetcher alone; on a 2-core Zen 5 EPYC the 0.5B
// draft's 168 int8 matmuls took 13.4 ms for 8 rows without it and 9.3 with it (8.0-8.3 for
// one row either way; 1 KB ahead: 10.5 ms, 4 KB: 9.3).
constexpr long kVnniPrefetchBytes = 2048;

// Rows [0, MR) of a (shifted) x times one 32-column pair of packed weights, dequantized into y.
template <int MR>
void vnni_block(const uint8_t* a, long K, const int8_t* b0, const int8_t* b1, const int32_t* comp, const float* x_scale,
                const float* w_scale, const float* bias, float* y, long N, long n0) {
  __m512i acc[MR][2];
  for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_si512();
  for (long g = 0; g < K / 4; ++g) {
    // Past a column block's end these run into the next block's weights, or past the last
    // (prefetches never fault; the addresses are formed as integers).
    const uintptr_t ahead = g * kTileBytes + kVnniPrefetchBytes;
    _mm_prefetch(reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(b0) + ahead), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(b1) + ahead), _MM_HINT_T0);
    const __m512i w0 = _mm512_loadu_si512(b0 + g * kTileBytes);
    const __m512i w1 = _mm512_loadu_si512(b1 + g * kTileBytes);
    for (int r = 0; r < MR; ++r) {
      int32_t four;  // 4 K-bytes of row r
      std::memcpy(&four, a + r * K + 4 * g, sizeof four);
      const __m512i av = _mm512_set1_epi32(four);
      acc[r][0] = _mm512_dpbusd_epi32(acc[r][0], av, w0);
      acc[r][1] = _mm512_dpbusd_epi32(acc[r][1], av, w1);
    }
  }
  for (int j = 0; j < 2; ++j) {
    const long n = n0 + j * kColsPerTile;
    const __m512i c = _mm512_loadu_si512(comp + n);
    const __m512 ws = _mm512_loadu_ps(w_scale + n);
    const __m512 bv = bias ? _mm512_loadu_ps(bias + n) : _mm512_setzero_ps();
    for (int r = 0; r < MR; ++r) {
      const __m512 v = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[r][j], c));
      _mm512_storeu_ps(y + r * N + n, _mm512_fmadd_ps(v, _mm512_mul_ps(ws, _mm512_set1_ps(x_scale[r])), bv));
    }
  }
}

// vnni_block<M> for a runtime M in [1, MR].
template <int MR>
void vnni_rows(const uint8_t* a, long M, long K, const int8_t* b0, const int8_t* b1, const int32_t* comp,
               const float* x_scale, const float* w_scale, const float* bias, float* y, long N, long n0) {
  if constexpr (MR > 0) {
    if (M == MR) return vnni_block<MR>(a, K, b0, b1, comp, x_scale, w_scale, bias, y, N, n0);
    vnni_rows<MR - 1>(a, M, K, b0, b1, comp, x_scale, w_scale, bias, y, N, n0);
  }
}

}  // namespace

extern "C" {

// Asks Linux for the AMX tile state (once per process; later calls are no-ops). 0 on success.
int graft_amx_enable() { return static_cast<int>(syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata)); }

// w: [N, K] int8 row-major -> packed [N / 16][K / 4][16][4].
void graft_int8_pack(const int8_t* w, int8_t* packed, long N, long K) {
  const long groups = K / 4;
  for (long nb = 0; nb < N / kColsPerTile; ++nb)
    for (long g = 0; g < groups; ++g)
      for (long j = 0; j < kColsPerTile; ++j)
        for (long t = 0; t < 4; ++t)
          packed[((nb * groups + g) * kColsPerTile + j) * 4 + t] = w[(nb * kColsPerTile + j) * K + 4 * g + t];
}

// y [M, N] float32 = quantized(x [M, K] float32) @ w^T * w_scale + bias (bias may be null).
void graft_amx_linear(const float* x, const int8_t* packed, const float* w_scale, const float* bias, float* y, long M,
                      long N, long K) {
  static thread_local std::vector<int8_t> xq;
  static thread_local std::vector<float> xs;
  xq.resize(M * K);
  xs.resize(M);
  quantize_rows(x, xq.data(), xs.data(), M, K, false);
  const long groups = K / 4;
  const long pairs = N / (2 * kColsPerTile);
  for (long m0 = 0; m0 < M; m0 += 2 * kRowsPerTile) {
    const long r0 = std::min(kRowsPerTile, M - m0);
    const long r1 = std::clamp(M - m0 - kRowsPerTile, 0L, kRowsPerTile);
    TileConfig cfg;
    for (int t : {0, 4, 5}) cfg.rows[t] = static_cast<uint8_t>(r0);
    for (int t : {3, 6, 7}) cfg.rows[t] = static_cast<uint8_t>(r1);
    cfg.rows[1] = cfg.rows[2] = kRowsPerTile;
    for (int t = 0; t < 8; ++t) cfg.colsb[t] = cfg.rows[t] ? kTileBytes : 0;
    const int8_t* a = xq.data() + m0 * K;
    const float* s = xs.data() + m0;
    float* out = y + m0 * N;
#pragma omp parallel
    {
      _tile_loadconfig(&cfg);
      alignas(64) int32_t c[4][kRowsPerTile * kColsPerTile];
#pragma omp for schedule(static)
      for (long p = 0; p < pairs; ++p) {
        const int8_t* b0 = packed + (2 * p) * groups * kTileBytes;
        const int8_t* b1 = packed + (2 * p + 1) * groups * kTileBytes;
        _tile_zero(4);
        _tile_zero(5);
        if (r1) {
          _tile_zero(6);
          _tile_zero(7);
        }
        for (long k0 = 0; k0 < K; k0 += kTileBytes) {
          _tile_loadd(0, a + k0, K);
          _tile_loadd(1, b0 + k0 * kColsPerTile, kTileBytes);
          _tile_loadd(2, b1 + k0 * kColsPerTile, kTileBytes);
          _tile_dpbssd(4, 0, 1);
          _tile_dpbssd(5, 0, 2);
          if (r1) {
            _tile_loadd(3, a + kRowsPerTile * K + k0, K);
            _tile_dpbssd(6, 3, 1);
            _tile_dpbssd(7, 3, 2);
          }
        }
        const long n0 = 2 * p * kColsPerTile;
        _tile_stored(4, c[0], kTileBytes);
        _tile_stored(5, c[1], kTileBytes);
        dequantize(c[0], s, w_scale, bias, out, r0, N, n0);
        dequantize(c[1], s, w_scale, bias, out, r0, N, n0 + kColsPerTile);
        if (r1) {
          _tile_stored(6, c[2], kTileBytes);
          _tile_stored(7, c[3], kTileBytes);
          dequantize(c[2], s + kRowsPerTile, w_scale, bias, out + kRowsPerTile * N, r1, N, n0);
          dequantize(c[3], s + kRowsPerTile, w_scale, bias, out + kRowsPerTile * N, r1, N, n0 + kColsPerTile);
        }
      }
      _tile_release();
    }
  }
}

// The AVX512-VNNI path of graft_amx_linear; comp[n] = 128 * sum_k w[n, k] (int32).
void graft_vnni_linear(const float* x, const int8_t* packed, const int32_t* comp, const float* w_scale,
                       const float* bias, float* y, long M, long N, long K) {
  static thread_local std::vector<int8_t> xq;
  static thread_local std::vector<float> xs;
  xq.resize(M * K);
  xs.resize(M);
  quantize_rows(x, xq.data(), xs.data(), M, K, true);
  // Thread-local buffers are named here, on the calling thread: inside the parallel region
  // `xq` would be each worker's own (empty) vector.
  const uint8_t* a = reinterpret_cast<const uint8_t*>(xq.data());
  const float* s = xs.data();
  const long groups = K / 4;
  const long pairs = N / (2 * kColsPerTile);
#pragma omp parallel for schedule(static)
  for (long p = 0; p < pairs; ++p) {
    const int8_t* b0 = packed + (2 * p) * groups * kTileBytes;
    const int8_t* b1 = packed + (2 * p + 1) * groups * kTileBytes;
    for (long m0 = 0; m0 < M; m0 += kVnniRows)
      vnni_rows<kVnniRows>(a + m0 * K, std::min<long>(kVnniRows, M - m0), K, b0, b1, comp, s + m0, w_scale, bias,
                           y + m0 * N, N, 2 * p * kColsPerTile);
  }
}
}
