"""The private torch names the modeling code uses, in one place, each with the public fallback taken when the name is
missing (another torch version) or cannot serve (tracing, `torch.func` transforms, compiled autograd).

- `current_graph_task_id` and `queue_callback` name the running backward pass and run a callback when it ends: the
  source buffer's in-place gradient sums (`attnres_buffer._SourceGrads`) belong to one pass. Fallback: autograd's own
  per-source sums (the readers return one gradient per source), the path tracing takes; the same gradients.
- `global_forward_pre_hooks`, torch's table of forward pre-hooks registered for every module: while it is empty,
  phase 1 may read the routers' weights outside their forwards (`attnres_two_phase._query_bank`). Fallback: assume
  hooks, so every router reads its own weights in its own forward (the direct path, the same numbers).
- `are_functorch_transforms_active`: whether a `torch.func` transform (`grad`, `vmap`, `jvp`, ...) runs, under which
  the depth state keeps its sources stacked and read by plain torch operations (the source buffer is written in place
  and read by custom autograd Functions, which those transforms do not take). Fallback: `torch.func.debug_unwrap`
  tells whether a given tensor is one of the transforms' wrappers.

Set any of the four to `None` to take its fallback (the tests do).

Travels with checkpoints as remote code (a relative import of `attnres_buffer.py`): imports only torch.
"""

from collections.abc import Callable

import torch
import torch.nn.modules.module

current_graph_task_id: Callable[[], int] | None = getattr(torch._C, "_current_graph_task_id", None)
queue_callback: Callable[[Callable[[], None]], None] | None = getattr(
    getattr(torch.autograd.Variable, "_execution_engine", None), "queue_callback", None)
global_forward_pre_hooks: dict | None = getattr(torch.nn.modules.module, "_global_forward_pre_hooks", None)
are_functorch_transforms_active: Callable[[], bool] | None = getattr(torch._C, "_are_functorch_transforms_active",
                                                                     None)


def graph_tasks_known() -> bool:
    """Whether this torch names its backward passes and runs callbacks when they end (both private names exist)."""
    return current_graph_task_id is not None and queue_callback is not None


def graph_task() -> int | None:
    """The id of the running backward pass, or `None` where there is none to use: a private name missing, or the
    backward traced (compiled autograd: dynamo traces each custom Function's backward, and there a pass's callbacks
    need `fullgraph=True`)."""
    if current_graph_task_id is None or queue_callback is None or torch.compiler.is_compiling():
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


def functorch_active(tensor: torch.Tensor) -> bool:
    """Whether a `torch.func` transform is running; where this torch does not say, whether `tensor` is one of the
    transforms' wrapped tensors (a transform over parameters wraps whatever they compute)."""
    if are_functorch_transforms_active is not None:
        return are_functorch_transforms_active()
    return torch.func.debug_unwrap(tensor, recurse=False) is not tensor  # (public since torch 2.1)
