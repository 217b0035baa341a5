"""The depth-state contract every depth-mixing method follows, and the record that describes a method.

A method is one `DepthMixingMethod` record (see `depth_mixing.py` for the table of records). The decoder drives its
*state*, an immutable `NamedTuple` of tensors (so that a gradient-checkpointed layer can replay it), through five
hooks with one return shape each:

    read  = state.read_attn(mixing)            -> DepthRead(state, hidden, key_value, depth_weights)
    write = read.state.write_attn(mixing, out) -> DepthWrite(state, depth_weights)
    read  = write.state.read_mlp(mixing)       -> DepthRead(...)           (key_value is None)
    write = read.state.write_mlp(mixing, out)  -> DepthWrite(...)
    final = state.read_final(final_mixing)     -> DepthRead(...)           (the input of the final norm)

`mixing` is the method's own `NamedTuple` of modules for this layer (`final_mixing`: for the model), built once by
`record.layer_modules.build(config, layer_idx)` / `record.final_modules.build(config)`; its field names are the
attribute names, hence the parameter-name prefixes `model.layers.N.<field>.` and `model.<field>.`.

`ResidualState` is the contract at its simplest: the standard residual stream (`depth_mixing="residual"`), the
baseline.

Sub-layers: attention and MLP each count as one (a "layer" in the AttnRes paper); `num_hidden_layers = L` gives
`2 L`. All mixing weights, norms, softmax and sigmoid run in fp32; outputs are cast back to the stream's dtype.

Travels with checkpoints as remote code: imports only torch and transformers (and, when a read is rebuilt in
backward, its sibling `torch_internals.py`).
"""

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

import torch
from torch import nn



class DepthRead(NamedTuple):
    """What a read hook returns.

    - `state`: the state after the read (AttnRes closes a block here; mHC keeps its pending mappings).
    - `hidden`: the sub-layer input, `(batch, seq_len, hidden_size)` in the stream's dtype (for the attention: the
      input of `q_proj` and of the layer's own residual; for `read_final`: the input of the final norm).
    - `key_value`: separate inputs of `k_proj` and `v_proj` (MUDDFormer, DCA), each `(batch, seq_len, hidden_size)`,
      or `None` when `hidden` feeds all three projections (and always for the MLP and the final read).
    - `depth_weights`: the weights the read computed, fp32 (empty when it computed none); see the record's
      `depth_weights` text for their shape.
    - `recompute`: `None`, or a function of no arguments that rebuilds `hidden` (the same shape, strides and dtype;
      the same values up to rounding) from what backward keeps anyway: then the sub-layer's norm, called through
      `normed`, does not keep `hidden` for backward (AttnRes's Block training: Kimi K3's recipe, the reads recomputed
      in backward, so the depth mixing keeps a residual's memory).

    `hidden` and `key_value` are contiguous (row-major), as a residual stream is: some kernels of the projections
    they feed read them so whatever their strides (bitsandbytes' AVX-512 BF16 4-bit CPU kernel).
    """

    state: "DepthState"
    hidden: torch.Tensor
    key_value: tuple[torch.Tensor, torch.Tensor] | None = None
    depth_weights: tuple[torch.Tensor, ...] = ()
    recompute: Callable[[], torch.Tensor] | None = None

    def normed(self, norm: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """`norm(self.hidden)`. With `recompute` (eager, gradients on, and no other saved-tensor hooks active: those
        of torch's non-reentrant checkpoint, which keeps none of it anyway, or of activation offloading must see
        what `norm` saves), what `norm` saves for backward that is
        `hidden` itself (same data, shape, strides and dtype: an RMSNorm saves its input) is saved as a token
        instead, and backward rebuilds it with `recompute()` when it unpacks it (autograd's saved-tensor hooks, the
        mechanism of torch's non-reentrant checkpoint); what else `norm` saves is kept as usual. A norm that saves
        `hidden` several times (an RMSNorm: for `x^2` and for `x / rms`) gets one rebuild per backward pass, kept
        until the last of them is unpacked."""
        hidden, recompute = self.hidden, self.recompute
        if recompute is None or not torch.is_grad_enabled() or torch.compiler.is_compiling():
            return norm(hidden)  # (inference: before the import below, which costs a microsecond a read)
        from .torch_internals import saved_tensors_hooks_active  # (here: a configuration imports this module)

        if saved_tensors_hooks_active():
            return norm(hidden)
        # (the key is plain numbers: the hooks live as long as the saved tensors, and must not keep `hidden` alive)
        key = (hidden.data_ptr(), hidden.shape, hidden.stride(), hidden.dtype)
        tokens = []  # one per save of `hidden`
        rebuilt = []  # [tensor, unpacks left] during a backward pass

        def pack(tensor: torch.Tensor):
            if (tensor.data_ptr(), tensor.shape, tensor.stride(), tensor.dtype) != key:
                return tensor
            tokens.append(_REBUILT)
            return _REBUILT

        def unpack(packed):
            if packed is not _REBUILT:
                return packed
            if not rebuilt:
                rebuilt[:] = [recompute(), len(tokens)]
            tensor, rebuilt[1] = rebuilt[0], rebuilt[1] - 1
            if not rebuilt[1]:
                rebuilt.clear()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            return norm(hidden)


_REBUILT = object()
"""The token `DepthRead.normed` saves in place of the read's `hidden`."""


class DepthWrite(NamedTuple):
    """What a write hook returns: the state after the sub-layer output `(batch, seq_len, hidden_size)` joined the
    depth stream, and the depth weights the write computed (fp32; empty when none)."""

    state: "DepthState"
    depth_weights: tuple[torch.Tensor, ...] = ()


class DepthState(Protocol):
    """The typed contract of a depth state (an immutable `NamedTuple`; every hook returns a new one)."""

    @classmethod
    def start(cls, embeddings: torch.Tensor, config, keep_weights: bool = False, model=None) -> "DepthState":
        """The state before the first sub-layer, from the token embeddings `(batch, seq_len, hidden_size)`;
        `keep_weights`: whether depth weights that cost memory or time (DCA's per-feature weights, AttnRes's merged
        two-phase weights) are returned; `model`: the `AttnResModel` running this forward, for a state that reads
        modules of later layers ahead of time (AttnRes's two-phase block inference reads the routers' queries when
        it starts, unless hooks manage their weights); a method that does not need it ignores it.
        The state keeps no module: it is a decoder layer's input, which accelerate's device hooks move (`.to` on
        whatever has one), and a module's weights may be there only during its own forward (offload)."""

    def read_attn(self, mixing) -> DepthRead:
        """The inputs of the attention sub-layer of the layer whose mixing modules are `mixing`."""

    def write_attn(self, mixing, output: torch.Tensor) -> DepthWrite:
        """Add the attention output `(batch, seq_len, hidden_size)` to the depth stream."""

    def read_mlp(self, mixing) -> DepthRead:
        """The input of the MLP sub-layer."""

    def write_mlp(self, mixing, output: torch.Tensor) -> DepthWrite:
        """Add the MLP output to the depth stream (DenseFormer, MUDDFormer mix the layer outputs here)."""

    def read_final(self, mixing) -> DepthRead:
        """The input of the final norm, from the model-level mixing modules `mixing`."""


def routed_sublayers(state_cls: type) -> type:
    """Class decorator: the sub-layer hooks of a depth state whose sub-layer inputs are its routers' reads,
    `state._route(router)` with the layer's `attn_res` / `mlp_res`, and whose writes are `state._add(output)`
    (AttnRes's and Delta AttnRes's states: one home for the four hooks; a `NamedTuple` cannot take a mixin)."""

    def read_attn(self, mixing) -> DepthRead:
        return self._route(mixing.attn_res)

    def write_attn(self, mixing, output: torch.Tensor) -> DepthWrite:
        return self._add(output)

    def read_mlp(self, mixing) -> DepthRead:
        return self._route(mixing.mlp_res)

    def write_mlp(self, mixing, output: torch.Tensor) -> DepthWrite:
        return self._add(output)

    for hook in (read_attn, write_attn, read_mlp, write_mlp):
        hook.__qualname__ = f"{state_cls.__qualname__}.{hook.__name__}"
        hook.__doc__ = getattr(DepthState, hook.__name__).__doc__
        setattr(state_cls, hook.__name__, hook)
    return state_cls


class NoModules(NamedTuple):
    """The mixing modules of a method that adds none (at this level)."""

    @classmethod
    def build(cls, config, *args) -> "NoModules":
        return cls()


@dataclass(frozen=True)
class RoutingMap:
    """How one depth-weight tensor of `output_depth_weights` reads as rows of weights over a common source axis.

    - `module`: the path of the module that computed it, e.g. `model.layers.0.attn_res`.
    - `rows`: a label per row, e.g. `["L0 attn"]`, `["L0 attn h0", "L0 attn h1"]` (per head), `["L0 mudd q", ...]`.
    - `columns`: the columns of the common source axis (`DepthMixingMethod.source_names`) that its last axis reads,
      in order (a window keeps the embedding and the most recent ones).
    - `partial`: whether the last column is a partial block sum (Block AttnRes).
    """

    module: str
    rows: list[str]
    columns: list[int]
    partial: bool = False


@dataclass(frozen=True)
class DepthMixingMethod:
    """Everything about one `depth_mixing` value; the table `DEPTH_MIXING` is the only list of methods.

    - `name`: the `AttnResConfig.depth_mixing` value; `title`: its paper; `card`: its model-card line.
    - `state`: the `DepthState` class the decoder drives.
    - `layer_modules`, `final_modules`: `NamedTuple` classes with a `build(config, layer_idx)` / `build(config)`
      classmethod; their fields are the module attribute names (`model.layers.N.<field>`, `model.<field>`), which
      are the parameter-name prefixes of the method.
    - `module_classes`: the classes of those modules (each has `reset_parameters()`, its residual-model init).
    - `no_weight_decay`: parameter names inside the modules kept out of weight decay: those whose initial value
      encodes the residual path, and every bias, gate, scale or norm weight of a mixing module.
    - `config_fields`: the config fields only this method reads (set for another method: an error).
    - `depth_weights`: what `output_depth_weights=True` returns (shapes, order).
    - `routing_maps(config)`: one `RoutingMap` per returned depth-weight tensor, in order; `source_names(config)`:
      the common source axis; `source_norms(module_input)`: the L2 norm of each source of a mixing module's first
      input, `(batch, seq_len, n)` on that axis; `to_rows(weights)`: `(batch, seq_len, *)` -> `(batch, seq_len,
      rows, n)`; `distribution(config)`: whether each row sums to 1 (softmax, Sinkhorn).
    """

    name: str
    title: str
    card: str
    state: type
    layer_modules: type = NoModules
    final_modules: type = NoModules
    module_classes: tuple[type, ...] = ()
    no_weight_decay: tuple[str, ...] = ()
    config_fields: tuple[str, ...] = ()
    depth_weights: str = "none"
    routing_maps: Callable | None = None
    source_names: Callable | None = None
    source_norms: Callable | None = None
    to_rows: Callable = field(default=lambda weights: weights.unsqueeze(-2))
    distribution: Callable = field(default=lambda config: False)

    @property
    def module_names(self) -> tuple[str, ...]:
        """Attribute names of the method's mixing modules (layer-level, then model-level)."""
        return (*self.layer_modules._fields, *self.final_modules._fields)


_PAPER_ROUTER = {"depth_mixing": "attnres", "attnres_score_fn": "softmax", "attnres_query": "static",
                 "attnres_num_heads": 1, "attnres_window": None, "attnres_scalar_weights": False}

IMPLEMENTATION_NEEDS: dict[str, tuple[dict, str]] = {
    "fla": ({**_PAPER_ROUTER, "attnres_key_norm": True},
            "fla's fused_attnres is the paper's softmax router with a key norm and one static query"),
    "triton": (_PAPER_ROUTER, "the kernels compute the paper's softmax router with one static query"),
    "naive": ({key: value for key, value in _PAPER_ROUTER.items() if key != "attnres_score_fn"},
              "the reference reads the paper's router with one static query, softmax or sigmoid scores"),
}
"""`attnres_implementation` -> (the config values it computes, what it computes) for the implementations that
compute only some configs: fla's `fused_attnres` (`attnres_fla.py`: `softmax_i(w . RMSNorm(v_i))` with one static
query) and the Triton kernels (`attnres_triton.py`: a softmax over the sources of one static pseudo-query per router,
with or without the key norm), and the reference (`ops_naive.attnres`: softmax or sigmoid scores of one static
pseudo-query, with or without the key norm). `"torch"` computes every config."""


def check_implementation(config, implementation: str) -> None:
    """Raise `ValueError` naming the first field of `config` that `attnres_implementation=implementation` cannot
    compute (`IMPLEMENTATION_NEEDS`); nothing for an implementation that computes every config (`"torch"`)."""
    needs, computes = IMPLEMENTATION_NEEDS.get(implementation, ({}, ""))
    for name, needed in needs.items():
        value = getattr(config, name)
        if value != needed:
            raise ValueError(f"attnres_implementation={implementation!r} needs {name}={needed!r} ({computes}), got "
                             f"{name}={value!r}; use attnres_implementation='torch'")


def autocast_off(device_type: Callable[..., str]):
    """A method decorator: run it with `torch.autocast` off on the device `device_type(*args)` names, so that
    arithmetic specified in fp32 (AttnRes's router scores, Eq. 2-3) stays fp32 under mixed precision (`Trainer(bf16=
    True)` on fp32 weights); no cost where autocast is off."""
    def decorate(method):
        @functools.wraps(method)
        def run(*args):
            device = device_type(*args)
            if device != "meta" and torch.is_autocast_enabled(device):  # (meta: no autocast of its own)
                with torch.autocast(device, enabled=False):
                    return method(*args)
            return method(*args)
        return run
    return decorate


def register_modules(owner: nn.Module, modules: NamedTuple) -> None:
    """Register each module of `modules` on `owner` under its field name (`None`: an empty slot)."""
    for name, module in zip(modules._fields, modules):
        owner.add_module(name, module)


def registered_modules(owner: nn.Module, modules_type: type):
    """The `modules_type` tuple of the modules registered on `owner` (after PEFT may have wrapped them). `owner` may
    be wrapped too: torch's `checkpoint_wrapper` (accelerate's FSDP activation checkpointing) hands attribute reads
    to the layer it wraps, which holds the modules."""
    try:  # (the modules' dictionary: no `nn.Module.__getattr__` call per field; every decoder layer, every forward)
        return modules_type._make(map(owner._modules.__getitem__, modules_type._fields))
    except KeyError:  # (a wrapper, which holds them on the module it wraps)
        return modules_type(*(getattr(owner, name) for name in modules_type._fields))


def wrapped_modules(owners, modules_type: type) -> tuple[nn.Module, ...]:
    """For each of `owners` that is a wrapper (torch's `checkpoint_wrapper`, `offload_wrapper`: the modules of
    `modules_type` are registered on a module it wraps, see `registered_modules`), the modules it wraps, down to and
    including the one that registers them: their hooks run in the owner's forward too (`_query_bank` checks them).
    `()` when every owner registers its modules itself (one dictionary look-up each)."""
    field, found = modules_type._fields[0], []
    for owner in owners:
        if field in owner._modules:
            continue
        name = next((name for name, module in owner.named_modules() if field in module._modules), "")
        module = owner
        for part in name.split(".") if name else ():
            module = module._modules[part]
            found.append(module)
    return tuple(found)


class AttnResRMSNorm(nn.Module):
    """RMSNorm over the last axis, computed in fp32 (Llama's `LlamaRMSNorm`)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor, normalize: bool = True) -> torch.Tensor:
        """`weight * (x / RMS(x))` over the last axis of `x (..., hidden_size)`: normalised in fp32 and cast back to
        `x`'s dtype before the weight multiplies it (Llama's order).

        `normalize=False`: `weight * x` in fp32, the weight folded into a vector (AttnRes's key norm into its
        pseudo-query, `RMSNorm(v) . w = (v / RMS(v)) . (g * w)`). The weight is read here, in this module's forward,
        so that hooks that bring it in for the forward (accelerate's offload, which loads each module's own
        weights for its forward only) see the read.
        """
        if not normalize:
            weight = self.weight
            return (hidden_states if hidden_states.dtype == torch.float32 else hidden_states.float()) * (
                weight if weight.dtype == torch.float32 else weight.float())
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)

    def extra_repr(self):
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"


def inverse_rms(x: torch.Tensor, eps: float | torch.Tensor) -> torch.Tensor:
    """`1 / RMS(x)` over the last axis in fp32: `(..., d) -> (...)`, `rsqrt(mean(x^2) + eps)`.

    `eps` is a float, or a 0-dim fp32 tensor holding it: then `eps + mean(x^2)` is one operation (`x . x` times
    `1/d`, added to `eps`) instead of three; a decoded token runs a hundred of these on `(1, 1, d)` inputs, where each
    operation, and the wrapping of a Python scalar into a tensor, costs microseconds (AttnRes's two-phase merge).
    `x . x` is a product and a sum, not `linalg.vecdot`, which autocast computes in its lower precision.
    """
    x = x if x.dtype == torch.float32 else x.float()
    if isinstance(eps, torch.Tensor):
        return torch.rsqrt(torch.add(eps, (x * x).sum(-1), alpha=1 / x.shape[-1]))
    return torch.rsqrt(x.pow(2).mean(-1) + eps)


def rms_normed(x: torch.Tensor, eps: float) -> torch.Tensor:
    """`x / RMS(x)` in fp32, without a learned scale."""
    return x.float() * inverse_rms(x, eps).unsqueeze(-1)


def stacked_norms(sources) -> torch.Tensor:
    """L2 norm per token of each tensor of `sources` (`(batch, seq_len, hidden_size)` each) -> `(batch, seq_len, n)`;
    a tensor `(batch, seq_len, n, hidden_size)` (mHC streams) gives the same."""
    if isinstance(sources, torch.Tensor):
        return sources.float().norm(dim=-1)
    return torch.stack([s.float().norm(dim=-1) for s in sources], dim=-1)


def sublayer_name(index: int) -> str:
    """`0.attn`, `0.mlp`, `1.attn`, ...: sub-layer `2 i` is the attention of layer `i`, `2 i + 1` its MLP."""
    return f"{index // 2}.{'attn' if index % 2 == 0 else 'mlp'}"


class ResidualState(NamedTuple):
    """Standard residual stream (`depth_mixing="residual"`): `h_{l+1} = h_l + f_l(Norm(h_l))`. No modules."""

    hidden: torch.Tensor  # (B, T, D)

    @classmethod
    def start(cls, embeddings: torch.Tensor, config, keep_weights: bool = False, model=None) -> "ResidualState":
        return cls(embeddings)

    def read_attn(self, mixing) -> DepthRead:
        return DepthRead(self, self.hidden)

    def write_attn(self, mixing, output: torch.Tensor) -> DepthWrite:
        return DepthWrite(ResidualState(self.hidden + output))

    def read_mlp(self, mixing) -> DepthRead:
        return DepthRead(self, self.hidden)

    def write_mlp(self, mixing, output: torch.Tensor) -> DepthWrite:
        return DepthWrite(ResidualState(self.hidden + output))

    def read_final(self, mixing) -> DepthRead:
        return DepthRead(self, self.hidden)
