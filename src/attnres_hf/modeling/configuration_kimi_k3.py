"""Kimi K3's text-model configuration (`model_type: "kimi_k3"`; the modules are in `backbones_k3.py`): `KimiK3Config`
and the checks of the settings no module here implements.

A configuration imports no modeling code: an `AttnResConfig` over a `kimi_k3` backbone reads this module (through
the backbone's declared record in `backbones.BACKBONES`), never transformers' Kimi Linear modeling module, which
imports fla where it is installed.

Travels with checkpoints as remote code (a sibling of `backbones.py` and `backbones_moe.py`, which import it):
imports only transformers and huggingface_hub.
"""

from huggingface_hub.dataclasses import strict

from transformers.activations import ACT2FN
from transformers.models.kimi_linear.configuration_kimi_linear import KimiLinearConfig

SITU = "situ"
"""`hidden_act` of K3's SiTU-GLU (`backbones_k3.situ_glu`), beside transformers' `ACT2FN` activations."""

_LINEAR_ATTN_KEYS = frozenset({"num_heads", "head_dim", "short_conv_kernel_size", "kda_layers", "full_attn_layers",
                               "use_full_rank_gate", "gate_lower_bound"})
"""The keys of K3's `linear_attn_config` (Kimi Linear's five, K3's two gate options)."""


@strict
class KimiK3Config(KimiLinearConfig):
    r"""
    Kimi K3's text model (`text_config` of the released `config.json`, whose own `model_type` is `kimi_linear`),
    without its AttnRes field: [`KimiLinearConfig`] (and its defaults) plus the fields below, whose defaults are what
    K3's released code reads for a missing field (as its public ports read it: `getattr(config, name, default)`).

    Args:
        hidden_act (`str`, defaults to `"silu"`): `"situ"` (SiTU-GLU, K3's) or a transformers activation.
        activation_situ_beta (`float`, *optional*): SiTU's gate scale `b` (K3: 4.0); `None` is 1.
        activation_situ_linear_beta (`float`, *optional*): SiTU's up-projection bound `c` (K3: 25.0); `None` leaves
            the up projection unbounded.
        routed_expert_hidden_size (`int`, *optional*): width R of the latent MoE (K3: 3584); `None` runs the
            experts at `hidden_size`.
        latent_moe_use_norm (`bool`, defaults to `False`): RMSNorm of the experts' weighted sum, in the latent space.
        mla_use_nope (`bool`, defaults to `True`): MLA without rotary embedding (the only form implemented).
        mla_use_output_gate (`bool`, defaults to `False`): MLA's per-channel sigmoid output gate `g_proj`.
        linear_use_full_rank_gate (`bool`, defaults to `False`): KDA's output gate is one full-rank `g_proj`
            (K3's `linear_attn_config.use_full_rank_gate`).
        linear_lower_bound (`float`, *optional*): KDA's safe forget gate bound (K3's
            `linear_attn_config.gate_lower_bound`, -5.0; named as transformers' GLM-5-Next names it).
        moe_router_activation_func (`str`, defaults to `"sigmoid"`): the router's score (the only one K3 uses).

    `linear_attn_config` (K3's nested form) is read into the flat fields and not kept. Raises `ValueError` for a
    value no module here implements (naming the field).
    """

    model_type = "kimi_k3"
    own_activations = (SITU,)  # `hidden_act` values beside transformers' `ACT2FN` (`situ_glu`)

    activation_situ_beta: float | None = None
    activation_situ_linear_beta: float | None = None
    routed_expert_hidden_size: int | None = None
    latent_moe_use_norm: bool = False
    mla_use_nope: bool = True
    mla_use_output_gate: bool = False
    linear_use_full_rank_gate: bool = False
    linear_lower_bound: float | None = None
    moe_router_activation_func: str = "sigmoid"

    def __post_init__(self, **kwargs):
        if "text_config" in kwargs:  # the release's top-level config, whose model_type is this one's too
            raise ValueError("this is Kimi K3's multimodal config (its text model under text_config): `attnres "
                             "convert` reads K3 folders; K3's own code loads them with trust_remote_code=True")
        linear = kwargs.get("linear_attn_config") or {}
        if not isinstance(linear, dict):
            raise ValueError(f"linear_attn_config must be a dict, got {type(linear).__name__}")
        unknown = sorted(set(linear) - _LINEAR_ATTN_KEYS)
        if unknown:
            raise ValueError(f"linear_attn_config has keys kimi_k3 does not implement: {', '.join(unknown)}")
        _check_layer_lists(linear, self.num_hidden_layers)
        self.linear_use_full_rank_gate = linear.get("use_full_rank_gate", self.linear_use_full_rank_gate)
        self.linear_lower_bound = linear.get("gate_lower_bound", self.linear_lower_bound)
        if self.mlp_layer_types is None and "moe_layer_freq" in kwargs:  # K3's MoE rule, with its layer frequency
            first, freq = kwargs.get("first_k_dense_replace", 1), kwargs.pop("moe_layer_freq")
            self.mlp_layer_types = ["sparse" if i >= first and i % freq == 0 else "dense"
                                    for i in range(self.num_hidden_layers)]
        super().__post_init__(**kwargs)
        self.__dict__.pop("linear_attn_config", None)  # its values are the flat fields now (one home each)
        check_kimi_k3(self)


def _check_layer_lists(linear: dict, num_hidden_layers: int) -> None:
    """K3's 1-based `kda_layers` / `full_attn_layers` name each decoder layer once (checked before Kimi Linear's
    config builds `layer_types` from them, which fails on a bad list with a bare IndexError)."""
    if "kda_layers" not in linear and "full_attn_layers" not in linear:
        return
    lists = {name: linear.get(name, []) for name in ("kda_layers", "full_attn_layers")}
    for name, layers in lists.items():
        if not isinstance(layers, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in layers):
            raise ValueError(f"linear_attn_config.{name} must be a list of 1-based layer numbers, got {layers!r}")
    named = sorted(lists["kda_layers"] + lists["full_attn_layers"])
    if named != list(range(1, num_hidden_layers + 1)):
        raise ValueError(f"linear_attn_config.kda_layers and full_attn_layers must name each of the "
                         f"{num_hidden_layers} layers once, 1-based, got {lists['kda_layers']} and "
                         f"{lists['full_attn_layers']}")


def check_kimi_k3(config) -> None:
    """Refuse the K3 settings no module here implements, that its router cannot choose from, or a `pad_token_id`
    outside the vocabulary (the embedding's `padding_idx`); raises `ValueError` naming the field."""
    if not config.mla_use_nope:
        raise ValueError("kimi_k3 with mla_use_nope=False (rotary MLA) is not implemented: K3's MLA has no rotary "
                         "embedding")
    if config.moe_router_activation_func != "sigmoid":
        raise ValueError(f"kimi_k3 moe_router_activation_func={config.moe_router_activation_func!r} is not "
                         "implemented (K3's router scores with 'sigmoid')")
    if config.hidden_act != SITU and config.hidden_act not in ACT2FN:
        raise ValueError(f"kimi_k3 hidden_act must be 'situ' or a transformers activation, got {config.hidden_act!r}")
    for name in ("activation_situ_beta", "activation_situ_linear_beta"):
        value = getattr(config, name)
        if value is not None and not value > 0:
            raise ValueError(f"{name} must be a positive number or None, got {value!r}")
    bound = config.linear_lower_bound
    if bound is not None and not bound < 0:
        raise ValueError(f"linear_attn_config.gate_lower_bound must be negative (a log-decay bound), got {bound!r}")
    width = config.routed_expert_hidden_size
    if width is not None and not width > 0:
        raise ValueError(f"routed_expert_hidden_size must be a positive integer or None, got {width!r}")
    if "sparse" in config.mlp_layer_types:
        experts, groups, top_groups, top_k = (config.num_local_experts, config.n_group, config.topk_group,
                                              config.num_experts_per_tok)
        if not experts >= 2:  # the router's group score sums each group's top two
            raise ValueError(f"num_experts must be at least 2 on MoE layers, got {experts!r}")
        if not groups >= 1 or experts % groups or experts // groups < 2:
            raise ValueError(f"num_expert_group ({groups!r}) must divide num_experts ({experts}) into groups of at "
                             "least 2 experts")
        if not 1 <= top_groups <= groups:
            raise ValueError(f"topk_group must be between 1 and num_expert_group ({groups}), got {top_groups!r}")
        if not 1 <= top_k <= top_groups * experts // groups:
            raise ValueError(f"num_experts_per_token must be between 1 and the {top_groups * experts // groups} "
                             f"experts of the topk_group groups chosen, got {top_k!r}")
    if problem := token_id_problem("pad_token_id", config.pad_token_id, config.vocab_size):
        raise ValueError(problem)  # the embedding's padding_idx: torch fails on it with a bare AssertionError
    if "full_attention" not in config.layer_types:
        raise ValueError("kimi_k3 needs at least one MLA (full_attention) layer: transformers' hybrid cache counts "
                         "the tokens seen on its attention layers")


def token_id_problem(name: str, value, vocab_size: int) -> str | None:
    """Why `value` (`name`: an int, a list of ints for `eos_token_id`, or None) is not a token id of a vocabulary of
    `vocab_size`, or None when it is one (or None)."""
    ids = value if isinstance(value, list) else [value]
    if all(i is None or isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab_size for i in ids):
        return None
    return (f"{name}={value!r} is not a token of the vocabulary (vocab_size {vocab_size}): give a token id below it, "
            "or None")


__all__ = ["SITU", "KimiK3Config", "check_kimi_k3", "token_id_problem"]
