import pytest
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


@pytest.fixture
def input_ids():
    return torch.randint(3, TINY["vocab_size"], (2, 11), generator=torch.Generator().manual_seed(1))
