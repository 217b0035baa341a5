"""Write tiny HF models to GGUF the way llama.cpp's `convert_hf_to_gguf.py` does, with the `gguf` package's writer:
llama.cpp tensor names, Llama's q/k rows (weights and biases) permuted for its rope layout, Gemma's norm weights
stored as `1 + w` (`Gemma2Model` / `Gemma3Model.modify_tensors`), mixture-of-experts weights as stacked
`ffn_{gate,up,down}_exps` tensors (the HF `gate_up_proj` split into its gate and up halves), Qwen2-MoE's
shared-expert gate as a 1-D tensor, biases kept, 1-D tensors in F32, the metadata keys each converter class writes
(`key_length` from `head_dim`, expert counts and sizes, Phi-3's `rope.dimension_count` and sliding window, Gemma's
soft-capping, sliding window and rope scaling); and tiny byte-level BPE vocabularies with a declared
`tokenizer.ggml.pre`."""

from pathlib import Path

import gguf
import numpy as np
import torch

# HF model_type -> llama.cpp architecture (llama.cpp writes Mistral 7B as "llama", naming it in general.name)
# and Mixtral as "llama" with stacked expert tensors (`LlamaModel` is registered for MixtralForCausalLM)
ARCHES = {"llama": "llama", "mistral": "llama", "mixtral": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
          "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe", "phi3": "phi3", "gemma2": "gemma2", "gemma3_text": "gemma3"}
NORM_PLUS_ONE = {"gemma2", "gemma3"}  # convert_hf_to_gguf.py adds 1 to every `*norm.weight` of these
FILE_TYPES = {
    "F32": (gguf.GGMLQuantizationType.F32, gguf.LlamaFileType.ALL_F32),
    "F16": (gguf.GGMLQuantizationType.F16, gguf.LlamaFileType.MOSTLY_F16),
    "Q8_0": (gguf.GGMLQuantizationType.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0),
}


def _llama_cpp_permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp stores Llama q/k rows interleaved per head (its rope pairs x[2i], x[2i+1])."""
    return weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:]).swapaxes(1, 2).reshape(
        weights.shape
    )


def _add_metadata(writer, config, arch_name: str, head_dim: int, key_length: bool) -> None:
    """The metadata keys `convert_hf_to_gguf.py`'s class for `arch_name` writes."""
    rope = config.rope_parameters
    rope = rope.get("full_attention", rope)  # Gemma3: per layer type; the file holds the global layers' theta
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    if key_length and (getattr(config, "head_dim", None) is not None or arch_name.startswith("gemma")):
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    if arch_name == "llama":
        writer.add_rope_dimension_count(head_dim)
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
    if arch_name in ("qwen2moe", "qwen3moe"):
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    if arch_name == "qwen2moe":
        writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
    if arch_name == "phi3":  # Phi3MiniModel.set_gguf_parameters
        writer.add_rope_scaling_orig_ctx_len(rope.get("original_max_position_embeddings")
                                             or config.original_max_position_embeddings)
        writer.add_rope_dimension_count(int(rope.get("partial_rotary_factor", 1.0) * config.hidden_size)
                                        // config.num_attention_heads)
        writer.add_sliding_window(config.sliding_window or 0)  # 0: no window (Phi-4)
    if arch_name == "gemma2":  # Gemma2Model.set_gguf_parameters
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
        writer.add_sliding_window(config.sliding_window)
    if arch_name == "gemma3":  # Gemma3Model.set_gguf_parameters (and TextModel's rope scaling)
        if config.final_logit_softcapping:
            writer.add_final_logit_softcapping(config.final_logit_softcapping)
        if "sliding_attention" in config.layer_types:  # omitted for a model without sliding layers
            writer.add_sliding_window(config.sliding_window)
        if rope.get("rope_type", "default") == "linear":
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(rope["factor"])


def _tensors(model, arch_name: str, names) -> dict[str, np.ndarray]:
    """`{GGUF name: array}` of `model`'s weights, as the converter class of `arch_name` writes them."""
    config = model.config
    tensors = {}
    for key, tensor in model.state_dict().items():
        if key == "lm_head.weight" and (config.tie_word_embeddings or arch_name in NORM_PLUS_ONE):
            continue  # Gemma: llama.cpp skips lm_head (its output is the embedding)
        data = tensor.detach().float().numpy()
        if arch_name == "llama" and ".q_proj." in key:  # weights and biases alike (convert_hf_to_gguf.py)
            data = _llama_cpp_permute(data, config.num_attention_heads)
        elif arch_name == "llama" and ".k_proj." in key:
            data = _llama_cpp_permute(data, config.num_key_value_heads)
        if arch_name in NORM_PLUS_ONE and key.endswith("norm.weight"):
            data = data + 1
        if key.endswith(".mlp.experts.gate_up_proj"):  # (experts, 2 * moe_intermediate, hidden): gate, then up
            block = key.split(".")[2]
            gate, up = np.split(data, 2, axis=1)
            tensors[f"blk.{block}.ffn_gate_exps.weight"], tensors[f"blk.{block}.ffn_up_exps.weight"] = gate, up
            continue
        if key.endswith(".mlp.shared_expert_gate.weight"):
            data = data.reshape(-1)  # (1, hidden) -> (hidden,): real Qwen2-MoE files hold it 1-D, in F32
        name = names.get_name(key, try_suffixes=(".weight", ".bias"))
        assert name is not None, key
        tensors[name if name.endswith((".weight", ".bias")) else name + ".weight"] = data
    return tensors


def write_gguf(
    model: torch.nn.Module, path: Path, file_type: str = "F32", extra_tensors: dict | None = None, vocab=None,
    key_length: bool = True, drop: tuple[str, ...] = (), metadata: dict | None = None,
) -> Path:
    """Write `model` (an HF causal LM) as llama.cpp would; `extra_tensors` adds `{gguf name: array}`, `drop` leaves
    out the named GGUF tensors, `metadata` adds `{key: str, int (uint32) or float}`; `vocab` is `(tokens, merges, pre)` for a
    byte-level BPE tokenizer; `key_length=False` leaves out `attention.key_length` / `value_length` (as older
    converters did)."""
    config = model.config
    arch_name = ARCHES[config.model_type]
    arch = next(key for key, value in gguf.MODEL_ARCH_NAMES.items() if value == arch_name)
    qtype, ftype = FILE_TYPES[file_type]
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer = gguf.GGUFWriter(str(path), arch_name)
    writer.add_name(f"tiny-{config.model_type}")
    _add_metadata(writer, config, arch_name, head_dim, key_length)
    writer.add_file_type(ftype)
    for key, value in (metadata or {}).items():
        add = writer.add_string if isinstance(value, str) else writer.add_uint32 if isinstance(value, int) else (
            writer.add_float32)
        add(key, value)
    if vocab is not None:
        tokens, merges, pre = vocab
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(pre)
        writer.add_token_list(tokens)
        writer.add_token_types([gguf.TokenType.NORMAL] * len(tokens))
        writer.add_token_merges(merges)
    for special in ("bos", "eos", "pad"):  # gguf.SpecialVocab writes the tokenizer's ids
        if getattr(config, f"{special}_token_id", None) is not None:
            getattr(writer, f"add_{special}_token_id")(getattr(config, f"{special}_token_id"))

    tensors = _tensors(model, arch_name, gguf.get_tensor_name_map(arch, config.num_hidden_layers))
    tensors.update(extra_tensors or {})
    for name, data in tensors.items():
        if name in drop:
            continue
        if data.ndim == 1 or qtype == gguf.GGMLQuantizationType.F32:  # llama.cpp keeps 1-D tensors in F32
            writer.add_tensor(name, data.astype(np.float32))
        elif qtype == gguf.GGMLQuantizationType.F16:
            writer.add_tensor(name, data.astype(np.float16))
        else:
            try:
                writer.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
            except gguf.QuantError:  # rows not a multiple of the block: convert_hf_to_gguf.py falls back to F16
                writer.add_tensor(name, data.astype(np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def llama_cpp_split(text: str, regexes) -> list[str]:
    """llama.cpp's `unicode_regex_split`, written again with the `regex` package: each regex cuts every piece the
    previous ones left into its matches and the text between them."""
    import regex

    pieces = [text]
    for pattern in regexes:
        cut = []
        for piece in pieces:
            start = 0
            for match in regex.finditer(pattern, piece):
                cut += [piece[start:match.start()]] if match.start() > start else []
                cut += [match.group()] if match.end() > match.start() else []
                start = match.end()
            cut += [piece[start:]] if start < len(piece) else []
        pieces = cut
    return pieces


def byte_level(text: str) -> str:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    spelling = bytes_to_unicode()
    return "".join(spelling[b] for b in text.encode("utf-8"))
