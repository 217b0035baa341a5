"""Kimi K3's checkpoint layout and config, in both directions: K3's tensor names and config fields against the
`kimi_k3` backbone's (`modeling/backbones_k3.py`) and the AttnRes config's.

K3's released checkpoint (`moonshotai/Kimi-K3`) is multimodal: `config.json` is `model_type: "kimi_k3"` with the text
model's fields under `text_config` (whose own `model_type` is `kimi_linear`), text tensors under
`language_model.model.` and `language_model.lm_head.weight`, and `vision_tower.` / `mm_projector.` tensors, which the
text model does not read. A text-only K3 folder (`config.json` the text config itself, tensors under `model.` /
`lm_head.weight`, as K3's `KimiLinearForCausalLM` and vLLM read it) is the other layout; `export` writes it.

Names (K3 -> attnres-hf, `{i}` the decoder layer):
- one to one (`ONE_TO_ONE`): norms, projections, the router, the latent MoE and shared-expert projections under the
  same names (`block_sparse_moe.` is `mlp.`), KDA's forget-gate tensors under `self_attn.forget_gate.`, and K3's
  AttnRes: `self_attention_res_{proj,norm}` -> `attn_res.{query,key_norm}`, `mlp_res_*` -> `mlp_res.*`,
  `output_attn_res_*` -> `model.final_res.*`; pseudo-queries `[1, hidden]` -> `[hidden]`.
- grouped: K3's three short convolutions `q_conv1d`, `k_conv1d`, `v_conv1d` (`[P, 1, W]` each) are the one
  depthwise `conv1d` `[3 P, 1, W]`, concatenated in that order; each routed expert's `w1` (gate), `w3` (up) and `w2`
  (down) `[I, R]`, `[I, R]`, `[R, I]` are row `e` of `experts.gate_up_proj` `[E, 2 I, R]` (gate first) and
  `experts.down_proj` `[E, R, I]`.
- `A_log`: K3 stores it zero-padded to `max(heads, head_dim)` entries (the release: 128 for 96 heads; `a_log_width`);
  the model keeps the first `heads` and the export pads again. Another length, or a non-zero padding entry, is
  refused.

Config: K3's `attn_res_block_size` (decoder layers per block) is `attnres_block_size = 2 * attn_res_block_size`
(sub-layers), with `attnres_rescale_output=False` (K3 mixes with the plain softmax); without it the folder is K3's
architecture without AttnRes, a plain residual model.
"""

import re

import torch
from transformers.configuration_utils import PreTrainedConfig

from ..modeling.configuration_kimi_k3 import KimiK3Config, token_id_problem
from ._names import is_pseudo_query, query_as_ours, query_as_theirs, rename, rename_tables

K3_MODEL_TYPE = "kimi_k3"
TEXT_MODEL_TYPE = "kimi_linear"  # the `model_type` of K3's text config

PREFIXES = {"multimodal": ("language_model.model.", "language_model.lm_head.weight"),
            "text": ("model.", "lm_head.weight")}
"""`layout -> (prefix of the text model's tensors, name of the head)`."""

SKIPPED_PREFIXES = ("vision_tower.", "mm_projector.")
"""Tensors of the multimodal checkpoint the text model does not read (the vision tower and its projector)."""

_KDA = ("q_proj", "k_proj", "v_proj", "b_proj", "o_proj", "o_norm", "g_a_proj", "g_b_proj")
_MLA = ("q_proj", "q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj")
_MOE = ("routed_expert_down_proj", "routed_expert_norm", "routed_expert_up_proj", "shared_experts.gate_proj",
        "shared_experts.up_proj", "shared_experts.down_proj")

ONE_TO_ONE = (
    # (K3 name under the text prefix, attnres-hf name); `{i}` is the decoder layer
    ("embed_tokens.weight", "model.embed_tokens.weight"),
    ("norm.weight", "model.norm.weight"),
    ("output_attn_res_proj.weight", "model.final_res.query"),
    ("output_attn_res_norm.weight", "model.final_res.key_norm.weight"),
    ("layers.{i}.input_layernorm.weight", "model.layers.{i}.input_layernorm.weight"),
    ("layers.{i}.post_attention_layernorm.weight", "model.layers.{i}.post_attention_layernorm.weight"),
    ("layers.{i}.self_attention_res_proj.weight", "model.layers.{i}.attn_res.query"),
    ("layers.{i}.self_attention_res_norm.weight", "model.layers.{i}.attn_res.key_norm.weight"),
    ("layers.{i}.mlp_res_proj.weight", "model.layers.{i}.mlp_res.query"),
    ("layers.{i}.mlp_res_norm.weight", "model.layers.{i}.mlp_res.key_norm.weight"),
    *((f"layers.{{i}}.self_attn.{name}.weight", f"model.layers.{{i}}.self_attn.{name}.weight")
      for name in dict.fromkeys((*_KDA, *_MLA, "g_proj"))),  # `g_proj`: KDA's full-rank output gate, MLA's gate
    ("layers.{i}.self_attn.f_a_proj.weight", "model.layers.{i}.self_attn.forget_gate.f_a_proj.weight"),
    ("layers.{i}.self_attn.f_b_proj.weight", "model.layers.{i}.self_attn.forget_gate.f_b_proj.weight"),
    ("layers.{i}.self_attn.dt_bias", "model.layers.{i}.self_attn.forget_gate.dt_bias"),
    ("layers.{i}.self_attn.A_log", "model.layers.{i}.self_attn.forget_gate.A_log"),
    *((f"layers.{{i}}.mlp.{name}.weight", f"model.layers.{{i}}.mlp.{name}.weight")
      for name in ("gate_proj", "up_proj", "down_proj")),
    ("layers.{i}.block_sparse_moe.gate.weight", "model.layers.{i}.mlp.gate.weight"),
    ("layers.{i}.block_sparse_moe.gate.e_score_correction_bias", "model.layers.{i}.mlp.gate.e_score_correction_bias"),
    *((f"layers.{{i}}.block_sparse_moe.{name}.weight", f"model.layers.{{i}}.mlp.{name}.weight") for name in _MOE),
)
"""The names that map one tensor to one tensor (the grouped ones are `CONV` and `EXPERT`)."""

CONV = ("q_conv1d", "k_conv1d", "v_conv1d")
"""K3's short convolutions of KDA, in the order of the model's one `self_attn.conv1d.weight`."""

EXPERT = re.compile(r"layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight$")
"""A routed expert's weight under the text prefix: layer, expert, and `w1` (gate) / `w3` (up) / `w2` (down)."""

_CONV = re.compile(r"layers\.(\d+)\.self_attn\.([qkv]_conv1d)\.weight$")


_TO_OURS, _TO_K3 = rename_tables(ONE_TO_ONE)


def k3_parts(names, config: KimiK3Config, layout: str) -> tuple[dict, list[str]]:
    """Which of K3's tensors (`names`, MXFP4 experts under their dequantised `.weight` names) make each attnres-hf
    tensor, under `layout`'s prefix: `{attnres-hf name: (how, K3 names)}` with `how` one of `"one"` (one tensor,
    `to_attnres_tensor` of it), `"cat"` (K3's three convolutions, concatenated along dim 0 in `CONV` order) and
    `"stack"` (the routed experts: row `e` is the concatenation of the names of `e`, `[w1, w3]` for
    `gate_up_proj`, `[w2]` for `down_proj`); and the names with no place (vision tensors are skipped, not listed).

    Raises:
        ValueError: a convolution or an expert with some of its parts missing.
    """
    prefix, head = PREFIXES[layout]
    parts, unplaced, convs, experts = {}, [], {}, {}
    for full_name in names:
        if full_name.startswith(SKIPPED_PREFIXES) and layout == "multimodal":
            continue
        if full_name == head:
            parts["lm_head.weight"] = ("one", full_name)
            continue
        name = full_name.removeprefix(prefix) if full_name.startswith(prefix) else None
        ours = rename(name, _TO_OURS) if name is not None else None
        if ours is not None:
            parts[ours] = ("one", full_name)
        elif name is not None and (match := _CONV.match(name)):
            convs.setdefault(int(match.group(1)), {})[match.group(2)] = full_name
        elif name is not None and (match := EXPERT.match(name)):
            experts.setdefault(int(match.group(1)), {})[(int(match.group(2)), match.group(3))] = full_name
        else:
            unplaced.append(full_name)
    for layer, found in sorted(convs.items()):
        missing = [part for part in CONV if part not in found]
        if missing:
            raise ValueError(f"layer {layer}'s short convolutions lack {', '.join(missing)} ({prefix}layers.{layer}."
                             "self_attn.*_conv1d.weight)")
        parts[f"model.layers.{layer}.self_attn.conv1d.weight"] = ("cat", [found[part] for part in CONV])
    for layer, found in sorted(experts.items()):
        parts |= _expert_parts(layer, found, config, prefix)
    return parts, unplaced


def to_attnres_state_dict(tensors: dict, config: KimiK3Config, layout: str) -> tuple[dict, list[str]]:
    """attnres-hf's state dict of K3's `tensors` (real or meta; MXFP4 experts already dequantised to `.weight`),
    under `layout`'s prefix (`k3_parts`); returns it and the names with no place (vision tensors are skipped, not
    listed).

    Raises:
        ValueError: a convolution or an expert with some of its parts missing; a non-zero `A_log` padding entry.
    """
    parts, unplaced = k3_parts(tensors, config, layout)
    state = {}
    for ours, (how, names) in parts.items():
        if how == "one":
            state[ours] = to_attnres_tensor(ours, tensors[names], config, names)
        elif how == "cat":
            state[ours] = torch.cat([tensors[name] for name in names])
        else:
            state[ours] = torch.stack([torch.cat([tensors[name] for name in row]) for row in names])
    return state, unplaced


def to_attnres_tensor(ours: str, tensor: torch.Tensor, config: KimiK3Config, k3_name: str) -> torch.Tensor:
    """K3's one-to-one tensor `k3_name` as attnres-hf's `ours`: a pseudo-query `[1, hidden]` as `[hidden]`, `A_log`
    without its zero padding (`a_log_width`; `ValueError` for another length or a non-zero padding entry)."""
    if is_pseudo_query(ours):  # K3's `[1, hidden]` pseudo-query is ours `[hidden]`
        return query_as_ours(tensor)
    if ours.endswith("forget_gate.A_log"):
        heads, width = config.linear_num_heads, a_log_width(config)
        if tuple(tensor.shape) != (width,):
            raise ValueError(f"{k3_name} has shape {tuple(tensor.shape)}: K3 stores A_log as one vector of "
                             f"max(num_heads, head_dim) = {width} entries, the heads' first and zeros after")
        if tensor.device.type != "meta" and tensor[heads:].count_nonzero():
            raise ValueError(f"{k3_name} has non-zero entries past its {heads} heads: K3 pads A_log with zeros, so "
                             "this checkpoint is not K3's layout")
        return tensor[:heads]
    return tensor


def a_log_width(config: KimiK3Config) -> int:
    """The length K3 stores each KDA layer's `A_log` at: `max(heads, head_dim)` (the release: 128 for 96 heads)."""
    return max(config.linear_num_heads, config.linear_head_dim)


def _expert_parts(layer: int, parts: dict, config: KimiK3Config, prefix: str) -> dict:
    count = config.num_local_experts
    missing = [f"{e}.{w}" for e in range(count) for w in ("w1", "w2", "w3") if (e, w) not in parts]
    extra = sorted(f"{e}.{w}" for e, w in parts if e >= count)
    if missing or extra:
        what = "; ".join(f"{label} {', '.join(names[:6])}{' ...' if len(names) > 6 else ''}"
                         for label, names in (("missing", missing), ("beyond num_experts", extra)) if names)
        raise ValueError(f"layer {layer}'s routed experts ({prefix}layers.{layer}.block_sparse_moe.experts.E.wN."
                         f"weight, num_experts {count}) are incomplete: {what}")
    base = f"model.layers.{layer}.mlp.experts"
    return {f"{base}.gate_up_proj": ("stack", [[parts[(e, "w1")], parts[(e, "w3")]] for e in range(count)]),
            f"{base}.down_proj": ("stack", [[parts[(e, "w2")]] for e in range(count)])}


def k3_export_parts(names, layout: str = "text") -> tuple[dict, list[str]]:
    """Where each of K3's tensors (`layout`'s names) comes from in an attnres-hf `kimi_k3` model with tensors `names`:
    `{K3 name: (attnres-hf name, how, index)}`, `how` one of `"one"`, `"query"` (`[hidden]` as `[1, hidden]`),
    `"a_log"` (zero-padded to `a_log_width`), `"conv"` (part `index` of `CONV`), `"gate"`, `"up"` (expert `index`'s
    half of `gate_up_proj`) and `"down"` (expert `index` of `down_proj`, whose `experts` count is read from the
    name's own tensor by `k3_piece`'s caller: `index` runs over it); and the names K3's layout has no name for.
    Expert parts are listed per expert with `index` `None`, expanded by `expand_experts`."""
    prefix, head = PREFIXES[layout]
    parts, unnamed = {}, []
    for name in names:
        if name == "lm_head.weight":
            parts[head] = (name, "one", None)
        elif (k3 := rename(name, _TO_K3)) is not None:
            how = "query" if is_pseudo_query(name) else "a_log" if name.endswith("forget_gate.A_log") else "one"
            parts[prefix + k3] = (name, how, None)
        elif match := re.fullmatch(r"model\.layers\.(\d+)\.self_attn\.conv1d\.weight", name):
            for index, part in enumerate(CONV):
                parts[f"{prefix}layers.{match.group(1)}.self_attn.{part}.weight"] = (name, "conv", index)
        elif match := re.fullmatch(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)", name):
            # one entry per stacked tensor (`expand_experts` names K3's per-expert tensors)
            parts[f"{prefix}layers.{match.group(1)}.block_sparse_moe.experts.{match.group(2)}"] = (name, match.group(2),
                                                                                                None)
        else:
            unnamed.append(name)
    return parts, unnamed


def expand_experts(parts: dict, experts: int) -> dict:
    """`k3_export_parts`' result with each expert entry (`gate_up_proj` / `down_proj`, `index` `None`) as K3's
    per-expert tensors, in K3's order (`w1`, `w3` of each expert; `w2` of each)."""
    out = {}
    for k3, (name, how, index) in parts.items():
        base = k3.rpartition(".")[0]
        if how == "gate_up_proj":
            for e in range(experts):
                out[f"{base}.{e}.w1.weight"], out[f"{base}.{e}.w3.weight"] = (name, "gate", e), (name, "up", e)
        elif how == "down_proj":
            out |= {f"{base}.{e}.w2.weight": (name, "down", e) for e in range(experts)}
        else:
            out[k3] = (name, how, index)
    return out


def k3_piece(how: str, index: int | None, tensor: torch.Tensor, config: KimiK3Config) -> torch.Tensor:
    """K3's tensor `how` / `index` (`k3_export_parts`) of attnres-hf's `tensor` (for an expert part: the expert's own
    row of the stacked tensor); values and dtype unchanged, contiguous, in its own storage where it is a part."""
    if how == "query":
        return query_as_theirs(tensor)
    if how == "a_log":
        return torch.cat([tensor, tensor.new_zeros(a_log_width(config) - tensor.shape[0])])
    if how == "conv":
        return tensor.chunk(3)[index].clone()
    if how in ("gate", "up"):
        return tensor.chunk(2)[0 if how == "gate" else 1].clone()
    return tensor.clone() if how == "down" else tensor


def to_k3_state_dict(state: dict, config: KimiK3Config, layout: str = "text", strict: bool = True) -> dict:
    """K3's tensors (`layout`'s names) of an attnres-hf `kimi_k3` state dict; values and dtypes unchanged
    (pseudo-queries as `[1, hidden]`, `A_log` zero-padded to `max(heads, head_dim)` as K3 stores it). With
    `strict=False` the tensors K3's layout has no name for (another method's parameters) are left out.

    Raises:
        ValueError: naming the tensors K3's layout has no name for (`strict`).
    """
    parts, unnamed = k3_export_parts(state, layout)
    if unnamed and strict:
        raise ValueError(f"tensors with no name in K3's layout: {', '.join(sorted(unnamed)[:6])}")
    out = {}
    for k3, (name, how, index) in parts.items():
        tensor = state[name]
        if how in ("gate_up_proj", "down_proj"):
            for k3_expert, (_, part, e) in expand_experts({k3: (name, how, None)}, tensor.shape[0]).items():
                out[k3_expert] = k3_piece(part, e, tensor[e], config)
        else:
            out[k3] = k3_piece(how, index, tensor, config)
    return {name: tensor.contiguous() for name, tensor in out.items()}


# ---------------------------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------------------------

READ_AS_IS = frozenset({
    "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim",
    "qk_rope_head_dim", "v_head_dim", "num_experts", "num_experts_per_token", "num_expert_group", "topk_group",
    "num_shared_experts", "moe_renormalize", "routed_scaling_factor", "first_k_dense_replace", "moe_layer_freq",
    "hidden_act", "activation_situ_beta", "activation_situ_linear_beta", "routed_expert_hidden_size",
    "latent_moe_use_norm", "mla_use_nope", "mla_use_output_gate", "moe_router_activation_func", "linear_attn_config",
    "rms_norm_eps", "max_position_embeddings", "initializer_range", "tie_word_embeddings", "bos_token_id",
    "eos_token_id", "pad_token_id", "use_cache", "attention_dropout",
})
"""K3 text-config fields `KimiK3Config` takes as they are (`linear_attn_config` is read into its flat fields)."""

SAVED_BY_TRANSFORMERS = frozenset((set(KimiK3Config.__dataclass_fields__) - set(PreTrainedConfig.__dataclass_fields__))
                                  | set(KimiK3Config.attribute_map.values()))
"""Fields of a K3 text config re-saved through transformers' `KimiLinearConfig` (or `KimiK3Config`): its own
dataclass fields (`layer_types`, `linear_num_heads`, ...) and the names its `attribute_map` stores
(`model_max_length` for `max_position_embeddings`, ...), read as they are; `head_dim` and `qk_head_dim`, which it
derives, are recomputed (`NOT_ARCHITECTURE`)."""

CHECKED = {
    "topk_method": ("noaux_tc",),  # DeepSeek-V3's bias-corrected top-k, what the router computes
    "use_grouped_topk": (True, False),  # not read by K3's code: its router groups whenever num_expert_group > 1
    "num_nextn_predict_layers": (0, None),  # multi-token-prediction layers are not implemented
}
"""K3 fields with nothing to configure: the values accepted (others are refused, naming the field)."""

IGNORED = dict.fromkeys(("rope_parameters", "rope_theta", "rope_scaling"),
                        "K3 has no rotary embedding: its MLA is NoPE (`mla_use_nope`, refused otherwise) and KDA has "
                        "none; torchtitan's config writer adds `rope_parameters` anyway")
"""K3 text-config fields accepted and dropped: each changes nothing in K3's model (the value says why)."""

K3_DEFAULTS = {"hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32, "rms_norm_eps": 1e-6,
               "num_shared_experts": 0, "routed_scaling_factor": 1.0, "first_k_dense_replace": 0,
               "mla_use_nope": False}
"""What K3's released config class (`configuration_kimi_k3.KimiLinearConfig`, as NVIDIA/TensorRT-LLM's
`tensorrt_llm/_torch/configs/kimi_linear.py` mirrors it) reads for a field the text config leaves out, where
`KimiK3Config`'s default (transformers' Kimi Linear's) is another: a K3 text config means what K3's code reads.
(`mla_use_nope` absent is K3's rotary MLA, which its own code asserts against; refused here by name. K3's
`max_position_embeddings` default, 4096, is not taken: no K3 layer reads positions.)"""

REQUIRED = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "linear_attn_config",
            "num_experts", "num_experts_per_token", "moe_intermediate_size")
"""Fields K3's config class has no usable default for (`None`, on which K3's MLA, KDA schedule or MoE cannot be
built): a text config without one is refused by name (`linear_attn_config` may be `layer_types`, as transformers
re-saves it)."""

SPECIAL_TOKENS = ("pad_token_id", "bos_token_id", "eos_token_id")
"""The token ids of a K3 config. The release writes `pad_token_id` and `bos_token_id` only in its top-level config
(163839, 163584), so a text config without one takes the top level's (`k3_text_fields`), and one absent from both is
`None`: K3's config class would read 0, 1, 2, placeholders that are real tokens of K3's vocabulary (`padding_idx` 0
would freeze token 0's embedding in training); `None` declares none and changes no logits."""

NOT_ARCHITECTURE = frozenset({
    "model_type", "architectures", "auto_map", "dtype", "torch_dtype", "transformers_version", "_name_or_path",
    "quantization_config", "attn_res_block_size", "use_bfloat16", "return_dict", "output_attentions",
    "output_hidden_states", "torchscript", "pruned_heads", "tie_encoder_decoder", "is_decoder", "is_encoder_decoder",
    "add_cross_attention", "cross_attention_hidden_size", "chunk_size_feed_forward", "id2label", "label2id",
    "problem_type", "finetuning_task", "tokenizer_class", "prefix", "sep_token_id", "decoder_start_token_id",
    "task_specific_params", "tf_legacy_loss", "output_scores", "return_dict_in_generate", "remove_invalid_values",
    "max_length", "min_length", "do_sample", "early_stopping", "num_beams", "num_beam_groups", "diversity_penalty",
    "temperature", "top_k", "top_p", "typical_p", "repetition_penalty", "length_penalty", "no_repeat_ngram_size",
    "encoder_no_repeat_ngram_size", "bad_words_ids", "num_return_sequences", "forced_bos_token_id",
    "forced_eos_token_id", "exponential_decay_length_penalty", "suppress_tokens", "begin_suppress_tokens",
    "head_dim", "qk_head_dim",
})
"""Fields that are not the architecture: bookkeeping and the generation defaults transformers 4.x wrote into every
config (`attn_res_block_size` and `quantization_config` are read separately)."""


RELEASE_AUTO_MAP = {"AutoConfig": "configuration_kimi_k3.KimiLinearConfig",
                    "AutoModel": "modeling_kimi_linear.KimiLinearModel",
                    "AutoModelForCausalLM": "modeling_kimi_linear.KimiLinearForCausalLM"}
"""The `auto_map` of the released K3 text config: K3's own code (Moonshot's files, in the K3 release; not shipped
here), which the exported text layout names so that `trust_remote_code=True` finds it once the files are copied in."""


def remote_code_files(text_config: dict) -> list[str]:
    """The Python files a text config's `auto_map` names (`configuration_kimi_k3.py`, ...)."""
    auto_map = text_config.get("auto_map") or {}
    return sorted({reference.split(".")[0] + ".py" for reference in auto_map.values() if isinstance(reference, str)})


def k3_text_fields(fields: dict) -> dict:
    """K3's text config of a folder's whole `config.json`: `text_config` for the multimodal layout (with the top
    level's `SPECIAL_TOKENS` where it has none, as the release writes them), else `fields` itself. Not checked here:
    `text_config` may be missing or no dict (`k3_source` refuses those)."""
    if fields.get("model_type") != K3_MODEL_TYPE:
        return fields
    text = fields.get("text_config")
    if not isinstance(text, dict):
        return text
    return text | {name: fields[name] for name in SPECIAL_TOKENS if name not in text and name in fields}


def backbone_from_k3(text_config: dict) -> tuple[KimiK3Config | None, list[str]]:
    """`KimiK3Config` of K3's text config (`k3_text_fields`), and the reasons it has none (every field not
    implemented, by name). Every field is read (`READ_AS_IS`, `SAVED_BY_TRANSFORMERS`), checked (`CHECKED`), dropped
    with a reason (`IGNORED`, `NOT_ARCHITECTURE`) or refused; a field left out reads K3's default (`K3_DEFAULTS`,
    `SPECIAL_TOKENS`) or, without one, is refused (`REQUIRED`).

    Raises nothing for a bad field: every problem is in the list (a `ValueError` of `KimiK3Config` included)."""
    known = READ_AS_IS | SAVED_BY_TRANSFORMERS
    problems = [f"{name} (not a field of K3's text model attnres-hf knows)" for name in text_config
                if name not in known | NOT_ARCHITECTURE | set(CHECKED) | set(IGNORED)]
    problems += [f"{name}={text_config[name]!r} (implemented: {', '.join(map(repr, accepted))})"
                 for name, accepted in CHECKED.items() if name in text_config and text_config[name] not in accepted]
    resaved = {"linear_attn_config": "layer_types"}  # the name transformers' config writes it under
    problems += [f"{name} (absent, and K3's config class has no usable default for it)" for name in REQUIRED
                 if text_config.get(name) is None and resaved.get(name) not in text_config]
    if problems:
        return None, problems
    fields = K3_DEFAULTS | dict.fromkeys(SPECIAL_TOKENS) | {name: value for name, value in text_config.items()
                                                              if name in known}
    fields = {name: float(value) if name in _FLOAT_FIELDS and type(value) is int else value
              for name, value in fields.items()}  # JSON writers drop `.0` (jq: 4.0 -> 4)
    problems = [problem for name in SPECIAL_TOKENS if (problem := token_id_problem(
        name, fields[name], fields.get("vocab_size", KimiK3Config.vocab_size)))]
    if problems:
        return None, problems
    try:
        config = KimiK3Config(**fields)
    except Exception as error:  # huggingface_hub's strict-dataclass errors are no ValueError: one line, every reason
        return None, [" ".join(str(error).split())]
    return config, []


_FLOAT_FIELDS = frozenset(name for name, field in KimiK3Config.__dataclass_fields__.items()
                          if "float" in str(field.type))
"""`KimiK3Config` fields of type float (possibly None), which take a JSON integer as its float."""


def k3_block_size(value) -> int | None:
    """attnres-hf's `attnres_block_size` of K3's `attn_res_block_size` (decoder layers per block): twice it; `None`
    (absent) for K3's architecture without AttnRes.

    Raises:
        ValueError: anything but a positive integer or `None`.
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"attn_res_block_size must be a positive number of decoder layers, got {value!r}")
    return 2 * value


def _dense_rule(mlp_layer_types: list[str]) -> tuple[int, int] | None:
    """`(first_k_dense_replace, moe_layer_freq)` that give `mlp_layer_types` by K3's rule, if any."""
    for first in range(len(mlp_layer_types) + 1):
        for freq in range(1, len(mlp_layer_types) + 1):
            if mlp_layer_types == ["sparse" if i >= first and i % freq == 0 else "dense"
                                   for i in range(len(mlp_layer_types))]:
                return first, freq
    return None


def k3_from_backbone(config: KimiK3Config, attnres_block_size: int | None) -> tuple[dict, list[str]]:
    """K3's text config (`config.json` of the text layout) of a `kimi_k3` backbone and block size (`None`: no
    AttnRes), and the reasons there is none."""
    rule = _dense_rule(list(config.mlp_layer_types))
    problems = [] if rule else [f"mlp_layer_types {config.mlp_layer_types} (K3 makes layer i an MoE layer when "
                                "i >= first_k_dense_replace and i % moe_layer_freq == 0)"]
    if attnres_block_size is not None and attnres_block_size % 2:
        problems.append(f"attnres_block_size {attnres_block_size} (K3 seals blocks of whole decoder layers: an even "
                        "number of sub-layers)")
    if problems:
        return {}, problems
    fields = {name: getattr(config, name) for name in sorted(READ_AS_IS - {"linear_attn_config", "first_k_dense_replace",
                                                                        "moe_layer_freq"})}
    if not fields["attention_dropout"]:
        del fields["attention_dropout"]  # K3's config has none (its attention has no dropout)
    fields |= {
        "use_cache": True,  # the release's (a training run's config turns it off)
        "model_type": TEXT_MODEL_TYPE, "architectures": ["KimiLinearForCausalLM"], "auto_map": RELEASE_AUTO_MAP,
        "first_k_dense_replace": rule[0], "moe_layer_freq": rule[1], "topk_method": "noaux_tc",
        "use_grouped_topk": True, "num_nextn_predict_layers": 0,
        "linear_attn_config": {
            "num_heads": config.linear_num_heads, "head_dim": config.linear_head_dim,
            "short_conv_kernel_size": config.linear_conv_kernel_dim,
            "kda_layers": [i + 1 for i, kind in enumerate(config.layer_types) if kind == "linear_attention"],
            "full_attn_layers": [i + 1 for i, kind in enumerate(config.layer_types) if kind == "full_attention"],
            "use_full_rank_gate": config.linear_use_full_rank_gate, "gate_lower_bound": config.linear_lower_bound,
        },
    }
    if attnres_block_size is not None:
        fields["attn_res_block_size"] = attnres_block_size // 2
    return fields, []


__all__ = ["CHECKED", "CONV", "EXPERT", "IGNORED", "K3_DEFAULTS", "K3_MODEL_TYPE", "NOT_ARCHITECTURE", "ONE_TO_ONE",
           "PREFIXES", "READ_AS_IS", "RELEASE_AUTO_MAP", "REQUIRED", "SAVED_BY_TRANSFORMERS", "SKIPPED_PREFIXES",
           "SPECIAL_TOKENS", "TEXT_MODEL_TYPE", "a_log_width", "backbone_from_k3", "expand_experts", "k3_block_size",
           "k3_export_parts", "k3_from_backbone", "k3_parts", "k3_piece", "k3_text_fields", "remote_code_files",
           "to_attnres_state_dict", "to_attnres_tensor", "to_k3_state_dict"]
