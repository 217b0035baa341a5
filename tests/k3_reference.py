"""Independent float64 reference for the Kimi K3 text backbone, plus a writer of tiny K3-layout checkpoints.

Written from the K3 specs (`k3_spec_modules.md` = "M", `k3_spec_layout.md` = "L"; section numbers cited inline).
It deliberately imports neither `attnres_hf` nor `transformers.models.*`: it is what the library's K3 backbone and
loader are tested against.

Public: `tiny_k3_text_config`, `DELETE`, `MXFP4_OVERRIDES`, `RELEASE_MLA_LATENT_NORM_EPS`, `K3_CONFIG_DEFAULTS`,
`write_k3_checkpoint`, `k3_reference_logits`, `k3_reference_depth_weights`, `mxfp4_encode`, `mxfp4_decode`,
`compressed_tensors_mxfp4_encode` (the one function here that runs a library's code: compressed-tensors', which makes
a release's MXFP4).
"""

import copy
import json
import os

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

RELEASE_MLA_LATENT_NORM_EPS = 1e-6
"""The eps of MLA's latent norms (`q_a_layernorm`, `kv_a_layernorm`) in K3's released `modeling_kimi_linear.py`: it
builds them as `KimiRMSNorm(rank)`, the class's default eps, whatever `rms_norm_eps` says, while every other norm there
passes `eps=config.rms_norm_eps` (DeepSeek-V3's MLA, which it adapts, does the same). Read in two public copies of the
release's file (commit c5d1dd4): Ascend/MindSpeed-MM `mindspeed_mm/fsdp/models/kimi_k3/modeling_kimi_linear.py` and
576469377/MiniFrontier `minifrontier/models/minikimik3/upstream_layers.py`. torchtitan's `kimi_k3` and an MLX port
build them at `rms_norm_eps` instead. A parameter of the reference (`mla_latent_norm_eps`), so that a test can tell
the two choices apart rather than mirror one."""

K3_CONFIG_DEFAULTS = {"rms_norm_eps": 1e-6, "routed_scaling_factor": 1.0, "num_shared_experts": 0,
                      "first_k_dense_replace": 0, "moe_layer_freq": 1, "num_expert_group": 1, "topk_group": 1,
                      "moe_renormalize": True, "moe_router_activation_func": "sigmoid", "tie_word_embeddings": False}
"""What K3's released config class (`configuration_kimi_k3.KimiLinearConfig`, as NVIDIA/TensorRT-LLM's
`tensorrt_llm/_torch/configs/kimi_linear.py` mirrors it) reads for a field a text config leaves out, for the fields
this reference reads."""

DELETE = object()
"""Sentinel: `tiny_k3_text_config(key=DELETE)` removes `key` (also inside a `linear_attn_config` override)."""

MXFP4_OVERRIDES = {"hidden_size": 64, "routed_expert_hidden_size": 32, "moe_intermediate_size": 32}
"""Expert input dims divisible by 32, as `write_k3_checkpoint(..., mxfp4_experts=True)` needs."""

MXFP4_QUANTIZATION_CONFIG = {  # the release's block, verbatim (L §3.1)
    "config_groups": {"group_0": {
        "format": "mxfp4-pack-quantized", "input_activations": None, "output_activations": None,
        "targets": ["Linear"],
        "weights": {"actorder": None, "block_structure": None, "dynamic": False, "group_size": 32, "num_bits": 4,
                    "observer": "minmax", "observer_kwargs": {}, "scale_dtype": "torch.uint8", "strategy": "group",
                    "symmetric": True, "type": "float", "zp_dtype": None}}},
    "format": "mxfp4-pack-quantized", "global_compression_ratio": None,
    "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
               "re:.*lm_head.*", "re:.*vision_tower.*", "re:.*mm_projector.*"],
    "kv_cache_scheme": None, "quant_method": "compressed-tensors", "quantization_status": "compressed",
}

_TINY_TEXT_CONFIG = {
    "model_type": "kimi_linear", "architectures": ["KimiLinearForCausalLM"],
    "auto_map": {"AutoConfig": "configuration_kimi_k3.KimiLinearConfig",
                 "AutoModel": "modeling_kimi_linear.KimiLinearModel",
                 "AutoModelForCausalLM": "modeling_kimi_linear.KimiLinearForCausalLM"},
    "vocab_size": 96, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 5,
    "num_attention_heads": 2, "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "initializer_range": 0.02,
    "max_position_embeddings": 128, "tie_word_embeddings": False, "num_nextn_predict_layers": 0,
    "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 95, "dtype": "float32", "use_cache": True,
    "hidden_act": "situ", "activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0,
    # MLA (M §4): 0-based layers 1 and 4
    "q_lora_rank": 16, "kv_lora_rank": 8, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8,
    "mla_use_nope": True, "mla_use_output_gate": True,
    # KDA (M §5): head_dim 8 > num_heads 2, so A_log is stored padded
    "linear_attn_config": {"num_heads": 2, "head_dim": 8, "short_conv_kernel_size": 4, "kda_layers": [1, 3, 4],
                           "full_attn_layers": [2, 5], "use_full_rank_gate": True, "gate_lower_bound": -5.0},
    # AttnRes (M §7): 5 layers in blocks of 2, the last block partial
    "attn_res_block_size": 2,
    # latent MoE + router (M §2, §3); layer 0 dense
    "num_experts": 8, "num_experts_per_token": 3, "moe_intermediate_size": 16, "routed_expert_hidden_size": 16,
    "latent_moe_use_norm": True, "moe_router_activation_func": "sigmoid", "topk_method": "noaux_tc",
    "use_grouped_topk": True, "num_expert_group": 2, "topk_group": 1, "moe_renormalize": True,
    "routed_scaling_factor": 1.5, "num_shared_experts": 2, "first_k_dense_replace": 1, "moe_layer_freq": 1,
}


def _merge(base: dict, overrides: dict) -> dict:
    for key, value in overrides.items():
        if value is DELETE:
            base.pop(key, None)
        elif key == "linear_attn_config" and isinstance(value, dict) and isinstance(base.get(key), dict):
            base[key] = _merge(base[key], value)
        else:
            base[key] = value
    return base


def tiny_k3_text_config(**overrides) -> dict:
    """A tiny raw K3 `text_config` (hidden 32, vocab 96, 5 layers: KDA, MLA, KDA, KDA, MLA) with every K3 feature on.

    `overrides` update the dict; a `DELETE` value removes the key; a dict under `linear_attn_config` is merged.
    """
    return _merge(copy.deepcopy(_TINY_TEXT_CONFIG), overrides)


# ----------------------------------------------------------------------------------------------- MXFP4 (L §3.3)

_E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)


def mxfp4_encode(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`[out, in]` float -> (`weight_packed` uint8 `[out, in/2]`, `weight_scale` uint8 E8M0 `[out, in/32]`).

    Per group of 32 input columns the scale is the smallest power of two with `max|w| / scale <= 6`; each value is
    rounded to the nearest E2M1 magnitude (ties to the smaller), sign in bit 3; low nibble = even column.
    """
    out_dim, in_dim = weight.shape
    if in_dim % 32:
        raise ValueError(f"MXFP4 needs an input dim divisible by 32, got {in_dim}")
    groups = weight.double().reshape(out_dim, in_dim // 32, 32)
    amax = groups.abs().amax(-1, keepdim=True)
    exponent = torch.ceil(torch.log2(amax / 6)).clamp(-127, 127)  # all-zero group: -inf -> -127
    scaled = groups / torch.exp2(exponent)
    magnitude = (scaled.abs()[..., None] - _E2M1).abs().argmin(-1)
    codes = (magnitude | (((scaled < 0) & (magnitude > 0)).long() << 3)).reshape(out_dim, in_dim)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)
    return packed, (exponent[..., 0] + 127).to(torch.uint8)


def compressed_tensors_mxfp4_encode(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`mxfp4_encode`'s contract, by compressed-tensors as a release's MXFP4 is made: `weight` rounded to bf16, each
    block's E8M0 scale by its `calculate_qparams` of the block's min and max (a min-max observer's), the codes by
    `MXFP4PackedCompressor.compress`. Its scales can differ from `mxfp4_encode`'s (which takes the smallest power of
    two with max|w| / scale <= 6: a larger scale where the block's max is at most 3 of it), and so can ties."""
    from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.utils import calculate_qparams

    args = QuantizationArgs(num_bits=4, type="float", strategy="group", group_size=32, symmetric=True,
                            scale_dtype=torch.uint8)
    weight = weight.to(torch.bfloat16)
    blocks = weight.unflatten(-1, (weight.shape[-1] // 32, 32))
    scale, _ = calculate_qparams(blocks.amin(-1), blocks.amax(-1), args)
    out = MXFP4PackedCompressor.compress({"weight": weight, "weight_scale": scale},
                                         QuantizationScheme(targets=["Linear"], weights=args))
    return out["weight_packed"], out["weight_scale"]


def mxfp4_decode(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """(`[out, in/2]` uint8, `[out, in/32]` uint8) -> float32 `[out, in]`: E2M1 value times `2 ** (scale - 127)`."""
    out_dim = packed.shape[0]
    codes = torch.stack([packed & 15, packed >> 4], -1).reshape(out_dim, -1).long()
    values = _E2M1[codes & 7] * (1 - 2 * (codes >> 3))
    groups = values.reshape(out_dim, scale.shape[1], -1) * torch.exp2(scale.double() - 127)[..., None]
    return groups.reshape(out_dim, -1).float()


# ------------------------------------------------------------------------------------------ config predicates

def _is_kda(cfg: dict, layer: int) -> bool:
    """1-based `kda_layers` vs 0-based layer indices (L §1.2, M §7)."""
    return (layer + 1) in cfg["linear_attn_config"]["kda_layers"]


def _is_moe(cfg: dict, layer: int) -> bool:
    """M §3: `num_experts > 0 and layer >= first_k_dense_replace and layer % moe_layer_freq == 0`."""
    return bool(cfg.get("num_experts")) and layer >= cfg.get("first_k_dense_replace", 0) \
        and layer % cfg.get("moe_layer_freq", 1) == 0


# ------------------------------------------------------------------------------------------ checkpoint writer

_FP32_SUFFIXES = ("conv1d.weight", "A_log", "dt_bias", "o_norm.weight", "e_score_correction_bias")  # L §2.4, §2.7


def _k3_shapes(cfg: dict) -> list:
    """`(name without prefix, shape, kind)` for every text tensor; kind picks the init in `_random`."""
    H, la = cfg["hidden_size"], cfg["linear_attn_config"]
    kh, kd, P = la["num_heads"], la["head_dim"], la["num_heads"] * la["head_dim"]
    nh, dn, dr, dv = cfg["num_attention_heads"], cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    qr, kvr = cfg.get("q_lora_rank"), cfg["kv_lora_rank"]
    out = []
    for i in range(cfg["num_hidden_layers"]):
        p, a, m = f"layers.{i}.", f"layers.{i}.self_attn.", f"layers.{i}.block_sparse_moe."
        out += [(p + "input_layernorm.weight", [H], "norm"), (p + "post_attention_layernorm.weight", [H], "norm")]
        if cfg.get("attn_res_block_size") is not None:  # on every layer, layer 0 included (inert there): L §2.3
            out += [(p + f"{r}_{t}.weight", [H] if t == "norm" else [1, H], "norm" if t == "norm" else "res_proj")
                    for r in ("self_attention_res", "mlp_res") for t in ("norm", "proj")]
        if _is_kda(cfg, i):  # L §2.4
            for n in "qkv":
                out += [(a + f"{n}_proj.weight", [P, H], "proj"),
                        (a + f"{n}_conv1d.weight", [P, 1, la["short_conv_kernel_size"]], "conv")]
            out += [(a + "f_a_proj.weight", [kd, H], "proj"), (a + "f_b_proj.weight", [P, kd], "proj"),
                    (a + "b_proj.weight", [kh, H], "proj")]
            out += [(a + "g_proj.weight", [P, H], "proj")] if la.get("use_full_rank_gate", False) else \
                [(a + "g_a_proj.weight", [kd, H], "proj"), (a + "g_b_proj.weight", [P, kd], "proj")]
            out += [(a + "A_log", [max(kh, kd)], "A_log"), (a + "dt_bias", [P], "bias"),
                    (a + "o_norm.weight", [kd], "norm"), (a + "o_proj.weight", [H, P], "proj")]
        else:  # L §2.5
            out += [(a + "q_a_proj.weight", [qr, H], "proj"), (a + "q_a_layernorm.weight", [qr], "norm"),
                    (a + "q_b_proj.weight", [nh * (dn + dr), qr], "proj")] if qr else \
                [(a + "q_proj.weight", [nh * (dn + dr), H], "proj")]
            out += [(a + "kv_a_proj_with_mqa.weight", [kvr + dr, H], "proj"),
                    (a + "kv_a_layernorm.weight", [kvr], "norm"),
                    (a + "kv_b_proj.weight", [nh * (dn + dv), kvr], "proj")]
            out += [(a + "g_proj.weight", [nh * dv, H], "proj")] if cfg.get("mla_use_output_gate") else []
            out += [(a + "o_proj.weight", [H, nh * dv], "proj")]
        if _is_moe(cfg, i):  # L §2.7
            E, I, R = cfg["num_experts"], cfg["moe_intermediate_size"], cfg.get("routed_expert_hidden_size")
            out += [(m + "gate.weight", [E, H], "proj"), (m + "gate.e_score_correction_bias", [E], "bias")]
            if R:
                out += [(m + "routed_expert_down_proj.weight", [R, H], "proj")]
                out += [(m + "routed_expert_norm.weight", [R], "norm")] if cfg.get("latent_moe_use_norm") else []
                out += [(m + "routed_expert_up_proj.weight", [H, R], "proj")]
            R = R or H
            out += [(m + f"experts.{e}.{w}.weight", shape, "expert") for e in range(E)
                    for w, shape in (("w1", [I, R]), ("w2", [R, I]), ("w3", [I, R]))]
            if cfg.get("num_shared_experts"):
                S = I * cfg["num_shared_experts"]
                out += [(m + f"shared_experts.{n}_proj.weight", shape, "proj")
                        for n, shape in (("gate", [S, H]), ("up", [S, H]), ("down", [H, S]))]
        else:  # L §2.6
            Id = cfg["intermediate_size"]
            out += [(p + f"mlp.{n}_proj.weight", shape, "proj")
                    for n, shape in (("gate", [Id, H]), ("up", [Id, H]), ("down", [H, Id]))]
    out += [("embed_tokens.weight", [cfg["vocab_size"], H], "embed"), ("norm.weight", [H], "norm")]
    if cfg.get("attn_res_block_size") is not None:
        out += [("output_attn_res_norm.weight", [H], "norm"), ("output_attn_res_proj.weight", [1, H], "res_proj")]
    if not cfg.get("tie_word_embeddings"):
        out += [("lm_head.weight", [cfg["vocab_size"], H], "proj")]
    return out


def _random(shape, kind, num_heads, gen) -> torch.Tensor:
    noise = torch.randn(shape, generator=gen)
    if kind == "norm":
        return 1 + 0.1 * noise
    if kind == "A_log":  # per-head values, zero tail (M §5 "A_log shape trap")
        return torch.cat([0.5 * noise[:num_heads], torch.zeros(shape[0] - num_heads)])
    return noise * {"res_proj": 0.5, "bias": 0.1, "conv": 0.5, "embed": 1.0}.get(kind, 0.2)


def write_k3_checkpoint(folder, text_config: dict, *, seed: int = 0, layout: str = "multimodal",
                        dtype: torch.dtype = torch.float32, mxfp4_experts: bool = False,
                        with_vision: bool = True, mxfp4_encoder=mxfp4_encode) -> dict[str, torch.Tensor]:
    """Write a K3-layout folder (config.json, 2 safetensors shards, model.safetensors.index.json) of random weights.

    `layout="multimodal"`: `language_model.model.*` / `language_model.lm_head.weight`, the release's top-level config
    (L §1.1) and, with `with_vision`, a few `vision_tower.*`/`mm_projector.*` tensors. `layout="text"`: `model.*` /
    `lm_head.weight`, config.json = the text config. `mxfp4_experts` stores routed experts as `weight_packed` +
    `weight_scale` (L §3.3; expert input dims must divide by 32: see `MXFP4_OVERRIDES`), encoded by `mxfp4_encoder`
    (`mxfp4_encode`, or `compressed_tensors_mxfp4_encode` as a release is made). Seeded weights: projections
    std 0.2, norms 1 + 0.1 noise, `*_res_proj` std 0.5. Returns `{name: tensor}` as written, except quantised experts,
    which appear dequantised (fp32) under their `.weight` names.
    """
    if layout not in ("multimodal", "text"):
        raise ValueError(f"unknown layout {layout!r}")
    cfg, gen = copy.deepcopy(text_config), torch.Generator().manual_seed(seed)
    prefix, head = ("language_model.model.", "language_model.lm_head.weight") if layout == "multimodal" \
        else ("model.", "lm_head.weight")
    written, returned = {}, {}
    for name, shape, kind in _k3_shapes(cfg):
        full = head if name == "lm_head.weight" else prefix + name
        value = _random(shape, kind, cfg["linear_attn_config"]["num_heads"], gen)
        if kind == "expert" and mxfp4_experts:
            packed, scale = mxfp4_encoder(value)
            written[full + "_packed"], written[full + "_scale"] = packed, scale
            returned[full] = mxfp4_decode(packed, scale)
            continue
        value = value if name.endswith(_FP32_SUFFIXES) else value.to(dtype)
        written[full] = returned[full] = value
    if layout == "multimodal" and with_vision:  # skipped by text loaders (L §2.9); any small shapes
        for name, shape in [("vision_tower.patch_embed.proj.weight", [8, 3, 2, 2]),
                            ("vision_tower.encoder.blocks.0.wqkv.weight", [24, 8]),
                            ("vision_tower.encoder.final_layernorm.weight", [8]),
                            ("mm_projector.proj.0.weight", [32, 32]),
                            ("mm_projector.proj.2.weight", [cfg["hidden_size"], 32]),
                            ("mm_projector.post_norm.weight", [cfg["hidden_size"]])]:
            written[name] = returned[name] = (0.2 * torch.randn(shape, generator=gen)).to(dtype)

    if mxfp4_experts:
        cfg["quantization_config"] = copy.deepcopy(MXFP4_QUANTIZATION_CONFIG)
    if layout == "multimodal":
        config = {
            "architectures": ["KimiK3ForConditionalGeneration"],
            "auto_map": {"AutoConfig": "configuration_kimi_k3.KimiK3Config",
                         "AutoModel": "modeling_kimi_k3.KimiK3ForConditionalGeneration",
                         "AutoModelForCausalLM": "modeling_kimi_k3.KimiK3ForConditionalGeneration"},
            "bos_token_id": cfg.get("bos_token_id"), "eos_token_id": cfg.get("eos_token_id"),
            "pad_token_id": cfg.get("pad_token_id"), "dtype": str(dtype).removeprefix("torch."),
            "ignore_index": -100, "image_placeholder": "<|kimi_image_placeholder|>",
            "media_placeholder_token_id": 3, "model_type": "kimi_k3", "text_config": cfg,
            "tie_word_embeddings": cfg.get("tie_word_embeddings", False),
            "vision_config": {"patch_size": 2, "vt_hidden_size": 8, "vt_num_hidden_layers": 1,
                              "vt_num_attention_heads": 2, "vt_intermediate_size": 16, "mm_hidden_size": 32,
                              "text_hidden_size": cfg["hidden_size"], "merge_kernel_size": [2, 2],
                              "mm_projector_type": "patchmergerv2", "norm_type": "rmsnorm"},
        }
        if mxfp4_experts:
            config["quantization_config"] = copy.deepcopy(MXFP4_QUANTIZATION_CONFIG)
    else:
        config = cfg

    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    names, weight_map = list(written), {}
    half = (len(names) + 1) // 2
    for index, chunk in enumerate((names[:half], names[half:])):
        file = f"model-{index + 1:05d}-of-00002.safetensors"
        save_file({n: written[n].contiguous() for n in chunk}, os.path.join(folder, file), metadata={"format": "pt"})
        weight_map.update({n: file for n in chunk})
    total = sum(t.numel() * t.element_size() for t in written.values())
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    return returned


# ------------------------------------------------------------------------------------------ reference forward

def _text_weights(state_dict: dict) -> dict[str, torch.Tensor]:
    """Strip `language_model.`/`model.`, drop vision tensors, decode any packed experts, cast to float64."""
    weights = {}
    for full, tensor in state_dict.items():
        if full.startswith(("vision_tower.", "mm_projector.")) or full.endswith(".weight_scale"):
            continue
        name = full.removeprefix("language_model.").removeprefix("model.")
        if name.endswith(".weight_packed"):
            tensor, name = mxfp4_decode(tensor, state_dict[full[:-len("packed")] + "scale"]), name[:-len("_packed")]
        weights[name] = tensor.double()
    return weights


def _rms_norm(x, weight, eps):
    """`weight * x / sqrt(mean(x^2) + eps)` over the last dim (M §4 "KimiRMSNorm semantics")."""
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return normed if weight is None else weight * normed


def _gated_mlp(x, gate_w, up_w, down_w, cfg):
    """M §1: `down(situ_a(gate x) * linear_beta * tanh(up x / linear_beta))`; plain `silu(g) * u` for silu."""
    gate, up = F.linear(x, gate_w), F.linear(x, up_w)
    if cfg.get("hidden_act") == "situ":
        beta, linear_beta = cfg.get("activation_situ_beta") or 1.0, cfg.get("activation_situ_linear_beta")
        act = beta * torch.tanh(gate / beta) * torch.sigmoid(gate)
        if linear_beta is not None:
            up = linear_beta * torch.tanh(up / linear_beta)
    elif cfg.get("hidden_act", "silu") == "silu":
        act = F.silu(gate)
    else:
        raise NotImplementedError(f"hidden_act {cfg['hidden_act']!r}")
    return F.linear(act * up, down_w)


def _kda(W, p, x, cfg):
    """M §5: KDA as a naive per-token delta-rule recurrence. x `[B, T, D]` -> `[B, T, D]`."""
    la = cfg["linear_attn_config"]
    B, T, _ = x.shape
    H, K = la["num_heads"], la["head_dim"]

    def conv_branch(n):  # causal depthwise conv (left pad W-1, last tap on the current token) + SiLU
        y, w = F.linear(x, W[p + f"{n}_proj.weight"]), W[p + f"{n}_conv1d.weight"][:, 0]  # [B,T,P], [P,W]
        padded = F.pad(y, (0, 0, w.shape[1] - 1, 0))
        return F.silu(sum(padded[:, j:j + T] * w[:, j] for j in range(w.shape[1]))).view(B, T, H, K)

    def l2norm(t):
        return t / torch.sqrt(t.pow(2).sum(-1, keepdim=True) + 1e-6)

    q, k, v = l2norm(conv_branch("q")), l2norm(conv_branch("k")), conv_branch("v")
    z = F.linear(F.linear(x, W[p + "f_a_proj.weight"]), W[p + "f_b_proj.weight"]).view(B, T, H, K)
    z = z + W[p + "dt_bias"].view(H, K)
    a = W[p + "A_log"][:H].exp()[:, None]  # per head; the stored tail is padding
    lower = la.get("gate_lower_bound")
    g = lower * torch.sigmoid(a * z) if lower is not None else -a * F.softplus(z)  # log-decay [B,T,H,K]
    beta = torch.sigmoid(F.linear(x, W[p + "b_proj.weight"]))  # [B,T,H]
    state, outputs = x.new_zeros(B, H, K, K), []
    for t in range(T):
        state = state * g[:, t].exp()[..., None]
        delta = beta[:, t, :, None] * (v[:, t] - torch.einsum("bhk,bhkv->bhv", k[:, t], state))
        state = state + k[:, t, :, :, None] * delta[:, :, None, :]
        outputs.append(torch.einsum("bhk,bhkv->bhv", q[:, t] * K ** -0.5, state))
    o = torch.stack(outputs, 1)  # [B,T,H,V]
    if la.get("use_full_rank_gate", False):
        out_gate = F.linear(x, W[p + "g_proj.weight"])
    else:
        out_gate = F.linear(F.linear(x, W[p + "g_a_proj.weight"]), W[p + "g_b_proj.weight"])
    o = _rms_norm(o, W[p + "o_norm.weight"], cfg["rms_norm_eps"]) * torch.sigmoid(out_gate.view(B, T, H, K))
    return F.linear(o.reshape(B, T, H * K), W[p + "o_proj.weight"])


def _mla(W, p, x, cfg, latent_eps):
    """M §4: NoPE MLA (rope channels kept, never rotated) with the per-channel sigmoid output gate; its latent norms
    at `latent_eps`."""
    if not cfg.get("mla_use_nope", True):
        raise NotImplementedError("the reference implements only NoPE MLA (mla_use_nope true)")
    B, T, _ = x.shape
    nh, dn, dr, dv = cfg["num_attention_heads"], cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    if cfg.get("q_lora_rank"):
        q = F.linear(_rms_norm(F.linear(x, W[p + "q_a_proj.weight"]), W[p + "q_a_layernorm.weight"], latent_eps),
                    W[p + "q_b_proj.weight"])
    else:
        q = F.linear(x, W[p + "q_proj.weight"])
    q = q.view(B, T, nh, dn + dr)
    k_pass, k_rot = F.linear(x, W[p + "kv_a_proj_with_mqa.weight"]).split([cfg["kv_lora_rank"], dr], -1)
    kv = F.linear(_rms_norm(k_pass, W[p + "kv_a_layernorm.weight"], latent_eps),
                  W[p + "kv_b_proj.weight"])
    k_nope, v = kv.view(B, T, nh, dn + dv).split([dn, dv], -1)
    k = torch.cat([k_nope, k_rot[:, :, None].expand(B, T, nh, dr)], -1)  # k_rot shared by all heads
    scores = torch.einsum("bthd,bshd->bhts", q, k) * (dn + dr) ** -0.5
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
    o = torch.einsum("bhts,bshd->bthd", probs, v).reshape(B, T, nh * dv)
    if cfg.get("mla_use_output_gate"):
        o = o * torch.sigmoid(F.linear(x, W[p + "g_proj.weight"]))
    return F.linear(o, W[p + "o_proj.weight"])


def _route(W, m, x, cfg):
    """M §3: noaux_tc router on the full x `[N, D]` -> (expert ids `[N, k]`, weights `[N, k]`)."""
    logits = F.linear(x, W[m + "gate.weight"])
    scores = logits.softmax(-1) if cfg.get("moe_router_activation_func") == "softmax" else logits.sigmoid()
    choice = scores + W.get(m + "gate.e_score_correction_bias", torch.zeros(()))  # bias: selection only
    N, G, top_k = x.shape[0], cfg.get("num_expert_group") or 1, cfg["num_experts_per_token"]
    topk_group = cfg.get("topk_group") or 1
    if G > 1 and G > topk_group:  # upstream's condition, whatever `use_grouped_topk` says
        group_scores = choice.view(N, G, -1).topk(2, -1).values.sum(-1)  # [N, G]
        keep = torch.zeros_like(group_scores).scatter_(1, group_scores.topk(topk_group, -1).indices, 1)
        choice = choice.masked_fill(~keep.bool().repeat_interleave(choice.shape[1] // G, 1), float("-inf"))
    idx = choice.topk(top_k, -1).indices
    weights = scores.gather(1, idx)  # from the pre-bias scores
    if top_k > 1 and cfg.get("moe_renormalize"):
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return idx, weights * (cfg.get("routed_scaling_factor") or 1.0)


def _latent_moe(W, m, x, cfg):
    """M §2: experts run in the latent space, weighted sum, latent RMSNorm, up-proj; shared experts on x."""
    B, T, D = x.shape
    flat = x.reshape(-1, D)
    idx, weights = _route(W, m, flat, cfg)
    latent = cfg.get("routed_expert_hidden_size")
    h = F.linear(flat, W[m + "routed_expert_down_proj.weight"]) if latent else flat
    every = torch.stack([_gated_mlp(h, W[m + f"experts.{e}.w1.weight"], W[m + f"experts.{e}.w3.weight"],
                                    W[m + f"experts.{e}.w2.weight"], cfg)
                         for e in range(cfg["num_experts"])], 1)  # [N, E, L]
    u = (every.gather(1, idx[..., None].expand(-1, -1, every.shape[-1])) * weights[..., None]).sum(1)
    if latent:
        if cfg.get("latent_moe_use_norm"):
            u = _rms_norm(u, W[m + "routed_expert_norm.weight"], cfg["rms_norm_eps"])
        u = F.linear(u, W[m + "routed_expert_up_proj.weight"])
    if cfg.get("num_shared_experts"):
        s = m + "shared_experts."
        u = u + _gated_mlp(flat, W[s + "gate_proj.weight"], W[s + "up_proj.weight"], W[s + "down_proj.weight"], cfg)
    return u.view(B, T, D)


def _attn_res(partial, blocks, W, name, eps):
    """M §7 `attn_res`: softmax over [sealed blocks..., live partial] of `(norm.w * proj.w) . RMS(candidate)`.

    Candidates `[B, T, n, D]`; returns (the mix of the RAW candidates `[B, T, D]`, weights `[B, T, n]`).
    """
    values = torch.stack(blocks + [partial], -2)
    query = W[name + "_norm.weight"] * W[name + "_proj.weight"][0]
    weights = (_rms_norm(values, None, eps) * query).sum(-1).softmax(-1)
    return (weights[..., None] * values).sum(-2), weights


def _forward(state_dict, text_config, input_ids, attention_mask, mla_latent_norm_eps):
    cfg = K3_CONFIG_DEFAULTS | text_config.get("text_config", text_config)  # a field left out reads K3's default
    latent_eps = cfg["rms_norm_eps"] if mla_latent_norm_eps is None else mla_latent_norm_eps
    if attention_mask is not None and not bool(torch.as_tensor(attention_mask).bool().all()):
        raise NotImplementedError("the K3 reference supports no padding: attention_mask must be all ones")
    W, eps, block = _text_weights(state_dict), cfg["rms_norm_eps"], cfg.get("attn_res_block_size")

    def attention(i, h):
        h = _rms_norm(h, W[f"layers.{i}.input_layernorm.weight"], eps)
        if _is_kda(cfg, i):
            return _kda(W, f"layers.{i}.self_attn.", h, cfg)
        return _mla(W, f"layers.{i}.self_attn.", h, cfg, latent_eps)

    def mlp(i, h):
        p = f"layers.{i}."
        h = _rms_norm(h, W[p + "post_attention_layernorm.weight"], eps)
        if _is_moe(cfg, i):
            return _latent_moe(W, p + "block_sparse_moe.", h, cfg)
        return _gated_mlp(h, W[p + "mlp.gate_proj.weight"], W[p + "mlp.up_proj.weight"], W[p + "mlp.down_proj.weight"],
                          cfg)

    x, blocks, reads = W["embed_tokens.weight"][input_ids], [], []
    for i in range(cfg["num_hidden_layers"]):
        if block is None:  # M §7 "Plain residual fallback": pre-norm residual
            x = x + attention(i, x)
            x = x + mlp(i, x)
            continue
        # M §7 decoder layer: x is the live partial sum, `blocks` the sealed ones
        h = x
        if blocks:  # no pre-attention read at layer 0
            h, w = _attn_res(x, blocks, W, f"layers.{i}.self_attention_res", eps)
            reads.append(("attn", i, w))
        sealed = i % block == 0  # seal after the pre-attention read, before attention
        if sealed:
            blocks = blocks + [x]
        a = attention(i, h)
        x = a if sealed else x + a
        h, w = _attn_res(x, blocks, W, f"layers.{i}.mlp_res", eps)
        reads.append(("mlp", i, w))
        x = x + mlp(i, h)
    if block is not None:
        x, w = _attn_res(x, blocks, W, "output_attn_res", eps)
        reads.append(("final", None, w))
    head = W["embed_tokens.weight"] if cfg.get("tie_word_embeddings") else W["lm_head.weight"]
    return F.linear(_rms_norm(x, W["norm.weight"], eps), head), reads


def k3_reference_logits(state_dict, text_config, input_ids, attention_mask=None, *,
                        mla_latent_norm_eps=RELEASE_MLA_LATENT_NORM_EPS) -> torch.Tensor:
    """K3 text forward in float64 -> logits `[batch, seq, vocab]`.

    `state_dict`: K3 HF names with the `language_model.model.` or `model.` prefix (vision tensors ignored; experts
    dequantised, or packed `weight_packed`/`weight_scale` pairs). `text_config`: the raw text config (a top-level
    multimodal config is accepted too). `input_ids` `[batch, seq]`. Padding is unsupported: an `attention_mask`
    with zeros raises. `mla_latent_norm_eps`: the eps of MLA's latent norms (the release's, by default; `None` is the
    config's `rms_norm_eps`, torchtitan's choice). A field the text config leaves out reads `K3_CONFIG_DEFAULTS`.
    """
    return _forward(state_dict, text_config, input_ids, attention_mask, mla_latent_norm_eps)[0]


def k3_reference_depth_weights(state_dict, text_config, input_ids, attention_mask=None, *,
                               mla_latent_norm_eps=RELEASE_MLA_LATENT_NORM_EPS) -> list:
    """The AttnRes reads in execution order as `(kind, layer, weights [batch, seq, n_sources])` float64 tuples.

    kind is "attn" (layers >= 1), "mlp" (every layer) or "final" (layer None); order: layer 0 mlp, layer 1 attn,
    layer 1 mlp, ..., final. Sources are [sealed blocks..., live partial sum] (M §7). Empty for a plain residual.
    `mla_latent_norm_eps` as for `k3_reference_logits`.
    """
    return _forward(state_dict, text_config, input_ids, attention_mask, mla_latent_norm_eps)[1]
