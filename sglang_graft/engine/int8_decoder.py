"""An int8 draft's decoder layers as two kernel calls each, around the model's own attention.

Once the int8 draft's matmuls ran on the project's kernel (``engine.int8_linear``), more
than a quarter of its forward went to PyTorch ops between them: on a 2-core Zen 5 EPYC the
0.5B draft's forward over one token took 16.7 ms, of which the 168 int8 matmul calls 10.1,
attention 0.6 and the head 1.5, and the other ~4.5 ms went to transformers' ~25 small ops a
layer (RMSNorm, the rotary embedding, residual adds, SiLU and the product with up, views
and copies). ``csrc/int8_decoder.cpp`` does a layer's work before attention
(``graft_int8_layer_qkv``) and after it (``graft_int8_layer_out``) in one call each; the KV
cache update and attention stay the model's own (the engine's cache compaction and
attention kernel serve every model alike). The forward then took 11.9 ms instead of 15.9
(13.5 against 17.2 for 4 tokens), and graft ran 4.6% faster end to end. The layer's outputs equal transformers' up to float rounding (RMSNorm and SiLU sum
and exponentiate in their own order); the draft only proposes, so losslessness does not
depend on it.

``fuse_int8_layers`` swaps every Llama/Qwen2/Qwen3/Mistral decoder layer of an
``int8_draft`` whose seven projections all run on one int8 kernel (``Int8Linear``) for a
``FusedInt8Layer``. Other layers stay as they are: other architectures, activations other
than SiLU, or projections on PyTorch's FBGEMM path.
"""

from __future__ import annotations

import ctypes
import functools
import sys
from collections.abc import Callable

import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from sglang_graft.engine.int8_linear import Int8Linear, library, unavailable_reason

#: Decoder layer classes whose forward ``FusedInt8Layer`` computes: pre-norm RMSNorm
#: blocks, rotary embedding in rotate-half form, a SiLU-gated MLP, and for Qwen3 per-head
#: RMSNorms of q and k before the rotation.
FUSABLE_LAYERS = ("LlamaDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer", "MistralDecoderLayer")

#: The struct's matrices, in ``csrc/int8_decoder.cpp``'s order, and where each sits in a layer.
PROJECTIONS = {
    "q": ("self_attn", "q_proj"),
    "k": ("self_attn", "k_proj"),
    "v": ("self_attn", "v_proj"),
    "o": ("self_attn", "o_proj"),
    "gate": ("mlp", "gate_proj"),
    "up": ("mlp", "up_proj"),
    "down": ("mlp", "down_proj"),
}


class _Matrix(ctypes.Structure):
    _fields_ = [
        ("packed", ctypes.c_void_p),
        ("comp", ctypes.c_void_p),
        ("scale", ctypes.c_void_p),
        ("bias", ctypes.c_void_p),
        ("out", ctypes.c_long),
        ("in_", ctypes.c_long),
    ]


class _Layer(ctypes.Structure):
    _fields_ = [(name, _Matrix) for name in PROJECTIONS] + [
        ("input_norm", ctypes.c_void_p),
        ("post_norm", ctypes.c_void_p),
        ("q_norm", ctypes.c_void_p),
        ("k_norm", ctypes.c_void_p),
        ("eps", ctypes.c_float),
        ("heads", ctypes.c_long),
        ("kv_heads", ctypes.c_long),
        ("head_dim", ctypes.c_long),
        ("amx", ctypes.c_int),
    ]


@functools.cache
def _calls() -> ctypes.CDLL:
    lib = library()
    lib.graft_int8_layer_qkv.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_long] * 2 + [ctypes.c_void_p] * 5
    lib.graft_int8_layer_qkv.restype = None
    lib.graft_int8_layer_out.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_long]
    lib.graft_int8_layer_out.restype = None
    return lib


def _projections(layer: torch.nn.Module) -> dict[str, torch.nn.Module] | None:
    try:
        return {name: getattr(getattr(layer, block), proj) for name, (block, proj) in PROJECTIONS.items()}
    except AttributeError:
        return None


def fusable(layer: torch.nn.Module) -> bool:
    """Whether ``FusedInt8Layer`` computes ``layer``'s forward: a ``FUSABLE_LAYERS`` layer
    with SiLU, float32 RMSNorms (per-head q/k ones, where it has them) of one epsilon, and
    every projection an ``Int8Linear`` on the same kernel."""
    projections = _projections(layer)
    if type(layer).__name__ not in FUSABLE_LAYERS or projections is None:
        return False
    if not all(isinstance(m, Int8Linear) for m in projections.values()):
        return False
    attention = layer.self_attn
    norms = [layer.input_layernorm, layer.post_attention_layernorm, *_head_norms(attention)]
    return (
        len({m.kernel for m in projections.values()}) == 1
        and getattr(attention.config, "hidden_act", None) == "silu"
        and attention.head_dim % 2 == 0
        and all(n.weight.dtype == torch.float32 for n in norms)
        and len({n.variance_epsilon for n in norms}) == 1
    )


def _head_norms(attention: torch.nn.Module) -> list[torch.nn.Module]:
    """Qwen3's per-head RMSNorms of q and k (none for other layers)."""
    return [attention.q_norm, attention.k_norm] if hasattr(attention, "q_norm") else []


class FusedInt8Layer(torch.nn.Module):
    """A decoder layer's forward (transformers' signature) as ``graft_int8_layer_qkv``, the
    model's KV cache update and attention function, then ``graft_int8_layer_out``. Holds the
    layer it replaces (its weights, and the attention module the attention function takes)."""

    def __init__(self, layer: torch.nn.Module) -> None:
        if not fusable(layer):
            raise ValueError(f"{type(layer).__name__} is not a fusable int8 decoder layer (see fusable)")
        super().__init__()
        self.layer = layer
        self._struct: _Layer | None = None  # pointers into the weights: rebuilt after any move
        kernel = layer.self_attn.q_proj.kernel
        problem = unavailable_reason(kernel)  # builds the library, and for amx asks for the tile state
        if problem is not None:
            raise ValueError(f"the {kernel} int8 kernel cannot run here: {problem}")
        module = sys.modules[type(layer.self_attn).__module__]
        self._eager_attention = getattr(module, "eager_attention_forward", None)

    def _layer_struct(self) -> _Layer:
        if self._struct is None:
            layer = self.layer
            attention, projections = layer.self_attn, _projections(layer)
            assert projections is not None
            self._struct = _Layer(
                **{name: _matrix(m) for name, m in projections.items()},
                input_norm=layer.input_layernorm.weight.data_ptr(),
                post_norm=layer.post_attention_layernorm.weight.data_ptr(),
                **{name: norm.weight.data_ptr() for name, norm in zip(("q_norm", "k_norm"), _head_norms(attention))},
                eps=layer.input_layernorm.variance_epsilon,
                heads=attention.config.num_attention_heads,
                kv_heads=attention.config.num_key_value_heads,
                head_dim=attention.head_dim,
                amx=int(projections["q"].kernel == "amx"),
            )
        return self._struct

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], *args: object, **kwargs: object) -> "FusedInt8Layer":
        out = super()._apply(fn, *args, **kwargs)
        self._struct = None
        return out

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_struct": None}

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        past_key_values: object | None = None,
        use_cache: bool | None = False,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        **kwargs: object,
    ) -> torch.Tensor:
        attention, s = self.layer.self_attn, self._layer_struct()
        batch, rows, hidden = hidden_states.shape
        if hidden_states.dtype != torch.float32 or hidden != s.q.in_ or position_embeddings is None:
            raise ValueError(
                f"FusedInt8Layer takes float32 hidden states of {s.q.in_} features and the model's rotary "
                f"position_embeddings, got {hidden_states.dtype} with {hidden} features"
                f"{'' if position_embeddings is not None else ' and no position_embeddings'}"
            )
        x = hidden_states.contiguous()
        cos, sin = (t.to(torch.float32).expand(batch, rows, s.head_dim).contiguous() for t in position_embeddings)
        q = torch.empty(batch, s.heads, rows, s.head_dim)
        k = torch.empty(batch, s.kv_heads, rows, s.head_dim)
        v = torch.empty(batch, s.kv_heads, rows, s.head_dim)
        struct, calls = ctypes.byref(s), _calls()
        calls.graft_int8_layer_qkv(
            struct, x.data_ptr(), batch, rows, cos.data_ptr(), sin.data_ptr(), q.data_ptr(), k.data_ptr(), v.data_ptr()
        )
        if past_key_values is not None:
            k, v = past_key_values.update(k, v, attention.layer_idx)
        attend = ALL_ATTENTION_FUNCTIONS.get_interface(attention.config._attn_implementation, self._eager_attention)
        out, _ = attend(
            attention,
            q,
            k,
            v,
            attention_mask,
            dropout=0.0,
            scaling=attention.scaling,
            sliding_window=getattr(attention, "sliding_window", None),
            **kwargs,
        )
        out = out.reshape(batch * rows, s.heads * s.head_dim).contiguous()
        y = torch.empty_like(x)
        calls.graft_int8_layer_out(struct, out.data_ptr(), x.data_ptr(), y.data_ptr(), batch * rows)
        return y


def _matrix(linear: Int8Linear) -> _Matrix:
    comp = None if linear.comp is None else linear.comp.data_ptr()
    bias = None if linear.bias is None else linear.bias.data_ptr()
    scale = linear.scale.data_ptr()
    return _Matrix(linear.packed.data_ptr(), comp, scale, bias, linear.out_features, linear.in_features)


def fuse_int8_layers(model: torch.nn.Module) -> int:
    """Swap each ``fusable`` decoder layer of ``model`` (an ``int8_draft``) for a
    ``FusedInt8Layer``, in place; returns how many were swapped."""
    swapped = 0
    for module in list(model.modules()):
        if isinstance(module, torch.nn.ModuleList):
            for i, layer in enumerate(module):
                if fusable(layer):
                    module[i] = FusedInt8Layer(layer)
                    swapped += 1
    return swapped
