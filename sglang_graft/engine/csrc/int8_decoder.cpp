// The int8 draft's decoder layer (Llama, Qwen2, Qwen3) around its attention, in two calls.
//
// Why: the int8 matmuls are quick (int8_linear.cpp: the 0.5B draft's 168 take 8-10 ms for
// 1-4 rows on a 2-core Zen 5 EPYC), yet one draft forward over one token took 16.7 ms:
// transformers' layer runs ~25 PyTorch ops around them (RMSNorm in five, the rotary
// embedding with two concatenations, residual adds, SiLU, the product with up, views),
// each paying its dispatch and allocation, about 5 ms over 24 layers. Here a layer is two
// calls: `graft_int8_layer_qkv` (input RMSNorm, q/k/v, Qwen3's per-head q/k norms, the
// rotary embedding, heads laid out as attention takes them) and `graft_int8_layer_out`
// (o_proj, residual, post-attention RMSNorm, gate and up, SiLU(gate) * up, down, residual).
// The KV cache and attention stay in Python: the engine's cache compaction and attention
// kernel serve every model alike.
//
// Numerics: float32, as the int8 draft computes outside its matmuls; the matmuls are
// graft_vnni_linear / graft_amx_linear, the calls Int8Linear makes, so they see the same
// inputs up to RMSNorm's rounding: its sum of squares runs in 16 lanes and SiLU's exp is
// avx512_exp.h's polynomial, so outputs differ from transformers' layer in the last bits.
// Lossless decoding does not depend on that (the target verifies every token).
//
// Layouts (float32, contiguous): x and y [batch * rows, hidden]; cos and sin [batch * rows,
// head_dim] (transformers' rotary embedding for each token's position); q [batch, heads,
// rows, head_dim], k and v [batch, kv_heads, rows, head_dim]; attn [batch * rows, heads *
// head_dim] (what attention hands to o_proj).
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "avx512_exp.h"

extern "C" {
void graft_amx_linear(const float* x, const int8_t* packed, const float* w_scale, const float* bias, float* y, long M,
                      long N, long K);
void graft_vnni_linear(const float* x, const int8_t* packed, const int32_t* comp, const float* w_scale,
                       const float* bias, float* y, long M, long N, long K);

// One int8 linear layer as Int8Linear holds it (comp: the VNNI correction, null for AMX).
struct Int8Matrix {
  const int8_t* packed;
  const int32_t* comp;
  const float* scale;
  const float* bias;
  long out;
  long in;
};

struct Int8DecoderLayer {
  Int8Matrix q, k, v, o, gate, up, down;
  const float* input_norm;
  const float* post_norm;
  const float* q_norm;  // Qwen3's per-head RMSNorms of q and k (head_dim weights), or null
  const float* k_norm;
  float eps;
  long heads, kv_heads, head_dim;
  int amx;
};
}

namespace {

constexpr long kLanes = 16;

inline __mmask16 lanes_below(long n) { return n >= kLanes ? 0xFFFF : static_cast<__mmask16>((1u << n) - 1); }

void linear(const Int8DecoderLayer& layer, const Int8Matrix& w, const float* x, float* y, long M) {
  if (layer.amx)
    graft_amx_linear(x, w.packed, w.scale, w.bias, y, M, w.out, w.in);
  else
    graft_vnni_linear(x, w.packed, w.comp, w.scale, w.bias, y, M, w.out, w.in);
}

// y = w * (x / sqrt(mean(x^2) + eps)) per row, in transformers' order of the two products.
void rms_norm(const float* x, const float* w, float eps, float* y, long M, long H) {
  for (long m = 0; m < M; ++m) {
    const float* row = x + m * H;
    __m512 squares = _mm512_setzero_ps();
    for (long k = 0; k < H; k += kLanes) {
      const __m512 v = _mm512_maskz_loadu_ps(lanes_below(H - k), row + k);
      squares = _mm512_fmadd_ps(v, v, squares);
    }
    const __m512 inv = _mm512_set1_ps(1.f / std::sqrt(_mm512_reduce_add_ps(squares) / static_cast<float>(H) + eps));
    for (long k = 0; k < H; k += kLanes) {
      const __mmask16 live = lanes_below(H - k);
      const __m512 normed = _mm512_mul_ps(_mm512_maskz_loadu_ps(live, row + k), inv);
      _mm512_mask_storeu_ps(y + m * H + k, live, _mm512_mul_ps(_mm512_maskz_loadu_ps(live, w + k), normed));
    }
  }
}

// Token-major projections [batch * rows, heads * d] -> head-major [batch, heads, rows, d],
// each head RMS-normed first where `norm` is given (Qwen3's q and k norms), with the rotary
// embedding (transformers' rotate-half form) where cos is given.
void to_heads(const float* src, const float* norm, float eps, const float* cos, const float* sin, float* dst,
              long batch, long rows, long heads, long d) {
  const long half = d / 2;
  std::vector<float> normed(norm ? d : 0);
  for (long b = 0; b < batch; ++b)
    for (long r = 0; r < rows; ++r) {
      const long token = b * rows + r;
      for (long h = 0; h < heads; ++h) {
        const float* in = src + (token * heads + h) * d;
        float* out = dst + ((b * heads + h) * rows + r) * d;
        if (norm != nullptr) {
          rms_norm(in, norm, eps, normed.data(), 1, d);
          in = normed.data();
        }
        if (cos == nullptr) {
          std::copy(in, in + d, out);
          continue;
        }
        const float* c = cos + token * d;
        const float* s = sin + token * d;
        for (long i = 0; i < half; ++i) {
          out[i] = in[i] * c[i] - in[i + half] * s[i];
          out[i + half] = in[i + half] * c[i + half] + in[i] * s[i + half];
        }
      }
    }
}

// gate = SiLU(gate) * up, SiLU(g) = g * sigmoid(g) with sigmoid from exp(-|g|) (never overflows).
void silu_times(float* gate, const float* up, long n) {
  const __m512 one = _mm512_set1_ps(1.f);
  for (long i = 0; i < n; i += kLanes) {
    const __mmask16 live = lanes_below(n - i);
    const __m512 g = _mm512_maskz_loadu_ps(live, gate + i);
    const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(g)));
    const __mmask16 negative = _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_LT_OQ);
    const __m512 sigmoid = _mm512_div_ps(_mm512_mask_mov_ps(one, negative, e), _mm512_add_ps(one, e));
    const __m512 u = _mm512_maskz_loadu_ps(live, up + i);
    _mm512_mask_storeu_ps(gate + i, live, _mm512_mul_ps(_mm512_mul_ps(g, sigmoid), u));
  }
}

void add_into(float* y, const float* x, long n) {
  for (long i = 0; i < n; i += kLanes) {
    const __mmask16 live = lanes_below(n - i);
    const __m512 sum = _mm512_add_ps(_mm512_maskz_loadu_ps(live, x + i), _mm512_maskz_loadu_ps(live, y + i));
    _mm512_mask_storeu_ps(y + i, live, sum);
  }
}

}  // namespace

extern "C" {

// Input RMSNorm, q/k/v projections, per-head q/k norms (Qwen3), rotary embedding on q and k, heads first.
void graft_int8_layer_qkv(const Int8DecoderLayer* layer, const float* x, long batch, long rows, const float* cos,
                          const float* sin, float* q, float* k, float* v) {
  const long M = batch * rows;
  static thread_local std::vector<float> normed, projected;
  normed.resize(M * layer->q.in);
  projected.resize(M * layer->q.out);
  rms_norm(x, layer->input_norm, layer->eps, normed.data(), M, layer->q.in);
  linear(*layer, layer->q, normed.data(), projected.data(), M);
  const float eps = layer->eps;
  to_heads(projected.data(), layer->q_norm, eps, cos, sin, q, batch, rows, layer->heads, layer->head_dim);
  linear(*layer, layer->k, normed.data(), projected.data(), M);
  to_heads(projected.data(), layer->k_norm, eps, cos, sin, k, batch, rows, layer->kv_heads, layer->head_dim);
  linear(*layer, layer->v, normed.data(), projected.data(), M);
  to_heads(projected.data(), nullptr, eps, nullptr, nullptr, v, batch, rows, layer->kv_heads, layer->head_dim);
}

// y = x + o_proj(attn), then y += down(SiLU(gate(n)) * up(n)) with n = post-attention RMSNorm of y.
void graft_int8_layer_out(const Int8DecoderLayer* layer, const float* attn, const float* x, float* y, long M) {
  const long hidden = layer->o.out, inner = layer->gate.out;
  static thread_local std::vector<float> normed, gate, up, down;
  normed.resize(M * hidden);
  gate.resize(M * inner);
  up.resize(M * inner);
  down.resize(M * hidden);
  linear(*layer, layer->o, attn, y, M);
  add_into(y, x, M * hidden);
  rms_norm(y, layer->post_norm, layer->eps, normed.data(), M, hidden);
  linear(*layer, layer->gate, normed.data(), gate.data(), M);
  linear(*layer, layer->up, normed.data(), up.data(), M);
  silu_times(gate.data(), up.data(), M * inner);
  linear(*layer, layer->down, gate.data(), down.data(), M);
  add_into(y, down.data(), M * hidden);
}
}
