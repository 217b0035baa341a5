"""AttnRes configuration: a Llama/Qwen decoder whose residual stream is replaced by depth routing.

Field names follow `LlamaConfig` / `Qwen2Config` / `Qwen3Config` so that a checkpoint of those families maps onto
this config field by field. New fields are prefixed (`depth_mixing`, `attnres_*`).

Travels with checkpoints as remote code (`auto_map`): imports only `transformers` and its sibling `depth_mixing`
(the method records).
"""

import functools
import re
from typing import Literal

from huggingface_hub.dataclasses import strict
from huggingface_hub.errors import StrictDataclassError

from transformers.activations import ACT2FN
from transformers.configuration_utils import PreTrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, RopeParameters
from transformers.utils.type_validators import interval

from .depth_mixing import DEPTH_MIXING


DEPTH_MIXING_METHODS = tuple(DEPTH_MIXING)
"""Values accepted by `AttnResConfig.depth_mixing`, read from the method records (`depth_mixing.DEPTH_MIXING`)."""


def default_attnres_block_size(num_hidden_layers: int, num_blocks: int = 8) -> int:
    """Sub-layers per block that give about `num_blocks` blocks (the paper: ~8 blocks recover most of the gain).

    A model with `num_hidden_layers = L` has `2 L` sub-layers (attention and MLP each count). The result is even,
    so blocks start at an attention sub-layer, and at least 2.
    """
    return max(2, 2 * round(num_hidden_layers / num_blocks))


@strict
class AttnResConfig(PreTrainedConfig):
    r"""
    Configuration of [`AttnResModel`] and [`AttnResForCausalLM`]: a pre-norm Llama/Qwen decoder with Attention
    Residuals (Kimi Team, "Attention Residuals", arXiv:2603.15031, 2026).

    Backbone fields are Llama's (`vocab_size`, `hidden_size`, `intermediate_size`, `num_hidden_layers`,
    `num_attention_heads`, `num_key_value_heads`, `head_dim`, `hidden_act`, `max_position_embeddings`,
    `rope_parameters` (incl. Llama-3 `rope_type="llama3"` scaling), `rms_norm_eps`, `attention_bias`, `mlp_bias`,
    `tie_word_embeddings`, `attention_dropout`, `initializer_range`), plus:

    Args:
        attention_bias (`bool`, defaults to `False`):
            Bias on the q/k/v projections (Qwen2 sets it).
        attention_out_bias (`bool`, *optional*):
            Bias on `o_proj`. `None` follows `attention_bias` (Llama/Qwen3 semantics); Qwen2 checkpoints use
            `attention_bias=True, attention_out_bias=False`.
        use_qk_norm (`bool`, defaults to `False`):
            Qwen3-style RMSNorm over `head_dim` on queries and keys (`self_attn.q_norm`, `self_attn.k_norm`).
        sliding_window (`int`, *optional*), layer_types (`list[str]`, *optional*):
            Sliding-window attention (Mistral, Qwen2/3). `layer_types[i]` is `"full_attention"` or
            `"sliding_attention"`; by default every layer slides when `sliding_window` is set.
        depth_mixing (`str`, defaults to `"attnres"`):
            How sub-layers read the depth stream: `"residual"` is the standard residual (the baseline, identical
            to Llama/Qwen), `"attnres"` is Full or Block Attention Residuals (paper Eq. 1-4 and 6); the rest of the
            family: `"denseformer"` (Depth-Weighted Averages), `"muddformer"` (multiway dynamic dense connections),
            `"dca"` (DeepCrossAttention, GRN-v3 on the q/k/v inputs) and `"mhc"` (manifold-constrained
            hyper-connections). Each starts (at initialisation and after `retrofit`) as the residual model; see the
            classes in `modeling_attnres.py` for the equations.
        attnres_block_size (`int`, *optional*):
            Sub-layers per block (the paper's `S`). `1` is Full AttnRes (every sub-layer output is a source);
            otherwise an even number so that blocks start at an attention sub-layer. Defaults to about 8 blocks
            (see `default_attnres_block_size`). The last block may be partial.
        attnres_rescale_output (`bool`, defaults to `False`):
            Multiply each router's output by its number of sources. Every reader of the routed state is an
            RMSNorm, which is scale-invariant up to `rms_norm_eps`, so this changes only the `eps` effect; with
            zero pseudo-queries it makes the router output equal the residual *sum*, so a model retrofitted from
            Llama/Qwen reproduces its logits to float noise. `False` is the paper's formulation (the mean). With
            `attnres_score_fn="sigmoid"` the factor is 2 (`sigmoid(0) = 1/2`), which has the same effect.

        AttnRes ablation knobs (the paper's Table 4; `depth_mixing="attnres"` only, defaults are the paper's AttnRes):

        attnres_score_fn (`str`, defaults to `"softmax"`):
            `"softmax"` over depth (Eq. 2) or `"sigmoid"`: each source weighted by `sigmoid(w . k_i)`, unnormalised.
        attnres_key_norm (`bool`, defaults to `True`):
            RMSNorm the keys (Eq. 3). `False` scores the raw sources, `w . v_i`; the router then has no `key_norm`.
        attnres_window (`int`, *optional*):
            Sliding window over depth: each router sees the embedding plus only the `W` most recent other sources
            (completed sources and the current block's partial sum). Drops sources, so no initialisation reproduces
            the residual model and `retrofit` refuses it.
        attnres_query (`str`, defaults to `"static"`):
            `"static"`: the learned pseudo-query `w_l`. `"input_dependent"`: `w_l + W_l RMSNorm(v_last)`, a projection
            of the most recent source (a `(hidden_size, hidden_size)` parameter `query_proj`, zero-initialised).
        attnres_num_heads (`int`, defaults to 1):
            Per-head depth weights: the hidden axis is split into `H` slices, each with its own slice of the query and
            its own softmax over depth (keys RMS-normalised over the whole vector). Must divide `hidden_size`.
        attnres_scalar_weights (`bool`, defaults to `False`):
            Input-independent weights: the score of source `i` is a learned scalar `s_{i->l}` (parameter `logits`,
            zero-initialised) instead of `w_l . RMSNorm(v_i)`. No query and no key norm.

        DenseFormer (`depth_mixing="denseformer"`; Pagliardini et al., NeurIPS 2024):

        denseformer_dilation (`int`, defaults to 1):
            The DWA after layer `i` averages only the states `j` with `j = i + 1 (mod k)` (the paper's `k`).
        denseformer_period (`int`, defaults to 1):
            A DWA module after every `p`-th layer only (the paper's `p`); the other layers pass their output on.

        mHC (`depth_mixing="mhc"`; Xie et al., DeepSeek-AI, arXiv:2512.24880):

        mhc_num_streams (`int`, defaults to 4):
            Number `n >= 2` of parallel residual streams (the expansion rate).
        mhc_sinkhorn_iterations (`int`, defaults to 20):
            Sinkhorn-Knopp iterations that make the stream-mixing matrix doubly stochastic (the paper's `t_max`).

    Raises:
        ValueError: on an unknown `depth_mixing`, a knob set for another method (e.g. `mhc_num_streams` with
            `depth_mixing="attnres"`), contradictory AttnRes knobs (scalar weights have no query and no keys), an
            invalid knob value, a block size that is neither 1 nor a positive even number,
            more key/value heads than attention heads or heads that do not divide, a `head_dim`-less config
            whose `hidden_size` is not a multiple of the head count, an odd or non-positive `head_dim`, an unknown
            `hidden_act` or `rope_type`, a non-positive `sliding_window`, or `layer_types` of the wrong length.

    Example:

    ```python
    >>> from attnres_hf import AttnResConfig, AttnResForCausalLM
    >>> config = AttnResConfig(vocab_size=99, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
    ...                        num_attention_heads=4, num_key_value_heads=2, attnres_block_size=2)
    >>> model = AttnResForCausalLM(config)
    ```
    """

    model_type = "attnres"
    keys_to_ignore_at_inference = ["cache"]
    base_model_tp_plan = {
        "layers.*.self_attn.q_proj": "colwise",
        "layers.*.self_attn.k_proj": "colwise",
        "layers.*.self_attn.v_proj": "colwise",
        "layers.*.self_attn.o_proj": "rowwise",
        "layers.*.mlp.gate_proj": "colwise",
        "layers.*.mlp.up_proj": "colwise",
        "layers.*.mlp.down_proj": "rowwise",
    }

    # Field types, choices (`Literal`) and ranges (`interval`) are checked by huggingface_hub's `@strict`, as for
    # `LlamaConfig`; rules across fields are in `validate_architecture`. Both raise `ValueError` (see the end).
    vocab_size: int = interval(min=1)(default=32000)
    hidden_size: int = interval(min=1)(default=4096)
    intermediate_size: int = interval(min=1)(default=11008)
    num_hidden_layers: int = interval(min=1)(default=32)
    num_attention_heads: int = interval(min=1)(default=32)
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    hidden_act: str = "silu"
    max_position_embeddings: int = interval(min=1)(default=2048)
    # `float | int`: an integer-valued float (`"rms_norm_eps": 1`, `"initializer_range": 0`) loaded before `@strict`
    initializer_range: float | int = interval(min=0.0)(default=0.02)
    rms_norm_eps: float | int = interval(min=0.0)(default=1e-6)
    use_cache: bool = True
    pad_token_id: int | None = None
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 2
    tie_word_embeddings: bool = False
    rope_parameters: RopeParameters | dict | None = None
    attention_bias: bool = False
    attention_out_bias: bool | None = None
    attention_dropout: float | int = interval(min=0.0, max=1.0)(default=0.0)
    mlp_bias: bool = False
    use_qk_norm: bool = False
    sliding_window: int | None = None
    layer_types: list[str] | None = None
    depth_mixing: Literal[DEPTH_MIXING_METHODS] = "attnres"
    attnres_block_size: int | None = None
    attnres_rescale_output: bool = False
    attnres_score_fn: Literal["softmax", "sigmoid"] = "softmax"
    attnres_key_norm: bool = True
    attnres_window: int | None = None
    attnres_query: Literal["static", "input_dependent"] = "static"
    attnres_num_heads: int = interval(min=1)(default=1)
    attnres_scalar_weights: bool = False
    denseformer_dilation: int = interval(min=1)(default=1)
    denseformer_period: int = interval(min=1)(default=1)
    mhc_num_streams: int = interval(min=2)(default=4)  # one stream cannot hold a doubly-stochastic mix of anything
    mhc_sinkhorn_iterations: int = interval(min=1)(default=20)

    def __post_init__(self, **kwargs):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None and self.num_attention_heads and self.hidden_size % self.num_attention_heads == 0:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.attention_out_bias is None:
            self.attention_out_bias = self.attention_bias
        if self.attnres_block_size is None:
            self.attnres_block_size = default_attnres_block_size(self.num_hidden_layers)
        if self.layer_types is None:
            kind = "sliding_attention" if self.sliding_window is not None else "full_attention"
            self.layer_types = [kind] * self.num_hidden_layers
        self.validate_architecture()
        super().__post_init__(**kwargs)

    def validate_architecture(self):
        """Check the rules of the architecture; raises `ValueError` naming the rule that is broken."""
        self._validate_depth_knobs()
        size = self.attnres_block_size
        if size < 1 or (size != 1 and size % 2):
            raise ValueError(
                "attnres_block_size must be 1 (Full AttnRes) or a positive even number of sub-layers "
                f"(so every block starts at an attention sub-layer), got {size!r}"
            )
        if self.num_key_value_heads < 1:
            raise ValueError(f"num_key_value_heads must be a positive integer, got {self.num_key_value_heads!r}")
        if self.num_key_value_heads > self.num_attention_heads:
            raise ValueError(
                f"num_key_value_heads ({self.num_key_value_heads}) must not exceed num_attention_heads "
                f"({self.num_attention_heads})"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of num_key_value_heads "
                f"({self.num_key_value_heads}) for grouped-query attention"
            )
        if self.head_dim is None:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be a multiple of num_attention_heads "
                f"({self.num_attention_heads}) unless head_dim is given"
            )
        if self.head_dim < 2 or self.head_dim % 2:
            raise ValueError(f"head_dim must be a positive even integer (rotary pairs), got {self.head_dim!r}")
        if self.hidden_act not in ACT2FN:
            raise ValueError(f"hidden_act must be one of transformers' activations (e.g. 'silu'), got {self.hidden_act!r}")
        rope_type = (self.rope_parameters or {}).get("rope_type", "default")
        if rope_type != "default" and rope_type not in ROPE_INIT_FUNCTIONS:
            raise ValueError(
                f"rope_parameters['rope_type'] must be 'default' or one of {sorted(ROPE_INIT_FUNCTIONS)}, got {rope_type!r}"
            )
        theta = (self.rope_parameters or {}).get("rope_theta", 10000.0)
        if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not 0 < theta < float("inf"):
            raise ValueError(f"rope_parameters['rope_theta'] (rope_theta) must be a positive number, got {theta!r}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be a positive number of tokens or None, got {self.sliding_window!r}")
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"layer_types must have one entry per layer ({self.num_hidden_layers}), got {len(self.layer_types)}"
            )
        bad = sorted(set(self.layer_types) - {"full_attention", "sliding_attention"})
        if bad:
            raise ValueError(f"layer_types entries must be 'full_attention' or 'sliding_attention', got {bad}")
        if "sliding_attention" in self.layer_types and self.sliding_window is None:
            raise ValueError("layer_types has 'sliding_attention' layers, so sliding_window must be set")

    def _validate_depth_knobs(self):
        if self.attnres_window is not None and self.attnres_window < 1:
            raise ValueError(f"attnres_window must be a positive number of sources or None, got {self.attnres_window!r}")
        if self.hidden_size % self.attnres_num_heads:
            raise ValueError(
                f"attnres_num_heads ({self.attnres_num_heads}) must divide hidden_size ({self.hidden_size})"
            )
        defaults = self.__dataclass_fields__
        for method in DEPTH_MIXING.values():
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


def _raise_value_errors(method):
    """Re-raise `@strict`'s validation errors as one-line `ValueError`s naming the field and the rule (the type users
    and the tests rely on), e.g. `attnres_num_heads must be greater or equal to 1, got 0.`"""

    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        try:
            return method(*args, **kwargs)
        except StrictDataclassError as error:
            cause = error.__cause__ if error.__cause__ is not None else error
            field = re.match(r"Validation error for field '(\w+)'", str(error))
            message = str(cause)
            union = re.match(r"Field '(\w+)' with value (.*) doesn't match any type in \((.*)\)\. Errors:", message, re.S)
            if union is not None:  # "Field 'x' with value v doesn't match any type in (<class 'int'>, ...). Errors: ..."
                types = re.sub(r"<class '(\w+)'>", r"\1", union.group(3)).replace("NoneType", "None")
                message = f"{union.group(1)} must be one of the types ({types}), got {union.group(2)}"
            elif field is not None:  # "Value must be ..." / "Field 'x' expected ..." -> "x must be ..." / "x expected ..."
                message = re.sub(r"^(Value|Field '\w+')( expected)?", rf"{field.group(1)} must be", message)
                message = message.replace("must be must be", "must be")
            raise ValueError(" ".join(message.split())) from None

    return wrapper


# AttnRes: after `@strict` wrapped them; assignments after construction are validated (and reported) the same way.
AttnResConfig.__init__ = _raise_value_errors(AttnResConfig.__init__)
AttnResConfig.__setattr__ = _raise_value_errors(AttnResConfig.__setattr__)

ATTNRES_KNOB_DEFAULTS = {name: AttnResConfig.__dataclass_fields__[name].default
                         for name in DEPTH_MIXING["attnres"].config_fields}
"""The paper's Table 4 ablation knobs of `depth_mixing="attnres"` at their defaults (the paper's AttnRes)."""

__all__ = ["AttnResConfig", "default_attnres_block_size", "DEPTH_MIXING_METHODS", "ATTNRES_KNOB_DEFAULTS"]
