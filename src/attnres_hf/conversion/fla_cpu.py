"""flash-linear-attention's own `TransformerForCausalLM` on the CPU: the check that an fla checkpoint and its
conversion compute the same logits, on a machine without CUDA.

fla 0.6.0's model code runs on any device, but several of the kernels it calls are Triton (CUDA-only here) or come
from flash-attn, and fail on CPU tensors (`fused_attnres` raises "Triton attnres requires CUDA tensors"; the others
"0 active drivers"). `fla_reference_kernels()` replaces exactly those, for as long as it is active, with fla's own
reference functions where fla has one and plain torch where it has none, and restores them afterwards:

| fla's kernel | replaced by |
|---|---|
| `fla.ops.attnres.fused_attnres` (in the transformer model) | fla's `naive_attnres` |
| `fla.modules.rotary.ops.rotary_embedding` | fla's `rotary_embedding_ref`, at the cached positions |
| `fla.modules.RMSNorm.forward` (`fuse_norm=True`, `qk_norm`) | fla's `rms_norm_ref` (fp32 inside, as the kernel) |
| `fla.modules.mlp.swiglu`, `swiglu_linear` | `silu(gate) * up` (then the down projection) |
| flash-attn's `flash_attn_func`, `flash_attn_varlen_func` | torch's `scaled_dot_product_attention` with flash-attn's mask: causal aligned to the last query, `window_size=(W-1, 0)` |

Everything else (the layers, the read/seal schedule of AttnRes, the cache, generation) is fla's code as installed.
The replacements are process-wide while active: use them for a check, not around other work.
"""

import contextlib
import importlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F

def _flash_mask(q_len: int, k_len: int, window: tuple[int, int], device) -> torch.Tensor:
    """flash-attn's causal mask `(q_len, k_len)`, True = attend: query `i` sits at key position `i + k_len - q_len`
    (aligned to the end, as flash-attn does with a cache), and sees keys no more than `window[0]` before it."""
    position = torch.arange(q_len, device=device)[:, None] + (k_len - q_len)
    key = torch.arange(k_len, device=device)[None, :]
    mask = key <= position
    if window[0] >= 0:
        mask &= key >= position - window[0]
    return mask


def _attention(q, k, v, causal=True, window_size=(-1, -1), softmax_scale=None, **unused) -> torch.Tensor:
    """flash-attn's `flash_attn_func` semantics on `(B, T, H, D)` tensors (grouped kv heads), in torch."""
    if unused.get("dropout_p"):
        raise ValueError("the CPU reference of flash-attn has no dropout")
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, T, D)
    mask = _flash_mask(q.shape[-2], k.shape[-2], window_size if causal else (-1, -1), q.device) if causal else None
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=softmax_scale, enable_gqa=True)
    return out.transpose(1, 2)


def _varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None, causal=True,
                      window_size=(-1, -1), softmax_scale=None, **unused) -> torch.Tensor:
    """flash-attn's `flash_attn_varlen_func` on packed `(total, H, D)` tensors: each sequence on its own."""
    outputs = []
    for i in range(len(cu_seqlens_q) - 1):
        qs, qe, ks, ke = (int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1]), int(cu_seqlens_k[i]),
                          int(cu_seqlens_k[i + 1]))
        outputs.append(_attention(q[None, qs:qe], k[None, ks:ke], v[None, ks:ke], causal, window_size,
                                  softmax_scale, **unused)[0])
    return torch.cat(outputs, dim=0)


def _rotary(rotary_embedding_ref):
    def rotary(x, cos, sin, interleaved=False, inplace=False, seqlen_offsets=0, cu_seqlens=None, chunk_indices=None):
        if cu_seqlens is not None:  # packed sequences: each restarts at position 0
            pieces = [rotary(x[:, s:e], cos, sin, interleaved, False, 0)
                      for s, e in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist())]
            return torch.cat(pieces, dim=1)
        length = x.shape[1]
        if isinstance(seqlen_offsets, int):
            return rotary_embedding_ref(x, cos[seqlen_offsets:seqlen_offsets + length],
                                        sin[seqlen_offsets:seqlen_offsets + length], interleaved)
        positions = seqlen_offsets.reshape(-1, 1) + torch.arange(length, device=x.device)  # (B, T), per sequence
        positions = positions.clamp(min=0)  # left padding: fla's offsets go negative there, the kernel clamps too
        rows = [rotary_embedding_ref(x[b:b + 1], cos[positions[b]], sin[positions[b]], interleaved)
                for b in range(x.shape[0])]
        return torch.cat(rows, dim=0)
    return rotary


@contextlib.contextmanager
def fla_reference_kernels() -> Iterator[dict[str, str]]:
    """Run fla 0.6's transformer model on CPU tensors while active (see the module docstring); yields what it
    replaced, `{"module.name": what runs instead}`, which conversion reports quote.

    Raises:
        ImportError: fla is not installed (`pip install "attnres-hf[fla]"`).
    """
    try:
        attn = importlib.import_module("fla.layers.attn")
        modeling = importlib.import_module("fla.models.transformer.modeling_transformer")
        rotary_ops = importlib.import_module("fla.modules.rotary.ops")
        mlp = importlib.import_module("fla.modules.mlp")
        layernorm = importlib.import_module("fla.modules.norm.layernorm")
        attnres_ops = importlib.import_module("fla.ops.attnres")
    except ImportError as error:
        raise ImportError(f"flash-linear-attention is needed to read or check its checkpoints ({error}); "
                          'pip install "attnres-hf[fla]"') from None

    def rms_norm_forward(self, x, residual=None, prenorm=False, residual_in_fp32=False):
        # fla's kernel adds and normalises in fp32 and hands the sum back in the input's dtype (fp32 on request)
        out = layernorm.rms_norm_ref(x, self.weight, self.bias, residual=residual, eps=self.eps, prenorm=prenorm,
                                     upcast=True)
        if not prenorm:
            return out
        out, total = out
        return out, total if residual_in_fp32 else total.to(x.dtype)

    def swiglu(gate, up):
        return (F.silu(gate.float()) * up.float()).to(gate.dtype)

    def swiglu_linear(gate, up, weight, bias):
        return F.linear(swiglu(gate, up), weight, bias)

    replacements = [  # (owner, name, replacement, what runs instead)
        (modeling, "fused_attnres", attnres_ops.naive_attnres, "fla.ops.attnres.naive_attnres"),
        (rotary_ops, "rotary_embedding", _rotary(rotary_ops.rotary_embedding_ref),
         "fla.modules.rotary.ops.rotary_embedding_ref"),
        (layernorm.RMSNorm, "forward", rms_norm_forward, "fla.modules.norm.layernorm.rms_norm_ref"),
        (mlp, "swiglu", swiglu, "torch: silu(gate) * up"),
        (mlp, "swiglu_linear", swiglu_linear, "torch: linear(silu(gate) * up)"),
        (attn, "flash_attn_func", _attention,
         "torch: scaled_dot_product_attention with flash-attn's causal/window mask"),
        (attn, "flash_attn_varlen_func", _varlen_attention,
         "torch: scaled_dot_product_attention per sequence, the same mask"),
    ]
    replaced = {f"{getattr(owner, '__module__', '') + '.' if isinstance(owner, type) else ''}"
                f"{owner.__name__}.{name}": what for owner, name, _, what in replacements}
    absent = object()
    saved = [(owner, name, owner.__dict__.get(name, absent)) for owner, name, _, _ in replacements]
    try:
        for owner, name, function, _ in replacements:
            setattr(owner, name, function)
        yield replaced
    finally:  # as found: what was absent (fla without flash-attn has no `flash_attn_varlen_func`) is removed again
        for owner, name, original in saved:
            if original is absent:
                delattr(owner, name)
            else:
                setattr(owner, name, original)
