"""Kimi Linear's KDA with its kernels chosen by the tensors' device: `KimiLinearDeltaAttentionByDevice`, a subclass of
transformers' `KimiLinearDeltaAttention`.

Why: transformers 5.24 decorates its KDA functions (`chunk_kimi_delta_attention`, `recurrent_kimi_delta_attention`
of `modeling_kimi_linear`) with `use_kernel_func_from_hub_with_fallback(..., "fla")`
(`transformers/integrations/hub_kernels.py`), which picks flash-linear-attention's kernel once, at import, whenever
fla is importable, whatever the device. fla's kernels are Triton programs for GPUs, so on CPU every forward of
transformers' `KimiLinearDeltaAttention` fails (`RuntimeError: 0 active drivers ([]). There should only be one.`).

What the subclass changes: nothing for CUDA tensors (the function transformers decorated: fla's kernel where
installed, with the decorator's own keyword filtering). On other devices (where fla's path cannot run; XPU/NPU
untested) it calls the torch function the decorator wraps (`inspect.unwrap`), as the decorator calls it without fla:
with the keywords its signature names, and packed sequences (`cu_seqlens`, `seq_idx`) refused with a `ValueError`
rather than silently mixed. The choice is a plain branch on the queries' `tensor.is_cuda`, which torch.compile
traces (a guard on the device). Parameters, `__init__`, cache use and outputs are transformers'.

How, without copying or patching transformers: its `KimiLinearDeltaAttention.forward` looks the KDA functions up as
module globals at call time, so no method override can reach them. The subclass's `forward` is transformers' own
function (the same code object, closure and decorators: `force_accelerate_hooks("conv1d")`, `deprecate_kwarg`),
rebuilt by `rebound` over a namespace of our own: a copy of the module's globals, taken when this module is imported
(a global that transformers' module rebinds later is not seen), in which the two KDA names are the dispatchers
`KDA_BY_DEVICE`. transformers' module and class are left as they are, so its own `KimiLinearForCausalLM` still takes
fla's kernels on every device; `backbones_moe.dispatch_kda_by_device` gives a model's modules this class instead
(what attnres-hf does to the transformers source models it runs).

Users: the AttnRes model's Kimi Linear layers (`backbones_moe.kimi_decoder_layer`), Kimi K3's KDA
(`backbones_k3.KimiK3DeltaAttention` subclasses this class) and `backbones_moe.dispatch_kda_by_device`.

Travels with checkpoints as remote code (imported by `backbones_moe.py` when Kimi Linear is first used): imports only
transformers and the standard library. Importing it imports transformers' Kimi Linear module, which imports fla where
fla is installed; fla's warning at import on a machine without a GPU is filtered during that import only.
"""

import functools
import inspect
import types
import warnings
from collections.abc import Callable

with warnings.catch_warnings():
    # transformers' kimi_linear module imports flash-linear-attention where it is installed (to pick its KDA kernels),
    # and fla warns at import on every machine without a GPU; every other warning of it is kept.
    warnings.filterwarnings("ignore", message="Triton is not supported on current platform", category=UserWarning)
    from transformers.models.kimi_linear import modeling_kimi_linear as kimi

KDA_KERNELS: dict[str, tuple[Callable, Callable]] = {
    name: (getattr(kimi, name), inspect.unwrap(getattr(kimi, name)))
    for name in ("chunk_kimi_delta_attention", "recurrent_kimi_delta_attention")
}
"""`name -> (on CUDA, elsewhere)` for each KDA function of transformers' kimi_linear module: the function as
transformers decorated it (fla's kernel where fla is installed) and the torch function it wraps. Read by the
dispatchers at each call."""


def kda_dispatcher(name: str) -> Callable:
    """The function `KimiLinearDeltaAttentionByDevice` calls as `name` (a key of `KDA_KERNELS`): called as
    transformers' (`query, key, value` `(batch, seq_len, heads, head_dim)`, keywords `g` (same shape, log forget gate),
    `beta` `(batch, seq_len, heads)`, `initial_state`, `output_final_state`, `use_qk_l2norm_in_kernel`, ...), it
    returns what the chosen function returns (`(output (batch, seq_len, heads, head_dim), final state (batch, heads,
    head_dim, head_dim) or None)`): `KDA_KERNELS[name]`'s CUDA side, with every argument as given, where the queries
    are CUDA tensors; its torch side otherwise, with the keywords its signature names.

    Raises:
        ValueError: packed sequences (`cu_seqlens` or `seq_idx` not None) on a device other than CUDA: only fla's
            kernels keep them apart (transformers refuses them alike without fla).
    """
    accepted = tuple(inspect.signature(KDA_KERNELS[name][1]).parameters)

    @functools.wraps(KDA_KERNELS[name][0])
    def by_device(query, *args, **kwargs):
        on_cuda, elsewhere = KDA_KERNELS[name]
        if query.is_cuda:
            return on_cuda(query, *args, **kwargs)
        if kwargs.get("cu_seqlens") is not None or kwargs.get("seq_idx") is not None:
            raise ValueError(f"{name} keeps packed sequences (cu_seqlens) apart only with fla's kernels, on CUDA; "
                             f"got {query.device} tensors")
        return elsewhere(query, *args, **{key: value for key, value in kwargs.items() if key in accepted})

    return by_device


KDA_BY_DEVICE: dict[str, Callable] = {name: kda_dispatcher(name) for name in KDA_KERNELS}
"""`name -> dispatcher` (`kda_dispatcher`): what the names of transformers' KDA functions are bound to in the
namespace of `KimiLinearDeltaAttentionByDevice.forward`."""


def _holds(cell, value) -> bool:
    try:
        return cell.cell_contents is value
    except ValueError:  # an empty cell
        return False


def rebound(function: Callable, namespace: dict) -> Callable:
    """A new function running `function`'s code with its global names looked up in `namespace` (a dict), keeping its
    defaults, closure, name and attributes; `function` is left as it is.

    A decorator's wrapper (a function with `__wrapped__`, as `functools.wraps` sets it) is rebuilt around the rebound
    function it wraps: the same code, globals and closure but for the one closure cell holding the wrapped function,
    so the decorators still run (and read their own module's globals) while the innermost function reads `namespace`.

    Raises:
        TypeError: a wrapper whose closure holds the function it wraps in no cell or in several.
    """
    wrapped = getattr(function, "__wrapped__", None)
    closure = function.__closure__
    if wrapped is not None:
        holding = [i for i, cell in enumerate(closure or ()) if _holds(cell, wrapped)]
        if len(holding) != 1:
            raise TypeError(f"cannot rebuild the wrapper {function.__qualname__}: {len(holding)} closure cells hold "
                            f"the function it wraps, not one")
        inner = rebound(wrapped, namespace)
        closure = closure[:holding[0]] + (types.CellType(inner),) + closure[holding[0] + 1:]
    new = types.FunctionType(function.__code__, function.__globals__ if wrapped is not None else namespace,
                             function.__name__, function.__defaults__, closure)
    new.__kwdefaults__ = dict(function.__kwdefaults__) if function.__kwdefaults__ else None
    for attribute in ("__module__", "__qualname__", "__doc__", "__annotations__"):
        setattr(new, attribute, getattr(function, attribute))
    new.__dict__.update(function.__dict__)
    if wrapped is not None:
        new.__wrapped__ = inner
    return new


class KimiLinearDeltaAttentionByDevice(kimi.KimiLinearDeltaAttention):
    """transformers' `KimiLinearDeltaAttention` (Kimi Delta Attention: short convolutions, the gated delta rule, the
    gated output norm) whose KDA functions take fla's kernels on CUDA tensors only (`KDA_BY_DEVICE`).

    `forward(hidden_states (batch, seq_len, hidden_size), cache=None, attention_mask=None, **kwargs)` returns
    `(batch, seq_len, hidden_size)`, as transformers' does (the mask: the 2D padding mask `(batch, seq_len)`, or
    None); a cache's convolution and recurrent states are read and updated as transformers' are. It raises
    `ValueError` for packed sequences (`cu_seqlens` / `seq_idx`) on a device other than CUDA.
    """

    forward = rebound(kimi.KimiLinearDeltaAttention.forward, {**vars(kimi), **KDA_BY_DEVICE})


__all__ = ["KDA_BY_DEVICE", "KDA_KERNELS", "KimiLinearDeltaAttentionByDevice", "kda_dispatcher", "rebound"]
