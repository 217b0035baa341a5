"""The compiled path and the static cache: `torch.compile(model, fullgraph=True)` gives the eager logits, `generate`
compiles its static-cache decode step, and static, dynamic and no cache give the same numbers for Block and Full
AttnRes in fp32 and bf16, and every depth_mixing traces as one graph. Compilation is slow on small CPUs: two compiled
tests on 2-layer models (inductor; aot_eager), and a capture-only test per method on 1-layer models."""

import pytest
import torch
from transformers import DynamicCache, StaticCache
from transformers.generation import CompileConfig

from attnres_hf.modeling.depth_mixing import DEPTH_MIXING
from utils import tiny_model


@pytest.mark.slow
def test_compiled_forward_has_no_graph_break_and_gives_the_eager_logits(input_ids):
    """Block AttnRes (two-phase inside blocks, the direct buffer read for the final router), fullgraph: a graph
    break raises."""
    torch._dynamo.reset()
    model = tiny_model(attnres_block_size=2, num_hidden_layers=2, attnres_rescale_output=True)
    assert model._can_compile_fullgraph
    compiled = torch.compile(model, fullgraph=True, dynamic=False)
    with torch.no_grad():
        eager = model(input_ids, output_depth_weights=True)
        fast = compiled(input_ids, output_depth_weights=True)
    torch.testing.assert_close(fast.logits, eager.logits, atol=1e-5, rtol=1e-5)
    for ours, theirs in zip(fast.depth_weights, eager.depth_weights, strict=True):
        torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-5)


def test_generate_compiles_its_static_cache_decode_and_matches_no_cache(input_ids):
    torch._dynamo.reset()
    model = tiny_model(attnres_block_size=1, num_hidden_layers=2)
    # aot_eager: dynamo's capture (fullgraph) and AOTAutograd's functionalization of the buffer writes, without
    # inductor's C++ build (the forward test above runs inductor)
    config = CompileConfig(fullgraph=True, dynamic=False, mode="default", backend="aot_eager")
    config._compile_all_devices = True  # transformers compiles on CPU only when asked
    kwargs = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        reference = model.generate(input_ids, use_cache=False, **kwargs)
        compiled = model.generate(input_ids, cache_implementation="static", compile_config=config, **kwargs)
    assert hasattr(model, "_compiled_call")  # the decode steps ran compiled
    torch.testing.assert_close(compiled, reference, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("block_size", [1, 2], ids=["full", "block2"])
def test_static_dynamic_and_no_cache_give_the_same_logits(block_size, dtype, input_ids):
    """Prefill 6 tokens, then decode one at a time (teacher-forced) through each cache; each step's logits equal the
    no-cache forward of the whole sequence."""
    model = tiny_model(attnres_block_size=block_size).to(dtype)
    tolerance = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=5e-2, rtol=5e-2)
    length = input_ids.shape[1]
    with torch.no_grad():
        full = model(input_ids, use_cache=False).logits.float()
        for cache in (DynamicCache(config=model.config), StaticCache(model.config, max_cache_len=length + 2)):
            out = model(input_ids[:, :6], cache=cache, use_cache=True)
            steps = [out.logits]
            for position in range(6, length):
                out = model(input_ids[:, position:position + 1], cache=cache, use_cache=True,
                            position_ids=torch.full((input_ids.shape[0], 1), position))
                steps.append(out.logits)
            torch.testing.assert_close(torch.cat(steps, dim=1).float(), full, **tolerance,
                                       msg=lambda m: f"{type(cache).__name__}: {m}")


@pytest.mark.parametrize("block_size", [1, 2], ids=["full", "block2"])
def test_generate_with_a_static_cache_matches_a_dynamic_cache(block_size, input_ids):
    model = tiny_model(attnres_block_size=block_size)
    kwargs = dict(max_new_tokens=5, min_new_tokens=5, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        dynamic = model.generate(input_ids, **kwargs)
        static = model.generate(input_ids, cache_implementation="static", **kwargs)
        none = model.generate(input_ids, use_cache=False, **kwargs)
    torch.testing.assert_close(static, dynamic, atol=0, rtol=0)
    torch.testing.assert_close(none, dynamic, atol=0, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("depth_mixing", list(DEPTH_MIXING))
def test_every_depth_mixing_traces_as_one_graph(depth_mixing, input_ids):
    """`_can_compile_fullgraph = True` holds for every method: dynamo captures the whole forward (backend "eager":
    capture only, no code generation)."""
    torch._dynamo.reset()
    model = tiny_model(depth_mixing=depth_mixing, num_hidden_layers=1)
    with torch.no_grad():
        eager = model(input_ids, output_depth_weights=True).logits
        captured = torch.compile(model, fullgraph=True, backend="eager")(input_ids, output_depth_weights=True).logits
    torch.testing.assert_close(captured, eager, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_compiled_training_step_has_no_graph_break_and_gives_the_eager_gradients(input_ids):
    """Training through the source buffer's autograd Functions and the two-phase merge (`_PartialMerge`) under
    `torch.compile(fullgraph=True)` (aot_eager: dynamo's capture of the Functions and AOTAutograd's joint graph,
    without inductor's C++ build): the eager gradients."""
    torch._dynamo.reset()
    model = tiny_model(attnres_block_size=2, num_hidden_layers=2).train()
    model(input_ids, labels=input_ids).loss.backward()
    eager = {name: param.grad.clone() for name, param in model.named_parameters()}
    model.zero_grad()
    torch.compile(model, fullgraph=True, backend="aot_eager")(input_ids, labels=input_ids).loss.backward()
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, eager[name], atol=1e-6, rtol=1e-5, msg=lambda m: f"{name}: {m}")


# ---------------------------------------------------------------------------------------------------------------
# Regional compilation: `compile_repeated_blocks`
# ---------------------------------------------------------------------------------------------------------------


def regional_step(model, input_ids):
    """Logits and every parameter's gradient of one training step."""
    model.zero_grad()
    out = model(input_ids, labels=input_ids)
    out.loss.backward()
    return out.logits.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("depth_mixing", [pytest.param(name, marks=pytest.mark.slow) if name == "mhc" else name
                                          for name in DEPTH_MIXING])
def test_compile_repeated_blocks_compiles_the_backbone_and_leaves_the_mixing_eager(depth_mixing, input_ids):
    """Every decoder layer's backbone modules (attention, MLP, norms) are compiled in place, no depth-mixing module
    is, and a training step gives the eager logits and gradients (dynamo's capture with AOTAutograd: `aot_eager`)."""
    torch._dynamo.reset()
    overrides = {"attnres_block_size": 2} if depth_mixing == "attnres" else {}
    eager = tiny_model(depth_mixing=depth_mixing, num_hidden_layers=2, **overrides).train()
    regional = tiny_model(depth_mixing=depth_mixing, num_hidden_layers=2, **overrides).train()
    regional.compile_repeated_blocks(backend="aot_eager")
    for layer in regional.model.layers:
        mixing = set(layer._mixing_type._fields)
        for name, child in layer.named_children():
            assert (child._compiled_call_impl is not None) == (name not in mixing), name
    theirs, ours = regional_step(eager, input_ids), regional_step(regional, input_ids)
    torch.testing.assert_close(ours[0], theirs[0], atol=1e-5, rtol=1e-5)
    assert ours[1].keys() == theirs[1].keys()
    for name in theirs[1]:
        torch.testing.assert_close(ours[1][name], theirs[1][name], atol=1e-5, rtol=1e-4, msg=name)


def test_regional_full_attnres_training_keeps_the_in_place_source_gradient_sums(input_ids, monkeypatch):
    """The routers run eager between the compiled regions, so Full AttnRes's sources' gradients are summed in place
    (`_SourceGrads`), not one per reader as in a traced graph."""
    from attnres_hf.modeling import attnres_buffer

    torch._dynamo.reset()
    sums = []
    original = attnres_buffer._SourceGrads.sum_rows
    monkeypatch.setattr(attnres_buffer._SourceGrads, "sum_rows",
                        lambda self, *args, **kwargs: (sums.append(1), original(self, *args, **kwargs))[1])
    model = tiny_model(attnres_block_size=1, num_hidden_layers=2).train()
    model.compile_repeated_blocks(backend="aot_eager")
    regional_step(model, input_ids)
    assert len(sums) >= model.config.num_sublayers  # every router's mixing term, added in place


@pytest.mark.slow
@pytest.mark.parametrize("block_size", [1, 2], ids=["full", "block2"])
def test_compile_repeated_blocks_generates_like_eager(block_size, input_ids):
    """Cached decoding through the compiled regions (the attention recompiles per layer: its cache index)."""
    torch._dynamo.reset()
    model = tiny_model(attnres_block_size=block_size, num_hidden_layers=2)
    kwargs = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        reference = model.generate(input_ids, **kwargs)
        model.compile_repeated_blocks(backend="aot_eager")
        torch.testing.assert_close(model.generate(input_ids, **kwargs), reference, atol=0, rtol=0)


def test_compile_repeated_blocks_raises_the_recompile_limit_only_while_a_layer_runs(input_ids):
    """Dynamo's recompile limit (the attention recompiles per layer and cache configuration) is raised to 8 x layers
    inside each decoder layer's call, forward and gradient-checkpointed recomputation, and the process's setting is
    left as it was: after `compile_repeated_blocks`, between calls and after a training step."""
    torch._dynamo.reset()
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    before, seen = getattr(config, name), []
    model = tiny_model(attnres_block_size=2, num_hidden_layers=2).train()
    model.gradient_checkpointing_enable()
    model.compile_repeated_blocks(backend="aot_eager")
    assert getattr(config, name) == before
    for layer in model.model.layers:  # (the mixing modules run eager, inside the layer's call)
        layer.mlp_res.register_forward_pre_hook(lambda module, args: seen.append(getattr(config, name)))
    model(input_ids, labels=input_ids).loss.backward()
    assert getattr(config, name) == before
    # 2 layers' forwards and their 2 recomputations under checkpointing
    assert seen == [max(before, 8 * model.config.num_hidden_layers)] * 4


def test_a_whole_model_compile_traces_through_the_regional_layers(input_ids):
    """After `compile_repeated_blocks`, `torch.compile(model, fullgraph=True)` (a decoding compile; transformers'
    `generate` with a static cache) still traces one graph: the layers' recompile-limit context is entered only in
    eager calls (dynamo cannot trace `config.patch`: `Unsupported`, a skipped function)."""
    torch._dynamo.reset()
    model = tiny_model(attnres_block_size=2, num_hidden_layers=2).eval()
    with torch.no_grad():
        reference = model(input_ids).logits
        model.compile_repeated_blocks(backend="eager")
        compiled = torch.compile(model, fullgraph=True, backend="eager")(input_ids).logits
    torch.testing.assert_close(compiled, reference, atol=1e-5, rtol=1e-5)
