"""Helpers shared by the tests: the tiny model-tester configuration, models, tokenizer and corpus."""

import torch

from attnres_hf import AttnResConfig, AttnResForCausalLM

TINY = dict(
    vocab_size=99,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)


OTHER_PROCESS_ATOL = 1e-5
"""Logits of the same model and code computed in another process (remote code in a fresh interpreter): its thread
count may differ from this process's (the subprocess starts with torch's default; `OMP_NUM_THREADS=1` here), which
reorders fp32 reductions. Measured: 6.0e-7 on tiny models' logits (magnitude 1-3) with `OMP_NUM_THREADS=1` in the
test process, 0 with equal thread counts."""


FOUR_BIT_SHAPE = dict(hidden_size=64, intermediate_size=128)
"""Tiny-model layer shapes that bitsandbytes' 4-bit CPU kernels run on every CPU: its AVX-512 BF16 kernel needs
in_features divisible by 64 and out_features by 32 (`attnres_hf.quantization.unsupported_4bit_shapes`)."""


def tiny_config(**overrides) -> AttnResConfig:
    """transformers' model-tester size: vocab 99, hidden 32; 3 layers = 6 sub-layers, GQA 4/2 heads."""
    return AttnResConfig(**{**TINY, **overrides})


def randomize_routers(model: torch.nn.Module, seed: int = 0, scale: float = 1.0) -> None:
    """Give every router a non-zero pseudo-query and a non-trivial key-norm weight (trained-like routers)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".query"):
                param.copy_(torch.randn(param.shape, generator=generator) * scale)
            elif "_res.key_norm" in name:
                param.copy_(1 + 0.3 * torch.randn(param.shape, generator=generator))


def tiny_model(seed: int = 0, routers: bool = True, **overrides) -> AttnResForCausalLM:
    torch.manual_seed(seed)
    model = AttnResForCausalLM(tiny_config(**overrides)).eval()
    if routers:
        randomize_routers(model, seed)
    return model


def write_tiny_model_dir(folder):
    """A saved tiny AttnRes model with its tokenizer in `folder / "model"`, and a counting corpus beside it."""
    model = tiny_model(routers=False, attnres_block_size=2)
    model.save_pretrained(folder / "model")
    word_tokenizer().save_pretrained(folder / "model")
    (folder / "train.txt").write_text(counting_text())
    return folder


def word_tokenizer():
    """A word-level tokenizer over `w3 .. w98` (+ pad/bos/eos), built offline for the tiny models."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2} | {f"w{i}": i for i in range(3, TINY["vocab_size"])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


def counting_text(lines: int = 400, seed: int = 0, length: int = 24) -> str:
    """A learnable synthetic language: each line counts upwards (mod 96) from a random word."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for start in torch.randint(0, 96, (lines,), generator=generator).tolist():
        out.append(" ".join(f"w{3 + (start + k) % 96}" for k in range(length)))
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------------------------
# The depth-mixing family, parametrised from the method records
# ---------------------------------------------------------------------------------------------------------------

from attnres_hf.modeling.depth_mixing import DEPTH_MIXING, MIXING_MODULES, ROUTER_METHODS  # noqa: E402

BLOCK_METHODS = ROUTER_METHODS
"""The methods whose routers read blocks (`attnres_block_size`): AttnRes and Delta AttnRes."""

METHODS = {name: {"depth_mixing": name} | ({"attnres_block_size": 2} if name in BLOCK_METHODS else {})
           for name in DEPTH_MIXING}
"""One tiny variant per method of `DEPTH_MIXING` (Block AttnRes and Block Delta AttnRes with blocks of 2 sub-layers)."""

ATTNRES_KNOBS = {
    "window2": {"attnres_window": 2},
    "heads4": {"attnres_num_heads": 4},
    "sigmoid": {"attnres_score_fn": "sigmoid"},
    "scalar": {"attnres_scalar_weights": True},
    "input-query": {"attnres_query": "input_dependent"},
    "no-key-norm": {"attnres_key_norm": False},
}
"""A non-default value of every knob the AttnRes record owns (`test_every_attnres_knob_has_a_variant` checks)."""

VARIANTS = METHODS | {f"attnres-{knob}": {"attnres_block_size": 2, **value} for knob, value in ATTNRES_KNOBS.items()}
"""Every method, and AttnRes under every knob."""


def perturb_mixing(model: torch.nn.Module, seed: int = 0) -> None:
    """Move every depth-mixing parameter away from its initialisation, as training would."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, MIXING_MODULES):
                for name, param in module.named_parameters():
                    # (Delta AttnRes's gates by more: its read is added to the stream, not the whole input)
                    scale = 0.05 if name.startswith("phi") or name == "query_proj" else 2.0 if name == "gate" else 0.5
                    param.add_(scale * torch.randn(param.shape, generator=generator))


def variant_model(overrides: dict, seed: int = 0, perturb: bool = True, **extra) -> AttnResForCausalLM:
    """A tiny model of one variant, its mixing parameters perturbed (trained-like) unless `perturb=False`."""
    torch.manual_seed(seed)
    model = AttnResForCausalLM(tiny_config(**overrides, **extra)).eval()
    if perturb:
        perturb_mixing(model, seed)
    return model
