"""AttnRes configuration: a backbone family's own config (`backbone`) plus the depth-mixing fields.

`AttnResConfig.backbone` is the source family's own config (`LlamaConfig`, `Qwen3Config`, `Gemma2Config`, ...; the
families are the records of `backbones.BACKBONES`), a sub-config as in transformers' composite configs
(`sub_configs_defaults`); it is saved nested under `"backbone"` and read back with the family's class. Its fields are
read through the AttnRes config (`config.hidden_size` is `config.backbone.hidden_size`; assignments go to the
backbone too), so code written for a flat Llama-style config keeps working. New fields are prefixed
(`depth_mixing`, `attnres_*`, ...).

Flat configs (the backbone's fields at the top level, as AttnRes configs were saved before backbones) still load:
they become a `llama` backbone, or `qwen3` (`use_qk_norm`), `qwen2` (q/k/v bias without `o_proj` bias) or `mistral`
(a sliding window on every layer) as their fields say; `backbone="gemma2"` (a model type) with flat fields builds
that family's config from them.

Travels with checkpoints as remote code (`auto_map`): imports only `transformers` and its siblings.
"""

import contextlib
import functools
import math
import re
from typing import Literal

from huggingface_hub.dataclasses import strict
from huggingface_hub.errors import StrictDataclassError

from transformers.activations import ACT2FN
from transformers.configuration_utils import PreTrainedConfig, SubConfigSpec
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.auto.configuration_auto import AutoConfig
from transformers.utils.type_validators import interval

from .backbones import BACKBONES, DEFAULT_BACKBONE, KEY_VALUE_METHODS, backbone_record
from .backbones_moe import EXPERT_ROUTING
from .depth_mixing import DEPTH_MIXING
from .mixing_base import check_implementation


DEPTH_MIXING_METHODS = tuple(DEPTH_MIXING)
"""Values accepted by `AttnResConfig.depth_mixing`, read from the method records (`depth_mixing.DEPTH_MIXING`)."""


def default_attnres_block_size(num_hidden_layers: int, num_blocks: int = 8) -> int:
    """Sub-layers per block that give about `num_blocks` blocks (the paper: ~8 blocks recover most of the gain).

    A model with `num_hidden_layers = L` has `2 L` sub-layers (attention and MLP each count). The result is even,
    so blocks start at an attention sub-layer, and at least 2.
    """
    return max(2, 2 * round(num_hidden_layers / num_blocks))


@contextlib.contextmanager
def _one_line_value_errors():
    """Re-raise `@strict`'s validation errors as one-line `ValueError`s naming the field and the rule (the type users
    and the tests rely on), e.g. `attnres_num_heads must be greater or equal to 1, got 0.`"""
    try:
        yield
    except StrictDataclassError as error:
        cause = error.__cause__ if error.__cause__ is not None else error
        field = re.match(r"Validation error for field '(\w+)'", str(error))
        message = str(cause)
        union = re.match(r"Field '(\w+)' with value (.*) doesn't match any type in \((.*)\)\. Errors:", message, re.S)
        if union is not None:  # "Field 'x' with value v doesn't match any type in (<class 'int'>, ...). Errors: ..."
            types = re.sub(r"<class '(?:[\w.]+\.)?(\w+)'>", r"\1", union.group(3)).replace("NoneType", "None")
            message = f"{union.group(1)} must be one of the types ({types}), got {union.group(2)}"
        elif field is not None:  # "Value must be ..." / "Field 'x' expected ..." -> "x must be ..." / "x expected ..."
            message = re.sub(r"^(Value|Field '\w+')( expected)?", rf"{field.group(1)} must be", message)
            message = message.replace("must be must be", "must be")
        raise ValueError(" ".join(message.split())) from None


@strict
class _AttnResConfigFields(PreTrainedConfig):
    """`AttnResConfig`'s fields, checked by `@strict`, and its rules (documented there)."""

    model_type = "attnres"
    keys_to_ignore_at_inference = ["cache"]
    sub_configs_defaults = {"backbone": SubConfigSpec(config_class=AutoConfig, model_type=DEFAULT_BACKBONE)}

    # Field types, choices (`Literal`) and ranges (`interval`) are checked by huggingface_hub's `@strict`, as for
    # `LlamaConfig` (the backbone's by its own class); rules across fields are in `validate_architecture`.
    backbone: dict | PreTrainedConfig | str | None = None
    depth_mixing: Literal[DEPTH_MIXING_METHODS] = "attnres"
    attnres_block_size: int | None = None
    attnres_rescale_output: bool = False
    attnres_score_fn: Literal["softmax", "sigmoid"] = "softmax"
    attnres_key_norm: bool = True
    attnres_window: int | None = None
    attnres_query: Literal["static", "input_dependent"] = "static"
    attnres_num_heads: int = interval(min=1)(default=1)
    attnres_scalar_weights: bool = False
    attnres_implementation: Literal["torch", "fla", "triton", "naive"] = "torch"  # checked when set (`__setattr__`)
    denseformer_dilation: int = interval(min=1)(default=1)
    denseformer_period: int = interval(min=1)(default=1)
    mhc_num_streams: int = interval(min=2)(default=4)  # one stream cannot hold a doubly-stochastic mix of anything
    mhc_sinkhorn_iterations: int = interval(min=1)(default=20)

    def __post_init__(self, **kwargs):
        self.backbone, kwargs = _build_backbone(self.backbone, kwargs)
        if self.attnres_block_size is None:
            self.attnres_block_size = default_attnres_block_size(self.num_hidden_layers)
        self.validate_architecture()
        super().__post_init__(**kwargs)

    @property
    def base_model_tp_plan(self) -> dict | None:
        """The backbone family's tensor-parallel plan (its parameter names are the family's)."""
        return type(self.backbone).base_model_tp_plan

    def __getattr__(self, name: str):
        # AttnRes: the backbone's fields read through the AttnRes config (`config.hidden_size`), so everything that
        # reads a decoder config (caches, masks, generation, the depth-mixing modules) sees the family's values.
        backbone = self.__dict__.get("backbone")
        if name.startswith("__") or name == "backbone" or not isinstance(backbone, PreTrainedConfig):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        try:
            return getattr(backbone, name)
        except AttributeError:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}") from None

    def __setattr__(self, name, value):
        # (wrapped by `@strict`, which validates AttnRes's own fields first.) A backbone field goes to the backbone,
        # validated by the family's own `@strict`.
        if self._forwards_to_backbone(name):
            setattr(self.backbone, name, value)
            return
        if name == "attnres_implementation":  # (also in `__init__`: the fields it checks are set before it)
            check_implementation(self, value)
        super().__setattr__(name, value)

    def _forwards_to_backbone(self, name: str) -> bool:
        """Whether an assignment to `name` belongs to the backbone: a field the backbone has and AttnRes does not."""
        backbone = self.__dict__.get("backbone")
        return (isinstance(backbone, PreTrainedConfig) and name not in self.__dataclass_fields__
                and not name.startswith("_") and name in _backbone_fields(backbone))

    def validate_architecture(self):
        """Check the rules of the architecture; raises `ValueError` naming the rule that is broken."""
        self._validate_depth_knobs()
        size = self.attnres_block_size
        if size < 1 or (size != 1 and size % 2):
            raise ValueError(
                "attnres_block_size must be 1 (Full AttnRes) or a positive even number of sub-layers "
                f"(so every block starts at an attention sub-layer), got {size!r}"
            )
        adapter = backbone_record(self)  # as declared: a config imports no family modeling code
        adapter.check_config(self.backbone)
        if self.depth_mixing in KEY_VALUE_METHODS and adapter.key_value_inputs is None:
            raise ValueError(
                f"depth_mixing={self.depth_mixing!r} routes separate key and value inputs into the attention, which "
                f"the {adapter.model_type} backbone cannot take (its adapter declares no key/value inputs)"
            )
        _validate_backbone(self.backbone)

    def _validate_depth_knobs(self):
        # (a knob set after the implementation: what it computes is checked again here)
        check_implementation(self, self.attnres_implementation)
        if self.attnres_window is not None and self.attnres_window < 1:
            raise ValueError(f"attnres_window must be a positive number of sources or None, got {self.attnres_window!r}")
        if self.hidden_size % self.attnres_num_heads:
            raise ValueError(
                f"attnres_num_heads ({self.attnres_num_heads}) must divide hidden_size ({self.hidden_size})"
            )
        defaults = self.__dataclass_fields__
        for method in map(DEPTH_MIXING.declared, DEPTH_MIXING):  # (as declared: no method's module imported)
            if method.name == self.depth_mixing:
                continue
            changed = [name for name in method.config_fields if getattr(self, name) != defaults[name].default]
            if changed:
                raise ValueError(
                    f"{', '.join(changed)} only apply to depth_mixing={method.name!r}, "
                    f"but depth_mixing is {self.depth_mixing!r}"
                )
        if self.attnres_scalar_weights:
            if self.attnres_query != "static" or self.attnres_num_heads != 1 or not self.attnres_key_norm:
                raise ValueError(
                    "attnres_scalar_weights=True replaces the query and the keys by one learned scalar per source, "
                    "so it cannot be combined with attnres_query='input_dependent', attnres_num_heads > 1 or "
                    "attnres_key_norm=False"
                )

    @property
    def num_sublayers(self) -> int:
        """Attention and MLP each count as one sub-layer (a "layer" in the paper): `2 * num_hidden_layers`."""
        return 2 * self.num_hidden_layers

    @property
    def num_attnres_blocks(self) -> int:
        """Number of blocks `N` of Block AttnRes (the last one may be partial); `2 L` for Full AttnRes."""
        return -(-self.num_sublayers // self.attnres_block_size)



class AttnResConfig(_AttnResConfigFields):
    r"""
    Configuration of [`AttnResModel`] and [`AttnResForCausalLM`]: a pre-norm decoder of a transformers family
    (Llama, Mistral, Qwen2/3, SmolLM3, Granite, Phi-3, Gemma2/3, ...; `backbones.BACKBONES`) with Attention Residuals
    (Kimi Team, "Attention Residuals", arXiv:2603.15031, 2026) or another depth-mixing method.

    Args:
        backbone (`PreTrainedConfig`, `dict` or `str`, *optional*):
            The backbone family's own config (`LlamaConfig(...)`), its dict (with `model_type`), or a `model_type`
            whose config is built from the flat backbone keyword arguments (`backbone="gemma2", hidden_size=...`).
            `None`: a flat (pre-backbone) AttnRes config, see the module docstring. Its fields read through this
            config (`config.hidden_size`), and assignments to them go to it.
        depth_mixing (`str`, defaults to `"attnres"`):
            How sub-layers read the depth stream: `"residual"` is the standard residual (the baseline, identical
            to the backbone family's model), `"attnres"` is Full or Block Attention Residuals (paper Eq. 1-4 and 6); the rest of the
            family: `"delta_attnres"` (Delta AttnRes: the residual stream kept, AttnRes's read added to each
            sub-layer input through a zero-initialised gate; Full or Block by `attnres_block_size`, AttnRes's
            default knobs only), `"denseformer"` (Depth-Weighted Averages), `"muddformer"` (multiway dynamic dense connections),
            `"dca"` (DeepCrossAttention, GRN-v3 on the q/k/v inputs) and `"mhc"` (manifold-constrained
            hyper-connections). Each starts (at initialisation and after `retrofit`) as the residual model; see the
            `mixing_*.py` modules for the equations.
        attnres_block_size (`int`, *optional*):
            Sub-layers per block (the paper's `S`; also Delta AttnRes's). `1` is Full AttnRes (every sub-layer output is a source);
            otherwise an even number so that blocks start at an attention sub-layer. Defaults to about 8 blocks
            (see `default_attnres_block_size`). The last block may be partial.
        attnres_rescale_output (`bool`, defaults to `False`):
            Multiply each router's output by its number of sources. Every reader of the routed state is an
            RMSNorm, which is scale-invariant up to `rms_norm_eps`, so this changes only the `eps` effect; with
            zero pseudo-queries it makes the router output equal the residual *sum*, so a model retrofitted from
            its source family reproduces its logits to float noise. `False` is the paper's formulation (the mean). With
            `attnres_score_fn="sigmoid"` the factor is 2 (`sigmoid(0) = 1/2`), which has the same effect.

        attnres_score_fn (`str`, defaults to `"softmax"`):
            The first of the AttnRes ablation knobs (the paper's Table 4; `depth_mixing="attnres"` only; every default
            is the paper's AttnRes). `"softmax"` over depth (Eq. 2) or `"sigmoid"`: each source weighted by
            `sigmoid(w . k_i)`, unnormalised.
        attnres_key_norm (`bool`, defaults to `True`):
            RMSNorm the keys (Eq. 3). `False` scores the raw sources, `w . v_i`; the router then has no `key_norm`.
        attnres_window (`int`, *optional*):
            Sliding window over depth: each router, the final one before the head included, sees the embedding plus
            only the `W` most recent other sources (completed sources and the current block's partial sum; with
            Full AttnRes the `W` most recent sub-layer outputs). Drops sources, so no initialisation reproduces
            the residual model and `retrofit` refuses it. The windowed final router is what makes the variant train
            behind the baseline at small scale (docs/science.md, `benchmarks/sliding_window.py`).
        attnres_query (`str`, defaults to `"static"`):
            `"static"`: the learned pseudo-query `w_l`. `"input_dependent"`: `w_l + W_l RMSNorm(v_last)`, a projection
            of the most recent source (a `(hidden_size, hidden_size)` parameter `query_proj`, zero-initialised).
        attnres_num_heads (`int`, defaults to 1):
            Per-head depth weights: the hidden axis is split into `H` slices, each with its own slice of the query and
            its own softmax over depth (keys RMS-normalised over the whole vector). Must divide `hidden_size`.
        attnres_scalar_weights (`bool`, defaults to `False`):
            Input-independent weights: the score of source `i` is a learned scalar `s_{i->l}` (parameter `logits`,
            zero-initialised) instead of `w_l . RMSNorm(v_i)`. No query and no key norm.
        attnres_implementation (`str`, defaults to `"torch"`):
            Who computes the router reads: `"torch"`; `"fla"`, flash-linear-attention's fused Triton kernel for the
            direct reads (Full AttnRes, the final router; `pip install "attnres-hf[fla]"`), the default knobs only
            (softmax, key norm, static query, one head, no window, no scalar weights), reads that return depth
            weights and the two-phase Block reads staying on torch; or `"triton"`, this library's fused kernels of
            two-phase inference (phase 1 and the merge, forward and backward; `attnres_triton.py`) for every read,
            with or without the key norm (softmax, static query, one head, no window, no scalar weights; `pip
            install "attnres-hf[triton]"`). Both kernels need CUDA tensors (others raise at the forward; Triton's
            interpreter, `TRITON_INTERPRET=1`, runs `"triton"` on CPU for tests), compute the torch path's numbers up
            to rounding, and leave reads under `torch.compile` to torch. `"naive"`: every read by the reference
            (`ops_naive.attnres`: each router stacks and scores every source; no buffer, no two phases), as
            `attn_implementation="eager"` for attention (static query, one head, no window, no scalar weights).
            Settable like `attn_implementation`: `from_pretrained(path, attnres_implementation="triton")`.

        denseformer_dilation (`int`, defaults to 1):
            DenseFormer (`depth_mixing="denseformer"`; Pagliardini et al., NeurIPS 2024): the DWA after layer `i`
            averages only the states `j` with `j = i + 1 (mod k)` (the paper's `k`).
        denseformer_period (`int`, defaults to 1):
            A DWA module after every `p`-th layer only (the paper's `p`); the other layers pass their output on.

        mhc_num_streams (`int`, defaults to 4):
            mHC (`depth_mixing="mhc"`; Xie et al., DeepSeek-AI, arXiv 2512.24880): the number `n >= 2` of parallel
            residual streams (the expansion rate).
        mhc_sinkhorn_iterations (`int`, defaults to 20):
            Sinkhorn-Knopp iterations that make the stream-mixing matrix doubly stochastic (the paper's `t_max`).

    Raises:
        ValueError: on an unknown `depth_mixing`, a knob set for another method (e.g. `mhc_num_streams` with
            `depth_mixing="attnres"`), contradictory AttnRes knobs (scalar weights have no query and no keys;
            `attnres_implementation="fla"` and `"triton"` compute only the knobs they name), an invalid knob value, a block size that
            is neither 1 nor a positive even number, an unsupported backbone family (or a setting of it an adapter
            refuses, naming why), a flat config no family expresses, and on backbone rules: more key/value heads than
            attention heads or heads that do not divide, a `head_dim`-less config whose `hidden_size` is not a
            multiple of the head count, an odd or non-positive `head_dim`, an unknown activation or `rope_type`, a
            non-positive `sliding_window`, or `layer_types` of the wrong length.

    Example:

    ```python
    >>> from transformers import Qwen3Config
    >>> from attnres_hf import AttnResConfig, AttnResForCausalLM
    >>> backbone = Qwen3Config(vocab_size=99, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
    ...                        num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    >>> model = AttnResForCausalLM(AttnResConfig(backbone=backbone, attnres_block_size=2))
    >>> flat = AttnResConfig(vocab_size=99, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
    ...                      num_attention_heads=4, num_key_value_heads=2)  # a Llama backbone
    ```
    """

    @functools.wraps(_AttnResConfigFields.__init__,  # the fields' signature; its own qualified name
                     assigned=[name for name in functools.WRAPPER_ASSIGNMENTS if name != "__qualname__"])
    def __init__(self, *args, **kwargs):
        if args:  # (`@strict` refuses them too, but names the private fields class)
            raise ValueError(f"{type(self).__name__} accepts only keyword arguments, but found `{len(args)}` "
                             "positional args.")
        with _one_line_value_errors():
            super().__init__(**kwargs)

    def __setattr__(self, name, value):
        # (outside `@strict`'s check of the fields, which `_AttnResConfigFields` has: its errors as one line)
        with _one_line_value_errors():
            super().__setattr__(name, value)

    def validate(self):
        """Check the fields and the rules across them (`validate_architecture`), e.g. after assignments; also run
        by `save_pretrained`. Raises a one-line `ValueError` naming the rule that is broken."""
        with _one_line_value_errors():
            super().validate()


_LEGACY_DEFAULTS = dict(
    vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
    hidden_act="silu", max_position_embeddings=2048, initializer_range=0.02, rms_norm_eps=1e-6, use_cache=True,
    pad_token_id=None, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
)
"""The defaults of the flat (pre-backbone) AttnResConfig: a saved flat config omits the fields equal to them."""

_LEGACY_FIELDS = frozenset({
    *_LEGACY_DEFAULTS, "num_key_value_heads", "head_dim", "rope_parameters", "rope_theta", "rope_scaling",
    "attention_bias", "attention_out_bias", "attention_dropout", "mlp_bias", "use_qk_norm", "sliding_window",
    "layer_types",
})
"""Fields of the flat (pre-backbone) AttnResConfig, which now belong to the backbone."""

_BASE_FIELDS = frozenset(PreTrainedConfig.__dataclass_fields__)


def _backbone_fields(backbone) -> set[str]:
    """Fields of a backbone config (its class's, and the attributes it was given) that are not `PreTrainedConfig`'s."""
    names = set(getattr(backbone, "__dataclass_fields__", ())) | {k for k in vars(backbone) if not k.startswith("_")}
    return names - _BASE_FIELDS


def _legacy_backbone(flat: dict) -> tuple[str, dict]:
    """`(model_type, fields)` of the family that a flat AttnRes config's fields describe (see the module docstring).

    Raises:
        ValueError: if no supported family has its combination of biases, q/k norm and sliding windows.
    """
    flat = _LEGACY_DEFAULTS | flat
    if flat.get("head_dim", 0) is None:  # the family's default (Qwen2Config has no field: a None would stick)
        del flat["head_dim"]
    if flat.get("rope_parameters") is None and "rope_theta" not in flat:
        flat["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}  # the flat config's default
    qk_norm, bias = flat.pop("use_qk_norm", False), flat.get("attention_bias", False)
    out_bias = flat.pop("attention_out_bias", None)
    out_bias = bias if out_bias is None else out_bias
    mlp_bias = flat.get("mlp_bias", False)
    window, layer_types = flat.get("sliding_window"), flat.get("layer_types")
    if layer_types is not None and len(layer_types) != flat["num_hidden_layers"]:
        raise ValueError(f"layer_types must have one entry per layer ({flat['num_hidden_layers']}), "
                         f"got {len(layer_types)}")
    if layer_types is not None and "sliding_attention" in layer_types and window is None:
        raise ValueError("layer_types has 'sliding_attention' layers, so sliding_window must be set")
    if window is not None and layer_types is None:
        layer_types = flat["layer_types"] = ["sliding_attention"] * flat["num_hidden_layers"]  # the flat default
    slides = layer_types is not None and "sliding_attention" in layer_types
    if qk_norm or (bias and not out_bias):
        model_type = "qwen3" if qk_norm else "qwen2"
        if qk_norm and out_bias != bias:
            raise ValueError("a flat AttnRes config with use_qk_norm=True (Qwen3) has the same bias on q/k/v and o_proj "
                             f"(attention_bias), got attention_bias={bias}, attention_out_bias={out_bias}")
        if mlp_bias:
            raise ValueError(f"a flat AttnRes config of the {model_type} layout cannot have mlp_bias=True")
        if model_type == "qwen2":
            flat.pop("attention_bias")  # Qwen2 always has q/k/v bias and no o_proj bias
        if model_type == "qwen3" and "head_dim" not in flat:  # Qwen3Config's own default is 128
            flat["head_dim"] = flat["hidden_size"] // flat["num_attention_heads"]
        flat.pop("mlp_bias", None)
        flat["use_sliding_window"] = slides
        if not slides:
            flat.pop("layer_types", None)
        return model_type, flat
    if out_bias != bias:
        raise ValueError(f"attention_out_bias={out_bias} differs from attention_bias={bias}: only the Qwen2 layout "
                         "(q/k/v bias, no o_proj bias) has that, and it needs attention_bias=True")
    if not slides:
        flat.pop("layer_types", None)
        flat.pop("sliding_window", None)
        return "llama", flat
    if bias or mlp_bias or any(kind != "sliding_attention" for kind in layer_types):
        raise ValueError("a flat AttnRes config with sliding-window layers is a Mistral layout (every layer slides, no "
                         "biases) or a Qwen2/Qwen3 one (attention_bias=True with attention_out_bias=False, or "
                         "use_qk_norm=True); pass backbone=<model_type> or a backbone config instead")
    for name in ("layer_types", "attention_bias", "mlp_bias"):
        flat.pop(name, None)
    return "mistral", flat


def _float_fields(config_class, fields: dict) -> dict:
    """Integer values of float-typed fields as floats (`"rms_norm_eps": 1` in a hand-written config.json)."""
    declared = getattr(config_class, "__dataclass_fields__", {})
    return {name: float(value) if name in declared and declared[name].type is float and type(value) is int else value
            for name, value in fields.items()}


def _build_backbone(backbone, kwargs: dict):
    """The backbone config from `backbone` (a config, a dict, a model type or `None`) and the flat keyword arguments
    that are its fields; returns it and the keyword arguments left for the AttnRes config itself."""
    if isinstance(backbone, PreTrainedConfig):
        backbone = backbone.to_dict()  # a copy: the source model keeps its own config
    if backbone is None:
        flat = {name: kwargs.pop(name) for name in list(kwargs) if name in _LEGACY_FIELDS}
        model_type, fields = _legacy_backbone(flat)
    else:
        fields = dict(backbone) if isinstance(backbone, dict) else {}
        model_type = fields.pop("model_type", DEFAULT_BACKBONE) if isinstance(backbone, dict) else backbone
    if model_type not in BACKBONES:
        raise ValueError(f"unsupported backbone model_type {model_type!r}: AttnRes supports {', '.join(BACKBONES)}")
    config_class = BACKBONES.declared(model_type).config_class  # the record as declared: no family modeling code
    own = set(AttnResConfig.__dataclass_fields__) | {"attn_implementation", "experts_implementation", "auto_map"}
    family = (set(config_class.__dataclass_fields__) - _BASE_FIELDS) | _LEGACY_FIELDS
    fields |= {name: kwargs.pop(name) for name in list(kwargs) if name in family and name not in own}
    _check_sizes(fields)
    return config_class(**_float_fields(config_class, fields)), kwargs


def _check_sizes(fields: dict) -> None:
    """The backbone's sizes (and expert widths, Gemma's attention scalar) are positive, no soft-capping is 0, and the RMSNorm epsilon is positive and finite (checked before the family's
    config class runs, whose own arithmetic would fail on them with a bare ZeroDivisionError); raises `ValueError`."""
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "moe_intermediate_size", "num_experts_per_tok", "query_pre_attn_scalar"):
        value = fields.get(name)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value <= 0:  # the family checks types
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    for name in ("final_logit_softcapping", "attn_logit_softcapping"):
        if fields.get(name) is not None and not isinstance(fields[name], bool) and fields[name] == 0:
            raise ValueError(f"{name}=0 divides by zero in the soft-capping; use None to turn it off")
    eps = fields.get("rms_norm_eps")
    if isinstance(eps, (int, float)) and not isinstance(eps, bool) and not 0 < eps < math.inf:
        raise ValueError(f"rms_norm_eps must be a positive finite number (the RMSNorm's epsilon; 0 divides by zero on "
                         f"a zero source), got {eps!r}")


def _validate_backbone(backbone) -> None:
    """The rules every rotary-attention backbone follows, checked with AttnRes's messages (fields a family lacks are
    skipped; each family's own config checks the rest)."""
    _check_sizes(vars(backbone))
    routing = EXPERT_ROUTING.get(backbone.model_type)  # the family's field for its number of routed experts
    experts = getattr(backbone, routing.num_experts, None) if routing is not None else None
    top_k = getattr(backbone, "num_experts_per_tok", None)
    if isinstance(experts, int) and experts > 0 and isinstance(top_k, int) and top_k > experts:
        raise ValueError(f"num_experts_per_tok ({top_k}) must not exceed the number of experts ({experts})")
    heads, kv_heads = getattr(backbone, "num_attention_heads", None), getattr(backbone, "num_key_value_heads", None)
    if heads is not None and kv_heads is not None:
        if kv_heads < 1:
            raise ValueError(f"num_key_value_heads must be a positive integer, got {kv_heads!r}")
        if kv_heads > heads:
            raise ValueError(f"num_key_value_heads ({kv_heads}) must not exceed num_attention_heads ({heads})")
        if heads % kv_heads:
            raise ValueError(f"num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv_heads}) "
                             "for grouped-query attention")
    head_dim = getattr(backbone, "head_dim", None)
    if head_dim is None and heads and backbone.hidden_size % heads:
        raise ValueError(f"hidden_size ({backbone.hidden_size}) must be a multiple of num_attention_heads ({heads}) "
                         "unless head_dim is given")
    if head_dim is not None and (head_dim < 2 or head_dim % 2):
        raise ValueError(f"head_dim must be a positive even integer (rotary pairs), got {head_dim!r}")
    for name in ("hidden_act", "hidden_activation"):
        act = getattr(backbone, name, None)
        if act is not None and act not in ACT2FN and act not in getattr(type(backbone), "own_activations", ()):
            raise ValueError(f"{name} must be one of transformers' activations (e.g. 'silu'), got {act!r}")
    eps = getattr(backbone, "rms_norm_eps", None)
    if eps is not None and not eps >= 0:
        raise ValueError(f"rms_norm_eps must be greater or equal to 0.0, got {eps!r}")
    rope = getattr(backbone, "rope_parameters", None) or {}
    for params in rope.values() if rope and all(isinstance(v, dict) for v in rope.values()) else [rope]:
        rope_type = params.get("rope_type", "default")
        if rope_type != "default" and rope_type not in ROPE_INIT_FUNCTIONS:
            raise ValueError(f"rope_parameters['rope_type'] must be 'default' or one of {sorted(ROPE_INIT_FUNCTIONS)}, "
                             f"got {rope_type!r}")
        theta = params.get("rope_theta", 10000.0)
        if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not 0 < theta < float("inf"):
            raise ValueError(f"rope_parameters['rope_theta'] (rope_theta) must be a positive number, got {theta!r}")
    window = getattr(backbone, "sliding_window", None)
    layer_types = getattr(backbone, "layer_types", None)
    # transformers' Qwen2-MoE config writes `sliding_window=0` for "no window" when no layer slides
    if window is not None and window < 1 and (layer_types is None or "sliding_attention" in layer_types):
        raise ValueError(f"sliding_window must be a positive number of tokens or None, got {window!r}")
    if layer_types is not None:
        if len(layer_types) != backbone.num_hidden_layers:
            raise ValueError(f"layer_types must have one entry per layer ({backbone.num_hidden_layers}), "
                             f"got {len(layer_types)}")
        if "sliding_attention" in layer_types and window is None:
            raise ValueError("layer_types has 'sliding_attention' layers, so sliding_window must be set")


ATTNRES_KNOB_DEFAULTS = {name: AttnResConfig.__dataclass_fields__[name].default
                         for name in DEPTH_MIXING.declared("attnres").config_fields}
"""The paper's Table 4 ablation knobs of `depth_mixing="attnres"` at their defaults (the paper's AttnRes)."""

__all__ = ["AttnResConfig", "default_attnres_block_size", "DEPTH_MIXING_METHODS", "ATTNRES_KNOB_DEFAULTS"]
