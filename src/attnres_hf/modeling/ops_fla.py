"""The AttnRes read by flash-linear-attention's fused kernel (`fla.ops.attnres.fused_attnres`, Triton on CUDA;
the glue in `attnres_fla.py`), with the signature of the reference (`ops_naive.attnres`; arXiv:2603.15031, Eq. 1-4
over the sources of Eq. 6). fla computes the paper's router: softmax scores, the key norm with its weight, one
static query; it returns no depth weights here. The reads it does not serve go to the torch implementation (the
same numbers).

Travels with checkpoints as remote code (a relative import of `ops.py`): imports only torch and its siblings
`attnres_fla.py` and `ops_torch.py`; fla loads on first use.
"""

import torch

from .attnres_fla import aligned, check_device, fused_read
from .ops_torch import Sources, attnres as torch_attnres, buffered


def attnres(
    sources: Sources,
    query: torch.Tensor,
    key_norm_weight: torch.Tensor | None = None,
    *,
    partial: torch.Tensor | None = None,
    key_norm: bool = True,
    eps: float = 1e-6,
    sigmoid: bool = False,
    output_scale: float = 1.0,
    inv_rms: torch.Tensor | None = None,
    return_weights: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One AttnRes read by fla's `fused_attnres`: `ops_naive.attnres`'s arguments and results (see there; sources as
    in `ops_torch.py`; `inv_rms` unused: fla computes the key norm itself).

    The torch implementation computes the read where fla does not: depth weights asked for (`return_weights`),
    sigmoid scores, no key norm or its weight folded into the query (`key_norm_weight=None`: a hook intercepts the
    key norm, accelerate's offload), while `torch.compile` traces (fla's dispatch is a graph break), or sources fla's
    pointer table cannot take (`attnres_fla.aligned`).

    Returns:
        `h (batch, seq_len, hidden_size)` in the sources' dtype, and `None` for the depth weights where fla computed
        the read (the torch implementation's otherwise).

    Raises:
        ValueError: on sources that are not CUDA tensors (`attnres_fla.check_device`).
        ImportError: where fla is not installed.
    """
    read = buffered(sources)
    check_device(read.buffer.device)
    if (return_weights or sigmoid or not key_norm or key_norm_weight is None or torch.compiler.is_compiling()
            or not aligned(read.buffer, partial)):
        return torch_attnres(read, query, key_norm_weight, partial=partial, key_norm=key_norm, eps=eps,
                             sigmoid=sigmoid, output_scale=output_scale, inv_rms=inv_rms,
                             return_weights=return_weights)
    hidden = fused_read(read, query, key_norm_weight, partial, eps)
    return (hidden if output_scale == 1.0 else hidden * output_scale), None
