"""The private torch names of the modeling code (`torch_internals.py`) and their public fallbacks: AttnRes training
under `torch.func.grad` and under compiled autograd gives eager autograd's gradients, and without the private names
(another torch) every fallback gives the same gradients as the in-place source-gradient sums.

Gradients are compared as `test_two_phase.assert_same_grads` does (the same sums in another order: 256 fp32 ulps of
each tensor's largest element, rtol 1e-4); measured here: `torch.func.grad` up to 27 ulps (its stacked reads sum in
another order), compiled autograd up to 4."""

import pytest
import torch
from torch.func import functional_call

from attnres_hf.modeling import attnres_buffer, attnres_two_phase, torch_internals
from test_two_phase import assert_same_grads
from utils import tiny_model

BLOCK_SIZES = dict(argvalues=[1, 2], ids=["full", "block2"])


def loss_of(model, input_ids, params=None):
    """The language-model loss of `model` on `input_ids`, with `params` (name -> tensor) in place of its own."""
    kwargs = dict(labels=input_ids, use_cache=False)
    if params is None:
        return model(input_ids, **kwargs).loss
    return functional_call(model, params, (input_ids,), kwargs).loss


def eager_grads(model, input_ids) -> dict[str, torch.Tensor]:
    model.zero_grad()
    loss_of(model, input_ids).backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def hide_private_names(monkeypatch):
    """A torch without the private names `torch_internals` reads."""
    for name in ("current_graph_task_id", "queue_callback", "global_forward_pre_hooks",
                 "are_functorch_transforms_active"):
        monkeypatch.setattr(torch_internals, name, None)


def count_calls(monkeypatch, owner, name) -> list:
    """Record each call of `owner.name` (a staticmethod or function), which still runs."""
    calls, original = [], getattr(owner, name)
    monkeypatch.setattr(owner, name, lambda *args, **kwargs: calls.append(1) or original(*args, **kwargs))
    return calls


@pytest.mark.parametrize("block_size", **BLOCK_SIZES)
def test_torch_func_grad_gives_eager_autograds_gradients(block_size, input_ids, monkeypatch):
    """`torch.func.grad` over the parameters (the depth state keeps its sources stacked: the transforms take neither
    the buffer's in-place writes nor its autograd Functions), against eager autograd's in-place sums."""
    model = tiny_model(attnres_block_size=block_size).train()
    reference = eager_grads(model, input_ids)
    slots = count_calls(monkeypatch, attnres_buffer._SourceSlot, "apply")
    params = {name: p.detach() for name, p in model.named_parameters()}
    grads = torch.func.grad(lambda p: loss_of(model, input_ids, p))(params)
    assert not slots and grads.keys() == reference.keys()
    assert_same_grads(grads, reference)


def compiled_autograd_grads(model, input_ids, compiler) -> dict[str, torch.Tensor]:
    """The gradients of an eager forward (which makes the in-place sums) and a backward run by compiled autograd,
    its graph given to `compiler`."""
    torch._dynamo.reset()
    model.zero_grad()
    loss = loss_of(model, input_ids)
    with torch._dynamo.compiled_autograd._enable(compiler):
        loss.backward()
    torch._dynamo.reset()
    return {name: p.grad for name, p in model.named_parameters()}


@pytest.mark.parametrize("block_size", **BLOCK_SIZES)
def test_compiled_autograd_gives_eager_autograds_gradients(block_size, input_ids):
    """Compiled autograd runs its graph (here as captured: the custom Functions' backwards called eagerly inside it),
    so no pass of it has a graph-task id to use and the readers return one gradient per source
    (`_SourceGrads.open`)."""
    model = tiny_model(attnres_block_size=block_size, num_hidden_layers=2).train()
    reference = eager_grads(model, input_ids)
    assert_same_grads(compiled_autograd_grads(model, input_ids, lambda graph: graph), reference)


@pytest.mark.slow
def test_compiled_autograd_with_dynamo_gives_eager_autograds_gradients(input_ids):
    """The same with dynamo tracing the graph, the custom Functions' backwards included (block 2: phase 1, the merges
    and the final router's direct read; about 25 s here)."""
    model = tiny_model(attnres_block_size=2, num_hidden_layers=1).train()
    reference = eager_grads(model, input_ids)
    assert_same_grads(compiled_autograd_grads(model, input_ids, torch.compile(backend="eager")), reference)


@pytest.mark.parametrize("block_size", **BLOCK_SIZES)
def test_a_backward_pass_without_an_id_takes_per_source_gradients(block_size, input_ids, monkeypatch):
    """A forward that made the in-place sums, then a backward pass without a graph-task id (what compiled autograd
    sees, run eagerly): the slots' handles receive the per-source gradients, to the parameters and to a leaf
    `inputs_embeds`."""
    model = tiny_model(attnres_block_size=block_size).train()
    embeds = model.get_input_embeddings()(input_ids).detach()
    results = []
    for hidden in (False, True):
        model.zero_grad()
        leaf = embeds.clone().requires_grad_(True)
        loss = model(inputs_embeds=leaf, labels=input_ids, use_cache=False).loss
        if hidden:
            monkeypatch.setattr(torch_internals, "current_graph_task_id", None)
        loss.backward()
        results.append({"inputs_embeds": leaf.grad, **{name: p.grad.clone() for name, p in model.named_parameters()
                                                       if p.grad is not None}})
    assert results[1].keys() == results[0].keys()
    assert_same_grads(results[1], results[0])
    own = results[1]["inputs_embeds"]  # its own storage, not a view of a reader's gradient for all its sources
    assert own.untyped_storage().nbytes() == own.numel() * own.element_size()


@pytest.mark.parametrize("block_size", **BLOCK_SIZES)
def test_without_the_private_names_every_fallback_gives_the_same_gradients(block_size, input_ids, monkeypatch):
    """No graph-task ids: autograd's per-source sums (no `_SourceSlot` handle); no global pre-hook table: hooks
    assumed, so no phase 1 (each router reads its own weights: the direct path); no functorch query:
    `torch.func.grad` still finds its wrapped tensors (`torch.func.debug_unwrap`)."""
    model = tiny_model(attnres_block_size=block_size).train()
    reference = eager_grads(model, input_ids)
    hide_private_names(monkeypatch)
    slots = count_calls(monkeypatch, attnres_buffer._SourceSlot, "apply")
    merges = count_calls(monkeypatch, attnres_two_phase._PartialMerge, "apply")  # (phase 2: Block only)
    assert_same_grads(eager_grads(model, input_ids), reference)
    assert not slots and not merges
    params = {name: p.detach() for name, p in model.named_parameters()}
    assert_same_grads(torch.func.grad(lambda p: loss_of(model, input_ids, p))(params), reference)
    assert not slots


def test_the_recompile_limit_is_raised_only_inside_the_context_and_only_where_dynamo_names_it(monkeypatch):
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    before = getattr(config, name)
    with torch_internals.recompile_limit_at_least(before + 5):
        assert getattr(config, name) == before + 5
    with torch_internals.recompile_limit_at_least(0):  # (never lowered)
        assert getattr(config, name) == before
    assert getattr(config, name) == before
    monkeypatch.setattr(torch, "_dynamo", None)  # a torch without dynamo's config: the limit left alone
    with torch_internals.recompile_limit_at_least(before + 5):
        pass
    monkeypatch.undo()
    assert getattr(config, name) == before
