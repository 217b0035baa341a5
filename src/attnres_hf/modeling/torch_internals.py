"""The private torch names the modeling code uses, in one place, each with the public fallback taken when the name is
missing (another torch version) or cannot serve (tracing, `torch.func` transforms, compiled autograd).

- `current_graph_task_id` and `queue_callback` name the running backward pass and run a callback when it ends: the
  source buffer's in-place gradient sums (`attnres_buffer._SourceGrads`) belong to one pass. Fallback: autograd's own
  per-source sums (the readers return one gradient per source), the path tracing takes; the same gradients. The same
  fallback serves a backward pass that compiled autograd runs (`torch._dynamo.compiled_autograd`'s
  `in_compiled_autograd_region`; where that module is loaded without the name, every pass is assumed to be one).
- `global_forward_pre_hooks`, torch's table of forward pre-hooks registered for every module, and a module's own
  (`nn.Module._forward_pre_hooks`): while both are empty, phase 1 may read the routers' weights outside their
  forwards (`attnres_two_phase._query_bank`). Fallback: assume hooks, so every router reads its own weights in its
  own forward (the direct path, the same numbers).
- `are_functorch_transforms_active`: whether a `torch.func` transform (`grad`, `vmap`, `jvp`, ...) runs, under which
  the depth state keeps its sources stacked and read by plain torch operations (the source buffer is written in place
  and read by custom autograd Functions, which those transforms do not take). Fallback: `torch.func.debug_unwrap`
  tells whether a given tensor is one of the transforms' wrappers.
- `_top_saved_tensors_default_hooks`: the innermost saved-tensor hooks active (torch's non-reentrant checkpoint,
  activation offloading, a user's), which the reads' own hooks must not shadow (`mixing_base.DepthRead.normed`).
  Fallback: assume some are active, so the reads' outputs are kept for backward, not rebuilt (the same numbers).
- `Tensor._version`, the count of a tensor's in-place writes (autograd's check that a saved tensor is unchanged):
  whether a partial block sum is still the one the Triton kernels' fused add and merge read
  (`attnres_triton.add`). Fallback (the name missing, or an inference tensor, which counts nothing): unknown, and the
  next router computes its merge itself (the same numbers).
- `torch._dynamo.config`, whose recompile limit `compile_repeated_blocks` raises while a decoder layer runs (looked
  up when asked: importing dynamo takes a second). Fallback: the limit left as it is.

Set any of the module-level names to `None` to take its fallback (the tests do).

Travels with checkpoints as remote code (relative imports of `attnres_buffer.py`, `attnres_triton.py`,
`attnres_two_phase.py`, `mixing_attnres.py`, `mixing_base.py` and `modeling_attnres.py`): imports only torch.
"""

import contextlib
import sys
from collections.abc import Callable

import torch
import torch.nn.modules.module

current_graph_task_id: Callable[[], int] | None = getattr(torch._C, "_current_graph_task_id", None)
queue_callback: Callable[[Callable[[], None]], None] | None = getattr(
    getattr(torch.autograd.Variable, "_execution_engine", None), "queue_callback", None)
global_forward_pre_hooks: dict | None = getattr(torch.nn.modules.module, "_global_forward_pre_hooks", None)
are_functorch_transforms_active: Callable[[], bool] | None = getattr(torch._C, "_are_functorch_transforms_active",
                                                                     None)
top_saved_tensors_hooks: Callable[[bool], tuple | None] | None = getattr(
    getattr(torch._C, "_autograd", None), "_top_saved_tensors_default_hooks", None)


def graph_tasks_known() -> bool:
    """Whether this torch names its backward passes and runs callbacks when they end (both private names exist)."""
    return current_graph_task_id is not None and queue_callback is not None


def graph_task() -> int | None:
    """The id of the running backward pass, or `None` where there is none to use: a private name missing, or the
    pass run by compiled autograd (its graph sums each input's gradients itself, and its passes take callbacks only
    with `fullgraph=True`), traced or not."""
    if current_graph_task_id is None or queue_callback is None or torch.compiler.is_compiling():
        return None
    compiled_autograd = sys.modules.get("torch._dynamo.compiled_autograd")  # (not loaded: not running)
    if compiled_autograd is not None and getattr(compiled_autograd, "in_compiled_autograd_region", True):
        return None
    task = current_graph_task_id()
    return None if task < 0 else task  # (-1: no backward pass running)


def at_graph_task_end(callback: Callable[[], None]) -> None:
    """Run `callback` when the running backward pass ends (`graph_task` gave its id)."""
    queue_callback(callback)


def global_pre_hooks() -> bool:
    """Whether forward pre-hooks are registered for every module (`register_module_forward_pre_hook`); `True` where
    this torch's table of them is unknown."""
    return global_forward_pre_hooks is None or bool(global_forward_pre_hooks)


def saved_tensors_hooks_active() -> bool:
    """Whether saved-tensor hooks are active (`torch.autograd.graph.saved_tensors_hooks`: torch's non-reentrant
    checkpoint, activation offloading, a user's); `True` where this torch does not say."""
    return top_saved_tensors_hooks is None or top_saved_tensors_hooks(False) is not None


def forwards_plain(modules) -> bool:
    """Whether none of `modules` has forward pre-hooks of its own (`register_forward_pre_hook`; assumed where this
    torch does not say) or a replaced `forward` (an instance attribute: accelerate's hooks): one loop, no call per
    module (a forward checks about 150 of them)."""
    for module in modules:
        if getattr(module, "_forward_pre_hooks", True) or "forward" in module.__dict__:
            return False
    return True


def tensor_version(tensor: torch.Tensor) -> int | None:
    """How many in-place writes `tensor` has had (`Tensor._version`), or `None` where that is unknown: the name
    missing, or an inference tensor (made under `torch.inference_mode`, which keeps no count)."""
    try:
        return getattr(tensor, "_version", None)
    except RuntimeError:  # ("Inference tensors do not track version counter")
        return None


def recompile_limit_at_least(limit: int) -> contextlib.AbstractContextManager:
    """A context in which dynamo's recompile limit is at least `limit` (`recompile_limit`, `cache_size_limit`
    before torch 2.7); a null context where this torch's dynamo names neither."""
    config = getattr(getattr(torch, "_dynamo", None), "config", None)
    name = next((n for n in ("recompile_limit", "cache_size_limit") if hasattr(config, n)), None)
    if name is None or not hasattr(config, "patch"):
        return contextlib.nullcontext()
    return config.patch(**{name: max(getattr(config, name), limit)})


def functorch_active(tensor: torch.Tensor) -> bool:
    """Whether a `torch.func` transform is running; where this torch does not say, whether `tensor` is one of the
    transforms' wrapped tensors (a transform over parameters wraps whatever they compute)."""
    if are_functorch_transforms_active is not None:
        return are_functorch_transforms_active()
    return torch.func.debug_unwrap(tensor, recurse=False) is not tensor  # (public since torch 2.1)
