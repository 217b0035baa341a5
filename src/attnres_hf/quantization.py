"""Quantized loads of an AttnRes folder through transformers' own quantizers (bitsandbytes, torchao).

Nothing here quantizes by hand: `from_pretrained(folder, quantization_config=...)` does it. The model declares its
depth-mixing modules (AttnRes routers `attn_res` / `mlp_res` / `final_res`, DenseFormer `dwa`, MUDDFormer `mudd`,
DCA `dca` / `final_dca`, mHC `attn_mhc` / `mlp_mhc`: whatever `config.depth_mixing` builds) in
`_keep_in_fp32_modules` and `_keep_in_fp32_modules_strict`, derived from the modules it holds, so the quantizers
leave them unconverted and they load in fp32 whatever `dtype` the rest takes. `lm_head` stays unquantized too
(transformers' default).

    from transformers import AutoModelForCausalLM, BitsAndBytesConfig
    nf4 = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")  # load_in_4bit=True alone is FP4
    model = AutoModelForCausalLM.from_pretrained(folder, quantization_config=nf4)

Needs the `quant` extra (`pip install "attnres-hf[quant]"`: bitsandbytes, whose CPU backend runs 4-bit and 8-bit
layers without a GPU) and, for `TorchAoConfig`, the `torchao` extra.
"""

from __future__ import annotations

import torch
from transformers import BitsAndBytesConfig, PreTrainedModel


def qlora_quantization_config(compute_dtype: torch.dtype = torch.float32) -> BitsAndBytesConfig:
    """The 4-bit load of QLoRA (Dettmers et al. 2023): NF4 weights, double quantization of the scales, matmuls in
    `compute_dtype` (fp32 on CPU; `torch.bfloat16` on a GPU)."""
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=compute_dtype,
    )


def quantized_modules(model: PreTrainedModel) -> list[str]:
    """Names (`model.layers.0.self_attn.q_proj`, ...) of the modules of a loaded model that hold a bitsandbytes or
    torchao quantized weight. Reads the parameters themselves: it shows what the quantizer did."""
    return sorted({name.rsplit(".", 1)[0] for name, param in model.named_parameters() if _is_quantized(param)})


def _is_quantized(param: torch.Tensor) -> bool:
    # bitsandbytes: `Params4bit` / `Int8Params` (int8 or packed uint8 data); torchao: tensor subclasses.
    kind = type(param.data if isinstance(param, torch.nn.Parameter) else param)
    return type(param).__name__ in {"Params4bit", "Int8Params"} or kind.__module__.startswith("torchao")



# bitsandbytes' CPU backend, on a CPU with AVX-512 BF16, repacks a `Linear4bit`'s weight at its first eval-mode no-grad
# forward for a fused inference kernel (`functional._convert_weight_packed_for_cpu`, bitsandbytes 0.49+): tiles of 32
# output rows and one scale per `blocksize` inputs, so a layer of any other shape fails there with `shape '[N, 0]' is
# invalid for input of size ...`, as a plain transformers Llama does. That kernel has no backward either: a model
# repacked by an evaluation trains on with no gradient through its 4-bit layers (torch only warns).
PACKED_OUTPUT_TILE = 32
"""Output features per tile of bitsandbytes' repacked CPU 4-bit weights (its `block_n`)."""


def cpu_4bit_repacking() -> bool:
    """Whether bitsandbytes' CPU backend repacks 4-bit weights for its AVX-512 BF16 inference kernel on this machine:
    then only some layer shapes run on the CPU (`unsupported_4bit_shapes`). False without bitsandbytes (a 4-bit load
    then fails in transformers, saying what to install)."""
    try:
        import bitsandbytes.functional as bnb_functional
    except ImportError:
        return False
    return hasattr(bnb_functional, "_convert_weight_packed_for_cpu") and bool(bnb_functional.has_avx512bf16())


def four_bit_blocksize() -> int:
    """Inputs per quantization block of a 4-bit weight as transformers loads it (bitsandbytes' `Params4bit` default;
    transformers' `BitsAndBytesConfig` does not set it)."""
    from bitsandbytes.nn import Params4bit

    return Params4bit(torch.empty(0)).blocksize


def unsupported_4bit_shapes(config, quantization_config: BitsAndBytesConfig | None = None,
                            repacking: bool | None = None, trust_remote_code: bool = False) -> list[str]:
    """The layers that a 4-bit load of a model of `config` quantizes and that bitsandbytes' CPU inference kernel
    cannot run on this machine, as `"name (in_features -> out_features)"`; empty where every shape runs (no AVX-512
    BF16, or a bitsandbytes without the repacking kernel).

    The layers are found as transformers' bitsandbytes quantizer finds them, on a meta-device model of the class
    `config.architectures` names (else `AutoModelForCausalLM`'s): every `nn.Linear` and GPT-2 `Conv1D` but the output
    embedding, the tied and fp32 modules and `llm_int8_skip_modules`. A layer runs when its `in_features` is a multiple
    of the block size (`four_bit_blocksize()`, 64) and its `out_features` of `PACKED_OUTPUT_TILE` (32). `repacking`
    overrides the detection of the kernel (`cpu_4bit_repacking()`).

    Raises:
        ValueError: transformers has no model class for `config` (or it needs `trust_remote_code`).
    """
    if not (cpu_4bit_repacking() if repacking is None else repacking):
        return []
    from transformers.pytorch_utils import Conv1D
    from transformers.quantizers.base import HfQuantizer
    from transformers.quantizers.quantizers_utils import should_convert_module

    model = _meta_model(config, trust_remote_code)
    skip = getattr(quantization_config, "llm_int8_skip_modules", None)
    keep = HfQuantizer.get_modules_to_not_convert(model, skip, model._keep_in_fp32_modules)
    blocksize, bad = four_bit_blocksize(), []
    for name, module in model.named_modules():
        if type(module) is torch.nn.Linear:
            features = module.in_features, module.out_features
        elif isinstance(module, Conv1D):  # weight (in, out)
            features = tuple(module.weight.shape)
        else:
            continue
        if should_convert_module(name, keep) and (features[0] % blocksize or features[1] % PACKED_OUTPUT_TILE):
            bad.append(f"{name} ({features[0]} -> {features[1]})")
    return bad


def _meta_model(config, trust_remote_code: bool = False) -> PreTrainedModel:
    """The model `from_pretrained` would build for `config`, on the meta device: the class `config.architectures` names
    on `transformers` (as `transformers serve` picks it), else `AutoModelForCausalLM`'s."""
    import transformers

    architecture = getattr(transformers, (getattr(config, "architectures", None) or [""])[0], None)
    with torch.device("meta"):
        if isinstance(architecture, type) and issubclass(architecture, PreTrainedModel):
            return architecture._from_config(config)
        return transformers.AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)


def check_4bit_shapes(config, quantization_config: BitsAndBytesConfig | None = None,
                      repacking: bool | None = None, trust_remote_code: bool = False) -> None:
    """Refuse, before any weight loads, a 4-bit CPU inference of a model whose layers bitsandbytes' CPU kernel cannot
    run on this machine (`unsupported_4bit_shapes`), instead of a crash at its first forward.

    Raises:
        ValueError: one line naming the rule, the first layer that breaks it and how many more do.
    """
    bad = unsupported_4bit_shapes(config, quantization_config, repacking, trust_remote_code)
    if bad:
        raise ValueError(unsupported_4bit_message(bad))


def unsupported_4bit_message(bad: list[str]) -> str:
    """The one-line refusal of `check_4bit_shapes` for the layers `bad` (`unsupported_4bit_shapes`' names)."""
    layers = f"{bad[0]} and {len(bad) - 1} more layers are" if len(bad) > 1 else f"{bad[0]} is"
    return (f"bitsandbytes' 4-bit CPU kernel on this CPU (AVX-512 BF16) needs in_features divisible by "
            f"{four_bit_blocksize()} and out_features by {PACKED_OUTPUT_TILE}; {layers} not: serve or evaluate this "
            f"model unquantized, on a GPU, or on a CPU without AVX-512 BF16")


def keep_4bit_layers_trainable(model: torch.nn.Module) -> int:
    """Turn off bitsandbytes' CPU repacking of 4-bit weights on every `Linear4bit` of `model` (QLoRA): the repacked
    kernel has no backward, so an evaluation during training (`Trainer.evaluate`, eval mode, no grad) would cut the
    gradients through every 4-bit layer from then on, and it runs only some shapes. The plain dequantize-and-matmul
    path trains, evaluates and runs every shape. A weight an earlier no-grad forward already repacked is unpacked
    with bitsandbytes' own inverse (as its `save_pretrained` does; with double quantization its scales are quantized
    again). Returns how many layers were set."""
    count = 0
    for module in model.modules():
        if not hasattr(module, "support_avx512bf16_for_cpu"):
            continue
        module.support_avx512bf16_for_cpu = False
        weight = module.weight
        if getattr(getattr(weight, "quant_state", None), "packing_format_for_cpu", False):
            from bitsandbytes.functional import _convert_weight_packed_for_cpu_inverse

            weight.data, weight.quant_state = _convert_weight_packed_for_cpu_inverse(weight.data, weight.quant_state)
        count += 1
    return count
