"""Big-model loading: layers offloaded by accelerate's hooks (`device_map` with disk offload, `device_map="auto"` with a
small `max_memory`) and empty-weight (meta-device) construction, for every `depth_mixing`.

Offloaded modules hold meta tensors outside their own forward (accelerate loads each module's weights for its forward
only), and a decoder layer's arguments, the depth state included, go through `send_to_device`, which calls `.to` on
whatever has one: a forward must read a module's weights in that module's forward, and the state must hold no module.
"""

import pytest
import torch
from accelerate import infer_auto_device_map, init_empty_weights, load_checkpoint_and_dispatch
from torch import nn
from torch.nn.utils import parametrize, prune
from transformers import AutoModelForCausalLM

from attnres_hf import AttnResForCausalLM
from attnres_hf.modeling.mixing_attnres import AttnResRouter
from utils import METHODS, variant_model

CASES = METHODS | {
    "attnres-full": {"depth_mixing": "attnres", "attnres_block_size": 1},
    # blocks of 4 sub-layers span two decoder layers: a block's phase 1 reads the routers of a layer not yet run
    "attnres-block4": {"depth_mixing": "attnres", "attnres_block_size": 4},
    "attnres-sigmoid-block4": {"depth_mixing": "attnres", "attnres_block_size": 4, "attnres_score_fn": "sigmoid"},
    "attnres-heads4": {"depth_mixing": "attnres", "attnres_block_size": 2, "attnres_num_heads": 4},  # stacked path
}
"""Every method of `DEPTH_MIXING` (`METHODS`), Full AttnRes, Block AttnRes whose blocks span layers, and a knob of the
stacked path."""

NEW_TOKENS = 4


def disk_map(model: AttnResForCausalLM, on_disk: set[int]) -> dict[str, str]:
    """Every top-level module of `model.model` and the head on the CPU, decoder layers `on_disk` offloaded to disk."""
    device_map = {f"model.{name}": "cpu" for name, _ in model.model.named_children() if name != "layers"}
    device_map |= {f"model.layers.{i}": "disk" if i in on_disk else "cpu" for i in range(len(model.model.layers))}
    return device_map | {"lm_head": "cpu"}


def small_memory_map(model: AttnResForCausalLM) -> dict[str, str]:
    """accelerate's own map for a CPU budget of a third of the weights: the rest on disk."""
    budget = sum(p.numel() * p.element_size() for p in model.parameters()) // 3
    return infer_auto_device_map(model, max_memory={"cpu": budget},
                                 no_split_module_classes=model._no_split_modules)


MAPS = {
    "disk-layers-1-2": lambda model: disk_map(model, {1, 2}),
    "disk-layer-1": lambda model: disk_map(model, {1}),  # a resident layer after an offloaded one
    "infer-auto-device-map": small_memory_map,
}


@pytest.fixture(params=list(CASES), scope="module")
def reference(request, tmp_path_factory):
    """A saved variant (mixing parameters trained-like), its logits and depth weights, and its greedy tokens."""
    folder = tmp_path_factory.mktemp(request.param)
    model = variant_model(CASES[request.param])
    model.save_pretrained(folder)
    prompt = torch.randint(3, 99, (2, 7), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        out = model(prompt, output_depth_weights=True)
    tokens = model.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False)
    return folder, model, prompt, out, tokens


def assert_same_model(model, reference):
    """Logits and depth weights of the prompt, and greedy generation, as the resident model's.

    Weights are read back bit for bit from safetensors, and every method but Block AttnRes runs the same operators
    offloaded: measured max |delta| 0.0. Offloaded Block AttnRes takes the direct router path instead of two-phase
    blocks (hooks manage the routers' weights): measured <= 1.6e-7 on logits (|logit| <= 0.42) and <= 5.4e-7 on depth
    weights; the tolerances are tests/test_two_phase.py's between those two paths.
    """
    _, _, prompt, out, tokens = reference
    with torch.no_grad():
        offloaded = model(prompt, output_depth_weights=True)
    torch.testing.assert_close(offloaded.logits, out.logits, atol=1e-5, rtol=1e-5)
    if out.depth_weights is None:
        assert offloaded.depth_weights is None
    else:
        assert len(offloaded.depth_weights) == len(out.depth_weights)
        for got, want in zip(offloaded.depth_weights, out.depth_weights):
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    assert torch.equal(model.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False), tokens)


def offloaded_modules(model) -> set[str]:
    return {name for name, module in model.named_modules()
            if getattr(getattr(module, "_hf_hook", None), "offload", False)}


@pytest.mark.parametrize("map_name", list(MAPS))
def test_offloaded_layers_generate_as_the_resident_model(reference, map_name, tmp_path):
    folder, model, *_ = reference
    device_map = MAPS[map_name](model)
    assert "disk" in device_map.values(), device_map
    loaded = AutoModelForCausalLM.from_pretrained(folder, device_map=device_map, offload_folder=tmp_path).eval()
    assert offloaded_modules(loaded)  # accelerate's offload hooks are in place
    assert any(p.device.type == "meta" for p in loaded.parameters())  # offloaded weights live outside their forward
    assert_same_model(loaded, reference)


def test_device_map_auto_with_a_small_max_memory(reference, tmp_path):
    folder, model, *_ = reference
    budget = sum(p.numel() * p.element_size() for p in model.parameters()) // 3
    loaded = AutoModelForCausalLM.from_pretrained(folder, device_map="auto", max_memory={"cpu": budget},
                                                  offload_folder=tmp_path).eval()
    assert "disk" in set(loaded.hf_device_map.values()) and offloaded_modules(loaded)
    assert_same_model(loaded, reference)


@pytest.mark.slow
def test_empty_weights_construction_then_dispatch_with_offload(reference, tmp_path):
    """accelerate's big-model recipe: build on the meta device, then load the checkpoint with layers on disk."""
    folder, model, *_ = reference
    with init_empty_weights():
        empty = AttnResForCausalLM(model.config)
    assert {p.device.type for p in empty.parameters()} == {"meta"}
    empty.tie_weights()
    loaded = load_checkpoint_and_dispatch(empty, str(folder), device_map=disk_map(empty, {1, 2}),
                                          offload_folder=str(tmp_path), no_split_module_classes=empty._no_split_modules)
    assert_same_model(loaded.eval(), reference)


def test_meta_device_construction_runs_shapes_and_materialises(reference):
    """Built under `torch.device("meta")`: the names, shapes and dtypes of a real model; a forward (with and
    without autograd) gives the shapes on the meta device; materialised and loaded, the resident model's numbers."""
    folder, model, prompt, out, _ = reference
    with torch.device("meta"):
        empty = AttnResForCausalLM(model.config).eval()
    real = {n: (p.shape, p.dtype) for n, p in model.named_parameters()}
    assert {n: (p.shape, p.dtype) for n, p in empty.named_parameters()} == real
    assert {p.device.type for p in empty.parameters()} == {"meta"}
    for grad in (False, True):
        with torch.set_grad_enabled(grad):
            shapes = empty(prompt.to("meta"), output_depth_weights=True)
        assert shapes.logits.shape == out.logits.shape and shapes.logits.device.type == "meta"
        if out.depth_weights is not None:
            assert [w.shape for w in shapes.depth_weights] == [w.shape for w in out.depth_weights]
    empty.to_empty(device="cpu").load_state_dict(model.state_dict())
    with torch.no_grad():  # torch restores no non-persistent buffer (the rotary inv_freq), for any model
        for name, buffer in model.named_buffers():
            empty.get_buffer(name).copy_(buffer)
    assert_same_model(empty, reference)


def modules_in(value, seen=None) -> list[str]:
    """The `nn.Module`s reachable from `value` through tuples, lists, dicts and plain objects' attributes."""
    seen = set() if seen is None else seen
    if id(value) in seen or isinstance(value, (torch.Tensor, str, int, float, bool, type(None))):
        return []
    seen.add(id(value))
    if isinstance(value, nn.Module):
        return [type(value).__name__]
    if isinstance(value, dict):
        children = value.values()
    elif isinstance(value, (tuple, list)):
        children = value
    else:
        children = getattr(value, "__dict__", {}).values()
    return [name for child in children for name in modules_in(child, seen)]


@pytest.mark.parametrize("grad", [False, True], ids=["inference", "training"])
@pytest.mark.parametrize("case", list(CASES))
def test_the_depth_state_between_layers_holds_no_module(case, grad):
    model = variant_model(CASES[case])
    states = []
    for layer in model.model.layers:
        layer.register_forward_pre_hook(lambda module, args: states.append(args[0]))
    prompt = torch.randint(3, 99, (1, 5), generator=torch.Generator().manual_seed(0))
    with torch.set_grad_enabled(grad):
        model(prompt)
    assert len(states) == len(model.model.layers)
    for state in states:
        assert not modules_in(state), f"{type(state).__name__} carries {modules_in(state)}"


def router_names(model) -> list[str]:
    return [name for name, _ in model.named_modules() if name.endswith(("attn_res", "mlp_res", "final_res"))]


def unhooked_run(model, prompt, monkeypatch):
    """The unhooked model's outputs (two-phase blocks: it merges), and the list its later merges append to."""
    merges = []
    merge = AttnResRouter._merge
    monkeypatch.setattr(AttnResRouter, "_merge", lambda self, *args: merges.append(1) or merge(self, *args))
    with torch.no_grad():
        plain = model(prompt, output_depth_weights=True)
    assert merges  # the unhooked model runs two-phase blocks
    merges.clear()
    return merges, plain


def assert_direct_path_numbers(hooked, plain):
    """The direct path's numbers are the two-phase path's, to its tolerance (tests/test_two_phase.py: 1e-5 on logits,
    1e-6 on depth weights)."""
    torch.testing.assert_close(hooked.logits, plain.logits, atol=1e-5, rtol=1e-5)
    for got, want in zip(hooked.depth_weights, plain.depth_weights, strict=True):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("case", ["attnres", "attnres-block4", "attnres-sigmoid-block4"])
def test_hooked_routers_are_each_read_in_their_own_forward_only(case, monkeypatch):
    """When a hook intercepts the routers' forwards (a pre-hook here; accelerate's offload replaces `forward`), no
    block's phase 1 reads the routers of later layers ahead of time: every router is called once, in depth order,
    with its state, and its own read computes its weights (the direct path). Same numbers as the two-phase path of the
    unhooked model, to its tolerance (tests/test_two_phase.py: 1e-5 on logits, 1e-6 on depth weights)."""
    model, prompt = variant_model(CASES[case]), torch.randint(3, 99, (2, 6), generator=torch.Generator().manual_seed(6))
    merges, plain = unhooked_run(model, prompt, monkeypatch)
    calls = []
    for name in router_names(model):
        model.get_submodule(name).register_forward_pre_hook(
            lambda module, args, name=name: calls.append((name, type(args[0]).__name__)))
    with torch.no_grad():
        hooked = model(prompt, output_depth_weights=True)
    assert calls == [(name, "AttnResState") for name in router_names(model)] and not merges
    assert_direct_path_numbers(hooked, plain)


@pytest.mark.parametrize("case", ["attnres-block4", "attnres-sigmoid-block4"])
def test_hooked_decoder_layers_turn_off_the_query_bank(case, monkeypatch):
    """A pre-forward hook on the decoder layers (FSDP2's `fully_shard` gathers a layer's sharded parameters in one)
    means the routers' weights are only there in their layer's forward: no bank is read before the layers run, and no
    block merges; the same numbers as the unhooked model, to the two-phase path's tolerance."""
    model, prompt = variant_model(CASES[case]), torch.randint(3, 99, (2, 6), generator=torch.Generator().manual_seed(7))
    merges, plain = unhooked_run(model, prompt, monkeypatch)
    for layer in model.model.layers:
        layer.register_forward_pre_hook(lambda module, args: None)
    with torch.no_grad():
        hooked = model(prompt, output_depth_weights=True)
    assert not merges
    assert_direct_path_numbers(hooked, plain)


def pruned_model(overrides: dict) -> AttnResForCausalLM:
    """A variant whose routers' queries and key-norm weights are pruned at random (the same masks every call)."""
    model = variant_model(overrides)
    torch.manual_seed(0)
    for name in router_names(model):
        prune.random_unstructured(model.get_submodule(name), "query", amount=0.5)
        prune.random_unstructured(model.get_submodule(name).key_norm, "weight", amount=0.3)
    return model


@pytest.mark.parametrize("grad", [False, True], ids=["inference", "training"])
@pytest.mark.parametrize("case", ["attnres", "attnres-full", "attnres-block4", "attnres-sigmoid-block4",
                                  "attnres-heads4"])
def test_router_weights_that_a_forward_hook_computes_are_the_ones_read(case, grad):
    """torch's pruning keeps `query_orig` and a mask, and a forward pre-hook computes `query` (the key norm's weight
    likewise): every path reads what the modules' forwards see. Reference: the pruning made permanent (plain
    parameters holding the same values, on the two-phase path where the pruned model takes the direct one: the
    tolerances are tests/test_two_phase.py's between those paths)."""
    pruned, permanent = pruned_model(CASES[case]), pruned_model(CASES[case])
    for name in router_names(permanent):
        prune.remove(permanent.get_submodule(name), "query")
        prune.remove(permanent.get_submodule(name).key_norm, "weight")
    prompt = torch.randint(3, 99, (2, 6), generator=torch.Generator().manual_seed(4))
    with torch.set_grad_enabled(grad):
        got, want = pruned(prompt).logits, permanent(prompt).logits
    assert not torch.allclose(want, variant_model(CASES[case])(prompt).logits, atol=1e-3)  # pruning matters
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    if grad:
        got.square().mean().backward()
        want.square().mean().backward()
        for name in router_names(pruned):  # d/d query_orig = mask * d/d query
            router = pruned.get_submodule(name)
            expected = router.query_mask * permanent.get_submodule(name).query.grad
            torch.testing.assert_close(router.query_orig.grad, expected, atol=1e-5, rtol=1e-4)


class Doubled(nn.Module):
    def forward(self, weight):
        return 2 * weight


@pytest.mark.parametrize("case", ["attnres", "attnres-full", "attnres-block4", "attnres-heads4"])
def test_a_parametrized_key_norm_weight_is_read_as_its_parametrization_computes_it(case):
    """`torch.nn.utils.parametrize` moves the weight into `parametrizations.weight.original` and computes it on
    access: the routers read the computed weight on every path. Reference: the same values as plain parameters."""
    model, plain = variant_model(CASES[case]), variant_model(CASES[case])
    for name in router_names(model):
        parametrize.register_parametrization(model.get_submodule(name).key_norm, "weight", Doubled())
        with torch.no_grad():
            plain.get_submodule(name).key_norm.weight.mul_(2)
    prompt = torch.randint(3, 99, (2, 6), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        # (the direct path against the plain model's two-phase blocks: tests/test_two_phase.py's tolerance)
        torch.testing.assert_close(model(prompt).logits, plain(prompt).logits, atol=1e-5, rtol=1e-5)


def materialise_in_forward(layer: nn.Module) -> None:
    """FSDP2-like: `layer`'s routers hold zeros outside its forward, their values brought in by a forward pre-hook
    (and put away by a forward hook), as `fully_shard` gathers a layer's sharded parameters."""
    queries = [layer.get_submodule(name).query for name in ("attn_res", "mlp_res")]
    values = [query.data for query in queries]

    def put_away(*args):
        for query in queries:
            query.data = torch.zeros_like(query.data)

    def bring_in(*args):
        for query, value in zip(queries, values):
            query.data = value

    put_away()
    layer.register_forward_pre_hook(bring_in)
    layer.register_forward_hook(put_away)


@pytest.mark.parametrize("wrapper", ["checkpoint_wrapper", "offload_wrapper"])
@pytest.mark.parametrize("case", ["attnres-full", "attnres-block4"])
def test_a_hook_on_the_layer_a_wrapper_wraps_turns_off_the_query_bank(case, wrapper):
    """A decoder layer whose hook brings its routers' weights in, wrapped afterwards (torch's `checkpoint_wrapper` or
    `offload_wrapper`: `model.layers` holds the wrapper, whose own hooks are none): the bank is not read ahead of time
    from the weights outside the forward (zeros here), and the logits are the plain model's (the direct path's
    tolerance against two-phase blocks)."""
    from torch.distributed.algorithms._checkpoint import checkpoint_wrapper as wrappers

    model, plain = variant_model(CASES[case]), variant_model(CASES[case])
    for index, layer in enumerate(model.model.layers):
        materialise_in_forward(layer)
        model.model.layers[index] = getattr(wrappers, wrapper)(layer)
    prompt = torch.randint(3, 99, (2, 6), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        torch.testing.assert_close(model(prompt).logits, plain(prompt).logits, atol=1e-5, rtol=1e-5)


KEY_NORM_EDITS = {
    "one-removed": ({}, lambda model: setattr(model.model.layers[1].mlp_res, "key_norm", None)),
    "one-added": ({"attnres_key_norm": False}, lambda model: add_key_norm(model.model.layers[0].attn_res)),
}
"""Routers whose key norm the config does not describe: one router's removed, or one added where the config has
none."""


def add_key_norm(router: AttnResRouter) -> None:
    from attnres_hf.modeling.mixing_base import AttnResRMSNorm

    router.key_norm = AttnResRMSNorm(router.query.shape[0])
    with torch.no_grad():
        router.key_norm.weight.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(9))


@pytest.mark.parametrize("edit", list(KEY_NORM_EDITS))
@pytest.mark.parametrize("case", ["attnres-full", "attnres-block4"])
def test_routers_whose_key_norm_the_config_does_not_describe_read_as_the_reference(case, edit):
    """Each router reads with its own key norm or without one, whatever the config says: logits with and without
    gradients, the routers' gradients and greedy decoding (the fewest-calls reads) against the reference's stacked
    reads (`attnres_implementation="naive"`: each router's own `_logits`), to the two-phase path's tolerances."""
    extra, apply = KEY_NORM_EDITS[edit]
    model = variant_model(CASES[case] | extra)
    reference = variant_model(CASES[case] | extra, attnres_implementation="naive")
    for each in (model, reference):
        apply(each)
    prompt = torch.randint(3, 99, (2, 6), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        torch.testing.assert_close(model(prompt).logits, reference(prompt).logits, atol=1e-5, rtol=1e-5)
    got, want = model(prompt).logits, reference(prompt).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    got.square().mean().backward()
    want.square().mean().backward()
    for name in router_names(model):
        torch.testing.assert_close(model.get_submodule(name).query.grad, reference.get_submodule(name).query.grad,
                                   atol=1e-5, rtol=1e-4)
    assert torch.equal(model.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False),
                       reference.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False))
