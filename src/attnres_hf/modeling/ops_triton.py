"""The AttnRes read by the fused Triton kernels (`attnres_kernels.py`, through the autograd Functions of
`attnres_triton.py`), with the signature of the reference (`ops_naive.attnres`; arXiv:2603.15031, Eq. 1-4 over the
sources of Eq. 6): phase 1 of Algorithm 1 with one query (one read of each completed source, an online softmax),
then the merge of the partial sum. The kernels compute the paper's softmax router, with or without the key norm;
they run on CUDA, and on CPU tensors under Triton's interpreter (`TRITON_INTERPRET=1`, the tests).

Travels with checkpoints as remote code (a relative import of `ops.py`): imports only torch and its siblings
`attnres_triton.py`, `attnres_two_phase.py`, `mixing_base.py` and `ops_torch.py`; Triton loads
on first use (`attnres_triton._kernels`).
"""

import torch

from .attnres_triton import merge as merge_kernel, phase1 as phase1_kernel, serves
from .attnres_two_phase import _merged_weights
from .mixing_base import inverse_rms
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
    """One AttnRes read by the Triton kernels: `ops_naive.attnres`'s arguments and results (see there; sources as
    in `ops_torch.py`). Arithmetic in fp32 whatever the sources' dtype (float64 sources are not served: fp32
    kernels). While `torch.compile` traces, and on meta tensors, the torch implementation computes the read (a
    kernel launch outside a custom op is a graph break; the same numbers).

    Returns:
        `h (batch, seq_len, hidden_size)` in the sources' dtype and the depth weights `(batch, seq_len, n [+ 1])`
        fp32, or `None` without `return_weights`.

    Raises:
        ValueError: on sigmoid scores (the kernels compute the softmax router), or sources that are neither CUDA
            tensors nor interpreted (`attnres_triton.serves`).
        ImportError: where Triton is not installed.
    """
    if sigmoid:
        raise ValueError("the Triton kernels compute the softmax router (sigmoid=False); use the torch implementation")
    read = buffered(sources)
    if not serves(read):
        return torch_attnres(read, query, key_norm_weight, partial=partial, key_norm=key_norm, eps=eps,
                             output_scale=output_scale, inv_rms=inv_rms, return_weights=return_weights)
    query = query if query.dtype == torch.float32 else query.float()
    if key_norm_weight is not None:
        query = query * key_norm_weight.float()
    if key_norm and inv_rms is None:
        inv_rms = torch.stack([inverse_rms(source, eps) for source in read.sources], dim=-1)  # (B, T, n)
    probs, lse, mixed = (None if t is None else t.squeeze(2) for t in phase1_kernel(
        read, query.unsqueeze(0), inv_rms if key_norm else None, probs=return_weights))
    if partial is None:
        hidden, weights = mixed, probs if return_weights else None
    else:
        hidden, logit = merge_kernel(read, probs, partial, mixed, query, lse, eps, key_norm)
        weights = _merged_weights(probs, lse, logit) if return_weights else None
    if output_scale != 1.0:
        hidden = hidden * output_scale
    return hidden, weights
