"""The implementations of the AttnRes read (arXiv:2603.15031, Eq. 1-4 over the sources of Eq. 6), one signature
(`ops_naive.attnres`'s: tensors in, the output and the depth weights out), chosen by `attnres_implementation` and
the device: the router holds the parameters and makes one call (`AttnResRouter`), and the tests compare the
implementations with each other directly (tests/test_ops.py).

Travels with checkpoints as remote code (a relative import of `mixing_attnres.py`): imports only torch and its
siblings `attnres_fla.py`, `attnres_triton.py` and `ops_*.py`; Triton and fla load on first use.
"""

from collections.abc import Callable

import torch

from .attnres_fla import check_device as fla_check_device
from .attnres_triton import check_device as triton_check_device
from .ops_fla import attnres as fla_attnres
from .ops_naive import attnres as naive_attnres
from .ops_torch import attnres as torch_attnres
from .ops_triton import attnres as triton_attnres

IMPLEMENTATIONS: dict[str, Callable] = {
    "naive": naive_attnres,  # the reference: plain, stacked, float64-friendly
    "torch": torch_attnres,  # one pass (`ops_torch.two_phase`: Algorithm 1 for one router)
    "triton": triton_attnres,  # the fused kernels: CUDA, or CPU under Triton's interpreter
    "fla": fla_attnres,  # fla's fused_attnres: CUDA only
}
"""`attnres_implementation` -> the read, each with `ops_naive.attnres`'s signature."""


def get(implementation: str, device: torch.device | str) -> Callable:
    """The read of `implementation` for tensors on `device`.

    Meta tensors (shapes only) take the torch implementation where the kernels were asked for.

    Raises:
        KeyError: on an implementation not in `IMPLEMENTATIONS`.
        ValueError: on one that cannot run on `device` ("triton": CUDA, or any device under Triton's interpreter;
            "fla": CUDA).
        ImportError: "triton" off CUDA where Triton is not installed (elsewhere the read raises it when it first
            runs a kernel, as "fla"'s does where fla is not installed).
    """
    if implementation not in IMPLEMENTATIONS:
        raise KeyError(f"no AttnRes implementation {implementation!r}; known: {', '.join(IMPLEMENTATIONS)}")
    device = torch.device(device)
    if device.type == "meta" and implementation in ("triton", "fla"):
        return torch_attnres
    if implementation == "fla":
        fla_check_device(device)
    elif implementation == "triton":
        triton_check_device(device)
    return IMPLEMENTATIONS[implementation]
