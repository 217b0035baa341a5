"""The tuple form of every output is the backbone family's, position by position, then `depth_weights` (issue 36,
part 3).

Code that indexes an output by position (`return_dict=False`, `output[1]`) must read what it reads from the family's
own model: Qwen3-MoE and Mixtral return `(loss, aux_loss, logits, ...)`, and the AttnRes versions returned
`(loss, logits, ..., aux_loss)`, so `output[1]` was the aux loss's place and held the logits. For every family of the
backbone table, the family's transformers model and its exact retrofit are compared element by element: the same
type (a cache's class), shapes and values, with and without labels, cache, hidden states, attentions and router
logits; `output_depth_weights=True` appends the depth weights last.

Tolerance: the retrofit is exact up to fp32 round-off (the residual sum re-associated by the routers, measured max
|Δ| 4e-7 on logits here); checked at 2e-5 as `test_backbones_moe.py`.
"""

import pytest
import torch
from transformers.cache_utils import Cache

from attnres_hf.conversion import retrofit
from attnres_hf.modeling.backbones import BACKBONES
from attnres_hf.modeling.backbones_moe import dispatch_kda_by_device
from attnres_hf.modeling.modeling_attnres import DEPTH_WEIGHTS_OUTPUTS
from test_backbones import BASE, TINY_BACKBONES
from test_backbones_moe import source_config

FAMILIES = list(BACKBONES)
ATOL = 2e-5


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)  # tiny models: one thread is faster than two contended ones (conftest restores)


def source_model(family: str):
    """The family's own causal LM at tester size, with eager attention (which returns attention weights); Kimi
    Linear's KDA on transformers' torch functions (`dispatch_kda_by_device`: with fla installed, transformers' class
    takes fla's GPU kernels on the CPU too)."""
    adapter = BACKBONES[family]
    if family in TINY_BACKBONES:
        config = adapter.config_class(**BASE, **TINY_BACKBONES[family])
    else:
        config = source_config(family)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return dispatch_kda_by_device(adapter.causal_lm(config)).eval()


def assert_same_element(got, expected, where: str) -> None:
    if isinstance(expected, Cache):
        assert type(got) is type(expected), where
    elif isinstance(expected, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.shape == expected.shape, f"{where}: {got!r:.80} vs {expected.shape}"
        torch.testing.assert_close(got, expected, atol=ATOL, rtol=0, msg=lambda m: f"{where}: {m}")
    else:
        assert isinstance(got, tuple) and isinstance(expected, tuple), f"{where}: {type(got)} vs {type(expected)}"
        assert len(got) == len(expected), where
        for i, (a, b) in enumerate(zip(got, expected)):
            assert_same_element(a, b, f"{where}[{i}]")


def assert_same_tuple(got: tuple, expected: tuple, what: str) -> None:
    assert isinstance(got, tuple) and len(got) == len(expected), f"{what}: {len(got)} vs {len(expected)} elements"
    for i, (a, b) in enumerate(zip(got, expected)):
        assert_same_element(a, b, f"{what}[{i}]")


def calls(family: str, input_ids: torch.Tensor) -> dict:
    everything = dict(use_cache=True, output_hidden_states=True, output_attentions=True)
    if BACKBONES[family].aux_loss is not None or "router_logits" in BACKBONES[family].record_outputs:
        everything["output_router_logits"] = True
    return {"plain": dict(use_cache=False), "labels": dict(labels=input_ids, use_cache=False),
            "cache": dict(use_cache=True), "everything": dict(labels=input_ids, **everything)}


@pytest.mark.parametrize("family", FAMILIES)
def test_tuples_equal_the_family_position_by_position(family):
    source = source_model(family)
    model = retrofit(source, depth_mixing="attnres", attnres_block_size=2)  # exact: zero pseudo-queries
    input_ids = torch.randint(3, 99, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for name, kwargs in calls(family, input_ids).items():
            base_kwargs = {k: v for k, v in kwargs.items() if k != "labels"}
            expected = source(input_ids, return_dict=False, **kwargs)
            assert_same_tuple(model(input_ids, return_dict=False, **kwargs), expected, f"{family} {name}")
            got = model(input_ids, return_dict=False, output_depth_weights=True, **kwargs)
            assert_same_tuple(got[:-1], expected, f"{family} {name} with depth weights")
            assert len(got[-1]) == 2 * model.config.num_hidden_layers + 1  # one per router, `final_res` last
            assert got[-1][0].shape == (*input_ids.shape, 1)  # the first router mixes the embedding only
            expected = source.model(input_ids, return_dict=False, **base_kwargs)
            assert_same_tuple(model.model(input_ids, return_dict=False, **base_kwargs), expected,
                              f"{family} base model {name}")
            got = model.model(input_ids, return_dict=False, output_depth_weights=True, **base_kwargs)
            assert_same_tuple(got[:-1], expected, f"{family} base model {name} with depth weights")
    # integer indexing reads the tuple form too: the family's aux loss / logits positions
    everything = calls(family, input_ids)["everything"]
    torch.testing.assert_close(model(input_ids, **everything)[1], source(input_ids, **everything)[1], atol=ATOL, rtol=0)


def test_every_family_output_class_has_an_attnres_output():
    """Each adapter names its family's output classes (those of its causal LM's `forward`), and each has an AttnRes
    class with `depth_weights` as its last field."""
    for family, adapter in BACKBONES.items():
        assert adapter.causal_lm.forward.__annotations__["return"] is adapter.causal_lm_output, family
        for output in (adapter.model_output, adapter.causal_lm_output):
            attnres = DEPTH_WEIGHTS_OUTPUTS[output]
            assert issubclass(attnres, output)
            assert list(attnres.__dataclass_fields__)[-1] == "depth_weights"
