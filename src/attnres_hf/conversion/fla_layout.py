"""flash-linear-attention's `TransformerForCausalLM` layout (fla 0.6, `model_type: "transformer"`): its tensor names and
config fields against attnres-hf's, both ways, and the fla options that have no exact counterpart.

fla puts Block and Full AttnRes into its transformer through one field, `attnres_block_size` (sub-layers per block,
1 = Full, as ours: DESIGN §7). Its reads are ours: before each attention (fla skips the one at layer 0, where the
embedding is the only source; ours returns that source, the same value), before each MLP and once before the final
norm, keys RMSNormed with each read's own weight and fla's `norm_eps`, values raw, no rescaling of the output (so an
imported model has `attnres_rescale_output=False`). fla keeps a pseudo-query and key norm for the layer-0 attention
read that never act; ours has the same pair (`model.layers.0.attn_res`), so they are kept and go back unchanged.

The backbone is Llama's (SwiGLU MLP, RMSNorm pre-norms, rotary attention with grouped kv heads), with three fla
options that select a transformers family: `qkv_bias` (Qwen2: biases on q, k, v, not o), `qk_norm` (Qwen3: a per-head
RMSNorm of q and k before the rotary; fla's use eps 1e-5, so only with `norm_eps` 1e-5) and `window_size` (Mistral's
sliding window: flash-attn's `(W-1, 0)` is W keys counting the query's own).
"""

from ._names import is_pseudo_query, query_as_ours, query_as_theirs, rename, rename_tables

FLA_MODEL_TYPE = "transformer"
"""`model_type` of fla's `TransformerConfig`."""

FLA_KEY_MAP = (
    # (fla tensor name, attnres-hf tensor name); `{i}` is the decoder layer
    ("model.embeddings.weight", "model.embed_tokens.weight"),
    ("model.layers.{i}.attn_norm.weight", "model.layers.{i}.input_layernorm.weight"),
    *((f"model.layers.{{i}}.attn.{p}_proj.{w}", f"model.layers.{{i}}.self_attn.{p}_proj.{w}")
      for p in "qkvo" for w in ("weight", "bias")),
    ("model.layers.{i}.attn.q_norm.weight", "model.layers.{i}.self_attn.q_norm.weight"),
    ("model.layers.{i}.attn.k_norm.weight", "model.layers.{i}.self_attn.k_norm.weight"),
    ("model.layers.{i}.mlp_norm.weight", "model.layers.{i}.post_attention_layernorm.weight"),
    *((f"model.layers.{{i}}.mlp.{p}_proj.weight", f"model.layers.{{i}}.mlp.{p}_proj.weight")
      for p in ("gate", "up", "down")),
    ("model.layers.{i}.attn_res_proj.weight", "model.layers.{i}.attn_res.query"),
    ("model.layers.{i}.attn_res_norm.weight", "model.layers.{i}.attn_res.key_norm.weight"),
    ("model.layers.{i}.mlp_res_proj.weight", "model.layers.{i}.mlp_res.query"),
    ("model.layers.{i}.mlp_res_norm.weight", "model.layers.{i}.mlp_res.key_norm.weight"),
    ("model.res_proj.weight", "model.final_res.query"),
    ("model.res_norm.weight", "model.final_res.key_norm.weight"),
    ("model.norm.weight", "model.norm.weight"),
    ("lm_head.weight", "lm_head.weight"),
)
"""The one table of names. fla's pseudo-queries are `nn.Linear(hidden, 1)` weights, `[1, hidden]`; ours are
`[hidden]` (`to_attnres_tensor`, `to_fla_tensor`): the same numbers in the same order."""

KERNEL_OPTIONS = ("fuse_norm", "fuse_swiglu", "fuse_cross_entropy", "fuse_linear_cross_entropy", "use_l2warp")
"""fla fields that choose kernels or the training loss, not the function the model computes (`use_l2warp` changes
gradients only): read and recorded, with nothing to map. `elementwise_affine` is not read by fla's transformer (its
norms are affine whatever it says)."""

FLA_FIELDS = ("hidden_size", "num_hidden_layers", "num_heads", "num_kv_heads", "qkv_bias", "qk_norm", "window_size",
              "rope_theta", "max_position_embeddings", "hidden_ratio", "intermediate_size", "hidden_act",
              "initializer_range", "elementwise_affine", "norm_eps", "use_cache", "pad_token_id", "bos_token_id",
              "eos_token_id", "tie_word_embeddings", "vocab_size", "attnres_block_size", *KERNEL_OPTIONS)
"""The fields of fla 0.6's `TransformerConfig`; a config.json key outside these and transformers' own
`PretrainedConfig` fields is refused (a newer fla's option that might change the model)."""

FLA_QK_NORM_EPS = 1e-5
"""The eps of fla's q/k norms (its `RMSNorm` default; `norm_eps` does not reach them)."""

SUPPORTED_BACKBONES = ("llama", "mistral", "qwen2", "qwen3")
"""transformers families an fla transformer is (plain, window_size, qkv_bias, qk_norm): the only ones exported."""


_TO_OURS, _TO_FLA = rename_tables(FLA_KEY_MAP)


def to_attnres_name(fla_name: str) -> str | None:
    """attnres-hf's name for fla's tensor `fla_name` (`FLA_KEY_MAP`), or `None` if it has none."""
    return rename(fla_name, _TO_OURS)


def to_fla_name(name: str) -> str | None:
    """fla's name for attnres-hf's tensor `name` (`FLA_KEY_MAP`), or `None` if it has none."""
    return rename(name, _TO_FLA)


def to_attnres_tensor(attnres_name: str, tensor):
    """fla's tensor in attnres-hf's shape: a pseudo-query `[1, D]` becomes `[D]` (a view: no value changes)."""
    return query_as_ours(tensor) if is_pseudo_query(attnres_name) else tensor


def to_fla_tensor(attnres_name: str, tensor):
    """attnres-hf's tensor in fla's shape: a pseudo-query `[D]` becomes `[1, D]` (a view)."""
    return query_as_theirs(tensor) if is_pseudo_query(attnres_name) else tensor


def fla_intermediate_size(fields: dict) -> int:
    """The MLP width fla builds: `intermediate_size`, or `hidden_size * hidden_ratio * 2/3` rounded up to a multiple of
    256 (`hidden_ratio` 4 when unset), as fla's `GatedMLP` computes it."""
    if fields.get("intermediate_size") is not None:
        return fields["intermediate_size"]
    ratio = fields.get("hidden_ratio") or 4
    width = int(fields["hidden_size"] * ratio * 2 / 3)
    return 256 * ((width + 255) // 256)


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def fla_block_size(value):
    """`attnres_block_size` as fla runs it: `true` is 1 (Full) and an integral float (`2.0`) its integer; anything
    else as written."""
    return int(value) if value is True or isinstance(value, float) and value.is_integer() else value


def check_fla_block_size(value) -> list[str]:
    """fla's rule for `attnres_block_size` (read by `fla_block_size`): `None`, 1 (Full) or an even number of
    sub-layers."""
    value = fla_block_size(value)
    if value is None or value == 1 and not isinstance(value, bool):
        return []
    if not _positive_int(value) or value % 2:
        return [f"attnres_block_size {value!r} (None, 1 for Full AttnRes, or an even number of sub-layers)"]
    return []


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _field_types(fields: dict) -> list[str]:
    """The fields whose JSON type fla's model cannot use (fla's config checks none of them), each named."""
    rules = {
        "num_kv_heads": (_positive_int, "a positive integer or null"),
        "intermediate_size": (_positive_int, "a positive integer or null"),
        "max_position_embeddings": (_positive_int, "a positive integer or null"),
        "window_size": (_positive_int, "a positive number of keys or null"),
        "hidden_ratio": (lambda v: _number(v) and v > 0, "a positive number or null"),
        "norm_eps": (lambda v: _number(v) and v > 0, "a positive number"),
        "rope_theta": (lambda v: _number(v) and v > 0, "a positive number (fla's attention always applies its rotary)"),
        "initializer_range": (lambda v: _number(v) and v >= 0, "a number"),
        **{name: (lambda v: isinstance(v, bool), "true or false")
           for name in ("qkv_bias", "qk_norm", "tie_word_embeddings", "use_cache")},
    }
    nullable = {"num_kv_heads", "intermediate_size", "max_position_embeddings", "window_size", "hidden_ratio"}
    problems = [f"{name} {fields[name]!r} ({what})" for name, (ok, what) in rules.items()
                if name in fields and not (fields[name] is None and name in nullable) and not ok(fields[name])]
    pad = fields.get("pad_token_id")
    if pad is not None and not (isinstance(pad, int) and not isinstance(pad, bool) and 0 <= pad < fields["vocab_size"]):
        problems.append(f"pad_token_id {pad!r} (a token id below vocab_size {fields['vocab_size']}, or null)")
    return problems


def backbone_from_fla(fields: dict) -> tuple[dict, list[str]]:
    """The transformers backbone config (a dict with its `model_type`) that computes fla's transformer with config
    `fields` (a `config.json` of `model_type` `"transformer"`), and the problems that leave no exact counterpart
    (each naming the field; empty when it maps).
    """
    from transformers import PretrainedConfig

    problems = []
    generic = set(PretrainedConfig().to_dict()) | {"model_type", "architectures", "auto_map", "_name_or_path", "dtype",
                                                   "torch_dtype", "transformers_version"}
    unknown = sorted(set(fields) - set(FLA_FIELDS) - generic)
    if unknown:
        problems.append(f"fields unknown to attnres-hf's fla 0.6 map (they may change the model): {', '.join(unknown)}")
    for name in ("hidden_size", "num_hidden_layers", "num_heads", "vocab_size"):
        if not _positive_int(fields.get(name)):
            problems.append(f"{name} {fields.get(name)!r} (a positive integer is needed)")
    if problems:
        return {}, problems
    problems += _field_types(fields)
    if problems:
        return {}, problems
    heads, kv_heads = fields["num_heads"], fields.get("num_kv_heads") or fields["num_heads"]
    if not _positive_int(kv_heads) or heads % kv_heads:
        problems.append(f"num_kv_heads {kv_heads!r} (must divide num_heads {heads})")
    if fields.get("hidden_act", "swish") != "swish":
        problems.append(f"hidden_act {fields['hidden_act']!r} (only 'swish', fla's SwiGLU, has a counterpart: silu)")
    problems += check_fla_block_size(fields.get("attnres_block_size"))
    eps = fields.get("norm_eps", 1e-6)
    qkv_bias, qk_norm, window = fields.get("qkv_bias", False), fields.get("qk_norm", False), fields.get("window_size")
    if qk_norm and eps != FLA_QK_NORM_EPS:
        problems.append(f"qk_norm with norm_eps {eps} (fla's q/k norms use eps {FLA_QK_NORM_EPS} whatever norm_eps "
                        "says, Qwen3's use rms_norm_eps: they agree only with norm_eps 1e-5)")
    if sum(map(bool, (qkv_bias, qk_norm, window is not None))) > 1:
        options = (("qkv_bias", qkv_bias), ("qk_norm", qk_norm), ("window_size", window is not None))
        chosen = [name for name, value in options if value]
        problems.append(f"{' and '.join(chosen)} together (no transformers family has both; each alone maps)")
    if problems:
        return {}, problems
    hidden = fields["hidden_size"]
    backbone = dict(
        model_type="qwen2" if qkv_bias else "qwen3" if qk_norm else "mistral" if window is not None else "llama",
        vocab_size=fields["vocab_size"], hidden_size=hidden, intermediate_size=fla_intermediate_size(fields),
        num_hidden_layers=fields["num_hidden_layers"], num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=hidden // heads, hidden_act="silu", rms_norm_eps=eps,
        max_position_embeddings=fields.get("max_position_embeddings") or 2048,
        rope_parameters={"rope_type": "default", "rope_theta": float(fields.get("rope_theta", 10000.0))},
        initializer_range=fields.get("initializer_range", 0.02), use_cache=fields.get("use_cache", True),
        tie_word_embeddings=fields.get("tie_word_embeddings", False), pad_token_id=fields.get("pad_token_id"),
        bos_token_id=fields.get("bos_token_id", 1), eos_token_id=fields.get("eos_token_id", 2),
    )
    if backbone["model_type"] in ("llama", "qwen3"):
        backbone |= {"attention_bias": False, **({"mlp_bias": False} if not qk_norm else {})}
    if backbone["model_type"] == "mistral":
        backbone["sliding_window"] = window
    if backbone["model_type"] in ("qwen2", "qwen3"):
        backbone |= {"use_sliding_window": False, "sliding_window": None}
    return backbone, []


def fla_from_attnres(config) -> tuple[dict, list[str]]:
    """fla `TransformerConfig` fields for the AttnRes model `config` (an `AttnResConfig`), and the problems that keep
    fla from computing it (each naming the setting; empty when it exports)."""
    problems, backbone = [], config.backbone
    kind = backbone.model_type
    if kind not in SUPPORTED_BACKBONES:
        problems.append(f"backbone {kind!r} (fla's transformer is Llama's, or Mistral/Qwen2/Qwen3's variant of it: "
                        f"{', '.join(SUPPORTED_BACKBONES)})")
        return {}, problems
    if config.depth_mixing not in ("attnres", "residual"):
        problems.append(f"depth_mixing {config.depth_mixing!r} (fla has AttnRes and the plain residual)")
    elif config.depth_mixing == "attnres":
        knobs = {"attnres_score_fn": "softmax", "attnres_key_norm": True, "attnres_window": None,
                 "attnres_query": "static", "attnres_num_heads": 1, "attnres_scalar_weights": False,
                 "attnres_rescale_output": False}
        problems += [f"{name}={getattr(config, name)!r} (fla's AttnRes has {name}={want!r})"
                     for name, want in knobs.items() if getattr(config, name) != want]
        if config.attnres_rescale_output:
            problems[-1] = problems[-1][:-1] + ("; a retrofit rescales by default: `attnres convert --paper-mean` "
                                                "makes one fla computes)")
    hidden, heads = backbone.hidden_size, backbone.num_attention_heads
    rope = getattr(backbone, "rope_parameters", None) or {}
    checks = [
        ("hidden_act", getattr(backbone, "hidden_act", "silu") == "silu", "fla's MLP is SwiGLU (silu)"),
        ("head_dim", getattr(backbone, "head_dim", None) in (None, hidden // heads),
         f"fla's heads are hidden_size / num_heads = {hidden // heads} wide"),
        ("rope_parameters", rope.get("rope_type", "default") == "default", "fla's rotary has no scaling"),
        ("mlp_bias", not getattr(backbone, "mlp_bias", False), "fla's MLP has no biases"),
    ]
    if kind in ("llama", "mistral", "qwen3"):
        checks.append(("attention_bias", not getattr(backbone, "attention_bias", False),
                       "fla's qkv_bias puts no bias on o_proj (Qwen2's layout)"))
    if kind in ("qwen2", "qwen3"):
        sliding = getattr(backbone, "use_sliding_window", False) and getattr(backbone, "sliding_window", None)
        checks.append(("use_sliding_window", not sliding, "fla's window goes with a plain (Mistral) attention"))
    if kind == "qwen3":
        checks.append(("rms_norm_eps", backbone.rms_norm_eps == FLA_QK_NORM_EPS,
                       f"fla's q/k norms use eps {FLA_QK_NORM_EPS}, Qwen3's all use rms_norm_eps"))
    problems += [f"{name}={getattr(backbone, name, None)!r} ({why})" for name, ok, why in checks if not ok]
    if problems:
        return {}, problems
    fields = dict(
        hidden_size=hidden, num_hidden_layers=backbone.num_hidden_layers, num_heads=heads,
        num_kv_heads=backbone.num_key_value_heads, qkv_bias=kind == "qwen2", qk_norm=kind == "qwen3",
        window_size=getattr(backbone, "sliding_window", None) if kind == "mistral" else None,
        rope_theta=float(rope.get("rope_theta", 10000.0)), max_position_embeddings=backbone.max_position_embeddings,
        intermediate_size=backbone.intermediate_size, hidden_act="swish",
        initializer_range=backbone.initializer_range, norm_eps=backbone.rms_norm_eps,
        use_cache=getattr(backbone, "use_cache", True), pad_token_id=backbone.pad_token_id,
        bos_token_id=backbone.bos_token_id, eos_token_id=backbone.eos_token_id,
        tie_word_embeddings=bool(getattr(backbone, "tie_word_embeddings", False)), vocab_size=backbone.vocab_size,
        attnres_block_size=config.attnres_block_size if config.depth_mixing == "attnres" else None,
    )
    return fields, []
