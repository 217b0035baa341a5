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
