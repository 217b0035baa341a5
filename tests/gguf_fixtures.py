"""Write tiny HF Llama / Qwen2 models to GGUF the way llama.cpp's `convert_hf_to_gguf.py` does, with the `gguf`
package's writer: llama.cpp tensor names, Llama's q/k rows permuted for its rope layout, biases kept."""

from pathlib import Path

import gguf
import numpy as np
import torch

ARCHES = {"llama": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2}


def _llama_cpp_permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp stores Llama q/k rows interleaved per head (its rope pairs x[2i], x[2i+1])."""
    return weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:]).swapaxes(1, 2).reshape(
        weights.shape
    )


def write_gguf(model: torch.nn.Module, path: Path, dtype=np.float32) -> Path:
    config = model.config
    arch_name = config.model_type
    arch = ARCHES[arch_name]
    writer = gguf.GGUFWriter(str(path), arch_name)
    writer.add_name(f"tiny-{arch_name}")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    if arch_name == "llama":
        writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32 if dtype == np.float32 else gguf.LlamaFileType.MOSTLY_F16)

    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    for key, tensor in model.state_dict().items():
        if key == "lm_head.weight" and config.tie_word_embeddings:
            continue
        data = tensor.detach().float().numpy()
        if arch_name == "llama" and key.endswith("q_proj.weight"):
            data = _llama_cpp_permute(data, config.num_attention_heads)
        elif arch_name == "llama" and key.endswith("k_proj.weight"):
            data = _llama_cpp_permute(data, config.num_key_value_heads)
        name = names.get_name(key, try_suffixes=(".weight", ".bias"))
        assert name is not None, key
        # llama.cpp keeps 1-D tensors (norms, biases) in F32 whatever the file type
        writer.add_tensor(name, data.astype(dtype if data.ndim > 1 else np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
