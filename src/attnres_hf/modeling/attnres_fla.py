"""flash-linear-attention's fused AttnRes read (`fla.ops.attnres.fused_attnres`: Triton, forward and backward, one
read of each source with an online softmax) over the model's source buffer: the glue under `ops_fla.attnres`, the CUDA
implementation of the direct router read (`AttnResConfig.attnres_implementation="fla"`; arXiv:2603.15031, Eq. 1-4
over the sources of Eq. 6), and the config's check.

Travels with checkpoints as remote code (a relative import of `ops_fla.py` and `mixing_attnres.py`): imports only
torch and its sibling `mixing_base.py`. fla is an optional dependency, imported lazily inside a `try`
(`_fused_attnres`): transformers' remote-code loader skips imports in `try` blocks, so a checkpoint loads where fla
is not installed.
"""

import torch
from torch.autograd.function import once_differentiable

from .mixing_base import check_implementation


def _fused_attnres():
    """fla's `fused_attnres`, imported on first use (fla imports Triton: seconds, and only where it is installed)."""
    try:
        from fla.ops.attnres import fused_attnres
    except ImportError as error:
        raise ImportError("attnres_implementation='fla' needs flash-linear-attention and Triton: "
                          'pip install "attnres-hf[fla]"') from error
    return fused_attnres


def require_fla(config) -> None:
    """At model construction: refuse a config fla cannot compute (`ValueError`), or fla not importable
    (`ImportError`), rather than at the first forward."""
    check_implementation(config, "fla")
    _fused_attnres()


def _on_cuda(device: torch.device) -> bool:
    """Whether fla's Triton kernel can read tensors on `device` (the one device predicate of this path)."""
    return device.type == "cuda"


def check_device(device: torch.device) -> None:
    """Raise `ValueError` for a device other than CUDA (fla's `fused_attnres` is Triton on CUDA)."""
    if not _on_cuda(device):
        device = device.type
        raise ValueError(f"attnres_implementation='fla' needs CUDA tensors (fla's fused_attnres is Triton on CUDA), "
                         f"got {device} tensors; use attnres_implementation='torch' on {device}")


def aligned(buffer: torch.Tensor, partial: torch.Tensor | None) -> bool:
    """Whether fla's pointer table can take these sources: addresses 16-byte aligned, the partial sum in the
    buffer's dtype."""
    return (buffer.data_ptr() % 16 == 0 and buffer.stride(0) * buffer.element_size() % 16 == 0
            and (partial is None or (partial.dtype == buffer.dtype and partial.data_ptr() % 16 == 0)))


def fused_read(sources, query: torch.Tensor, weight: torch.Tensor, partial: torch.Tensor | None,
               eps: float) -> torch.Tensor:
    """fla's `fused_attnres` over the completed sources (`sources`: an `attnres_buffer.SourceBuffer`, read as views
    of its buffer) and the partial sum: `h (batch, seq_len, hidden_size)` in the sources' dtype.

    AttnRes: the next sub-layer's pre-norm is not folded in (`output_rms_weight`): it is the backbone family's own
    module (Gemma's `1 + w`, its own epsilon and casts, hooks), and the final router's output is also the last hidden
    state; fla's folded norm is a Llama RMSNorm with the router's epsilon."""
    fused, buffer, n = _fused_attnres(), sources.buffer, len(sources.sources)
    inputs = sources.handles + (query, weight) + (() if partial is None else (partial,))
    if torch.is_grad_enabled() and any(t.requires_grad for t in inputs):
        return _FusedRead.apply(fused, buffer, sources.grads, n, query, weight, eps, partial, *sources.handles)
    slots = list(buffer[:n].unbind(0))  # (B, T, D) views of the buffer
    return fused(query, slots if partial is None else [*slots, partial], weight, rms_eps=eps)


class _FusedRead(torch.autograd.Function):
    """`fused(query, [buffer[0], ..., buffer[n-1], partial], weight)` with gradients, reading the source buffer.

    fla saves the sources it is given for backward, so it is given views of the buffer (which the forward keeps
    anyway): given the original source tensors, it would keep them too, a second copy of every source in Full
    AttnRes training. fla's own autograd runs inside (its graph recorded in `forward`, run in `backward`), and the
    sources' gradients go to the slots' handles as the buffer's readers hand them (`_SourceMix`): added to `grads`
    (`_SourceGrads`, eager training) or one per source. `inputs`: the handles of the `n` slots (`_store`).
    """

    @staticmethod
    def forward(ctx, fused, buffer, grads, n, query, weight, eps, partial, *inputs):
        needs = ctx.needs_input_grad
        # `.data`: an alias of the buffer with its own version counter, so the slots written after this read (never
        # these `n`, see `_SourceScores`) do not invalidate the views fla saves.
        slots = buffer.data[:n].unbind(0)
        with torch.enable_grad():
            sources = [slot.detach().requires_grad_(need) for slot, need in zip(slots, needs[8:])]
            query_, weight_ = query.detach().requires_grad_(needs[4]), weight.detach().requires_grad_(needs[5])
            partial_ = None if partial is None else partial.detach().requires_grad_(needs[7])
            hidden = fused(query_, sources if partial_ is None else [*sources, partial_], weight_, rms_eps=eps)
        ctx.grads, ctx.graph = grads, (hidden, sources, query_, weight_, partial_)
        return hidden.detach()

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):  # grad (B, T, D)
        hidden, sources, query, weight, partial = ctx.graph
        leaves = [*sources, query, weight, partial]
        wanted = [t for t in leaves if t is not None and t.requires_grad]
        # (`retain_graph`: a later pass over the same graph, `retain_graph=True` outside, runs it again)
        found = iter(torch.autograd.grad(hidden, wanted, grad, retain_graph=True))
        got = [next(found) if t is not None and t.requires_grad else None for t in leaves]
        slot_grads = got[: len(sources)]
        grads = ctx.grads.open() if ctx.grads is not None else None
        if grads is not None:  # summed in place with the other readers' (the handles get them from there)
            for slot, slot_grad in enumerate(slot_grads):
                if slot_grad is not None:
                    grads.add_mix(slot + 1, slot_grad.unsqueeze(0), slot)
            slot_grads = [None] * len(sources)
        return None, None, None, None, got[-3], got[-2], None, got[-1], *slot_grads
