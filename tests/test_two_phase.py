"""Two-phase block inference (paper Algorithm 1) and the source buffer: the same numbers as the direct router and
the reference's reads (`attnres_implementation="naive"`), for every knob they serve; gradient checkpointing; cached
decode; Full AttnRes's saved activations growing linearly in depth. (`test_routing.py` checks the default path, two-phase
included, against `naive_attnres`; tests/test_ops.py compares the reads themselves.)"""

import contextlib

import pytest
import torch

from attnres_hf.modeling import attnres_buffer, attnres_inference, attnres_two_phase, mixing_attnres
from attnres_hf.modeling.mixing_attnres import AttnResRouter
from utils import TINY, tiny_model

KNOBS = {
    "default": {},
    "rescale": dict(attnres_rescale_output=True),
    "sigmoid": dict(attnres_score_fn="sigmoid"),
    "sigmoid-rescale": dict(attnres_score_fn="sigmoid", attnres_rescale_output=True),
    "no-key-norm": dict(attnres_key_norm=False),
}


@contextlib.contextmanager
def path(name, model):
    """Take a router path by its public switches: `two-phase` (the default), `direct` (a forward pre-hook on every
    module, so that no router's weights are read outside its own forward: the buffer, no phase 1) or `naive`
    (`attnres_implementation="naive"`: the reference read, `ops_naive.attnres`, of the stacked sources)."""
    if name == "direct":
        handle = torch.nn.modules.module.register_module_forward_pre_hook(lambda module, args: None)
        try:
            yield
        finally:
            handle.remove()
    elif name == "naive":
        model.config.attnres_implementation = "naive"
        try:
            yield
        finally:
            model.config.attnres_implementation = "torch"
    else:
        yield


def run(model, input_ids, projection, **kwargs):
    model.zero_grad()
    out = model(input_ids, output_depth_weights=True, **kwargs)
    (out.logits.float() @ projection).square().mean().backward()
    return out.logits.detach(), [w.detach() for w in out.depth_weights], {
        n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same_grad(grad, reference, name=""):
    """The same gradient summed in another order: within 256 fp32 ulps of the tensor's largest element (at least
    1e-5), and rtol 1e-4. Measured on an AVX-512 Xeon: up to 36 ulps on the embedding's gradient (it sums every reader's
    at every position of a token, elements up to 63, so an absolute 1e-5 failed on its small elements) and up to 193 on
    the router's gradients; the other CPU kinds' kernels sum in other orders again."""
    atol = max(1e-5, 256 * torch.finfo(torch.float32).eps * reference.abs().max().item())
    torch.testing.assert_close(grad, reference, atol=atol, rtol=1e-4, msg=lambda m: f"{name}: {m}")


def assert_same_grads(grads, reference, scale=1.0):
    """`grads` equal `scale` times `reference` (name -> gradient), to fp32 round-off of another summation order."""
    for name, grad in grads.items():
        assert_same_grad(grad, scale * reference[name], name)


@pytest.mark.parametrize("knobs", list(KNOBS))
@pytest.mark.parametrize("block_size", [1, 2, 4, 6], ids=["full", "block2", "block4-partial-last", "block6-one"])
def test_two_phase_direct_and_naive_paths_agree(block_size, knobs, input_ids, monkeypatch):
    model = tiny_model(attnres_block_size=block_size, **KNOBS[knobs]).train()
    projection = torch.randn(model.config.vocab_size, generator=torch.Generator().manual_seed(2))
    merged = []
    monkeypatch.setattr(AttnResRouter, "_merge", lambda self, *a, _f=AttnResRouter._merge: merged.append(1) or _f(
        self, *a))
    results = {}
    for name in ("two-phase", "direct", "naive"):
        with path(name, model):
            merged.clear()
            results[name] = run(model, input_ids, projection)
            if name == "two-phase":  # every router but the final one merges, unless blocks are single sub-layers
                assert len(merged) == (0 if block_size == 1 else model.config.num_sublayers)
            else:
                assert not merged
    logits, weights, grads = results["two-phase"]
    assert len(grads) == len(dict(model.named_parameters()))
    for other in ("direct", "naive"):
        other_logits, other_weights, other_grads = results[other]
        torch.testing.assert_close(logits, other_logits, atol=1e-5, rtol=1e-5)
        for ours, theirs in zip(weights, other_weights, strict=True):
            torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-5)
        assert_same_grads(grads, other_grads)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_two_phase_in_half_precision_matches_the_naive_path(dtype, input_ids):
    """bf16/fp16: finite, fp32 depth weights, and the reference's numbers to the half precision's round-off. The
    reference sums in fp32 where the torch paths sum in the stream dtype, so the two round apart: measured on a Zen 4
    EPYC, depth weights 0.020 apart in bf16 (each 0.02-0.04 from the float64 model's) and 0.0016 in fp16."""
    model = tiny_model(attnres_block_size=2).to(dtype)
    weight_atol = 4e-2 if dtype == torch.bfloat16 else 1e-2
    with torch.no_grad():
        fast = model(input_ids, output_depth_weights=True)
        with path("naive", model):
            slow = model(input_ids, output_depth_weights=True)
    assert fast.logits.dtype == dtype and torch.isfinite(fast.logits).all()
    torch.testing.assert_close(fast.logits.float(), slow.logits.float(), atol=3e-2, rtol=3e-2)
    for ours, theirs in zip(fast.depth_weights, slow.depth_weights, strict=True):
        assert ours.dtype == torch.float32
        torch.testing.assert_close(ours, theirs, atol=weight_atol, rtol=1e-2)


@pytest.mark.parametrize("block_size", [1, 4], ids=["full", "block4"])
def test_depth_weights_off_gives_the_same_logits_and_gradients(block_size, input_ids):
    model = tiny_model(attnres_block_size=block_size).train()
    with_weights = model(input_ids, labels=input_ids, output_depth_weights=True)
    with_weights.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    without = model(input_ids, labels=input_ids)
    without.loss.backward()
    assert without.depth_weights is None
    torch.testing.assert_close(without.logits, with_weights.logits, atol=0, rtol=0)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, grads[name], atol=0, rtol=0)


@pytest.mark.parametrize("block_size", [1, 2, 4], ids=["full", "block2", "block4"])
def test_gradient_checkpointing_replays_the_buffer_exactly(block_size, input_ids):
    """The buffer is written in place; a checkpointed layer's replay rewrites its slot and must not change a
    gradient (nor trip autograd's version counter), with and without depth weights."""
    model = tiny_model(attnres_block_size=block_size, attnres_rescale_output=True).train()
    projection = torch.randn(model.config.vocab_size, generator=torch.Generator().manual_seed(3))
    _, plain_weights, plain = run(model, input_ids, projection)
    model.gradient_checkpointing_enable()
    for keep in (True, False):
        model.zero_grad()
        out = model(input_ids, output_depth_weights=keep)
        (out.logits @ projection).square().mean().backward()
        for name, param in model.named_parameters():
            torch.testing.assert_close(param.grad, plain[name], atol=1e-6, rtol=1e-5, msg=lambda m: f"{name}: {m}")
        if keep:
            for ours, theirs in zip(out.depth_weights, plain_weights, strict=True):
                torch.testing.assert_close(ours, theirs, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("block_size", [1, 2], ids=["full", "block2"])
def test_cached_decode_steps_match_a_full_forward(block_size, dtype, input_ids):
    """Prefill, then one token at a time through the KV cache: each step's logits equal a full forward's."""
    model = tiny_model(attnres_block_size=block_size).to(dtype)
    tolerance = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=5e-2, rtol=5e-2)
    with torch.no_grad():
        full = model(input_ids).logits
        out = model(input_ids[:, :6], use_cache=True)
        steps = [out.logits]
        for position in range(6, input_ids.shape[1]):
            out = model(input_ids[:, position:position + 1], cache=out.cache, use_cache=True)
            steps.append(out.logits)
    torch.testing.assert_close(torch.cat(steps, dim=1).float(), full.float(), **tolerance)


def saved_source_bytes(model, input_ids) -> int:
    """Bytes of the distinct storages of at least one source's size (`batch x seq_len x hidden_size` fp32) that
    autograd saves for backward in one training forward (parameters excluded), plus AttnRes's source buffer: the
    part that scales with the hidden size, where a per-router copy of the sources would show."""
    saved, source = {}, input_ids.numel() * model.config.hidden_size * 4
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params and storage.nbytes() >= source:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    def keep_buffer(module, args, output):  # the source buffer: read by backward, not saved through autograd
        if getattr(args[0], "buffer", None) is not None:
            pack(args[0].buffer)

    final = getattr(model.model, "final_res", None)
    hook = final.register_forward_hook(keep_buffer) if final is not None else None
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(input_ids, labels=input_ids)
    if hook is not None:
        hook.remove()
    return sum(saved.values())


def test_full_attnres_saves_sources_once_linear_in_depth():
    """Full AttnRes keeps its sources once (the buffer), not once per router: per added layer it saves a constant
    amount more than the residual model; the reference's reads (a stacked copy per router) grow quadratically."""
    input_ids = torch.randint(3, TINY["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(0))
    source = input_ids.numel() * 64 * 4
    growth = {}
    for name in ("two-phase", "naive"):
        extra = {}
        for layers in (2, 4, 6):
            full = tiny_model(attnres_block_size=1, num_hidden_layers=layers, hidden_size=64).train()
            residual = tiny_model(depth_mixing="residual", num_hidden_layers=layers, hidden_size=64).train()
            with path(name, full):
                extra[layers] = saved_source_bytes(full, input_ids) - saved_source_bytes(residual, input_ids)
        growth[name] = (extra[4] - extra[2], extra[6] - extra[4])  # bytes per 2 more layers
    first, second = growth["two-phase"]
    assert second == first, growth  # linear in depth
    assert first <= 4 * source, growth  # about one source (its buffer slot) per sub-layer
    assert growth["naive"][1] > 1.2 * growth["naive"][0] > first, growth  # the copies per router: quadratic


@pytest.mark.parametrize("block_size", [2, 4], ids=["block2", "block4"])
def test_two_phase_gradients_equal_naive_attnres(block_size, input_ids):
    """Outputs and every gradient of the two-phase path (phase 1, `_PartialMerge`) against the model's reference
    reads (`attnres_implementation="naive"`: `ops_naive.attnres` over the completed blocks and the partial sum; plain
    autograd)."""
    model = tiny_model(attnres_block_size=block_size).train()
    projection = torch.randn(model.config.vocab_size, generator=torch.Generator().manual_seed(4))
    fast_logits, _, fast = run(model, input_ids, projection)
    with path("naive", model):
        naive_logits, _, reference = run(model, input_ids, projection)
    torch.testing.assert_close(fast_logits, naive_logits, atol=1e-5, rtol=1e-5)
    assert fast.keys() == reference.keys()
    for name, grad in fast.items():  # fp32 round-off of two different orders of summation
        scale = reference[name].abs().max().item()
        torch.testing.assert_close(grad, reference[name], atol=1e-4 * scale + 1e-8, rtol=1e-4, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("knobs", ["default", "sigmoid"])
def test_two_phase_gradients_in_bf16_stay_close_to_fp32(knobs, input_ids):
    """bf16 training through phase 1 and `_PartialMerge` (fp32 arithmetic inside, bf16 gradients out): finite, and
    no farther from the fp32 gradients than the reference's reads (plain autograd) in bf16."""
    model = tiny_model(attnres_block_size=2, **KNOBS[knobs]).train()
    projection = torch.randn(model.config.vocab_size, generator=torch.Generator().manual_seed(5))
    _, _, exact = run(model, input_ids, projection)
    model = model.to(torch.bfloat16)
    errors = {}
    for name in ("two-phase", "naive"):
        with path(name, model):
            _, _, grads = run(model, input_ids, projection)
        assert all(torch.isfinite(g).all() for g in grads.values()), name
        errors[name] = max(((g.float() - exact[k]).norm() / exact[k].norm().clamp_min(1e-6)).item()
                           for k, g in grads.items())
    assert errors["two-phase"] <= 1.5 * errors["naive"] + 1e-3, errors


def test_block_attnres_saves_one_partial_sum_per_router(input_ids):
    """Block AttnRes keeps for backward, beyond what the residual model keeps, one partial block sum per router that
    merges one (their logits and key norms need them) and the source buffer: not each router's weighted sum of the
    completed sources, nor the block's phase-1 result behind the first router's output."""
    input_ids = torch.randint(3, TINY["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(0))
    source = input_ids.numel() * 64 * 4
    for layers, block_size in ((4, 4), (6, 4), (4, 2)):
        block = tiny_model(attnres_block_size=block_size, num_hidden_layers=layers, hidden_size=64).train()
        residual = tiny_model(depth_mixing="residual", num_hidden_layers=layers, hidden_size=64).train()
        sublayers, blocks = 2 * layers, -(-2 * layers // block_size)
        partials = sublayers - blocks + 1  # every router but a block's first, and the final router
        slots = 1 + (sublayers - 1) // block_size  # the embedding and every block closed before the end
        extra = saved_source_bytes(block, input_ids) - saved_source_bytes(residual, input_ids)
        assert extra <= (partials + slots) * source, (layers, block_size, extra / source)


def naive_grads(model, input_ids, projection, **kwargs):
    with path("naive", model):
        return run(model, input_ids, projection, **kwargs)[2]


def with_naive_reference(block_size, input_ids, seed):
    """A tiny Block/Full model in training mode, a random logit projection, and the reference reads' gradients."""
    model = tiny_model(attnres_block_size=block_size).train()
    projection = torch.randn(model.config.vocab_size, generator=torch.Generator().manual_seed(seed))
    return model, projection, naive_grads(model, input_ids, projection)


@pytest.mark.parametrize("block_size", [1, 2, 4], ids=["full", "block2", "block4"])
def test_source_gradients_are_summed_in_place_once_per_slot(block_size, input_ids, monkeypatch):
    """Eager training sums each source's gradient in the buffer's accumulator (`_SourceGrads`), handed to the source
    once per slot: no reader returns per-source gradients for autograd to sum, and the gradients equal the reference
    reads' plain autograd."""
    model, projection, reference = with_naive_reference(block_size, input_ids, seed=6)
    taken = []
    take = attnres_buffer._SourceGrads.take
    monkeypatch.setattr(attnres_buffer._SourceGrads, "take", lambda self, slot: taken.append(slot) or take(self, slot))
    monkeypatch.setattr(attnres_buffer, "_per_source", lambda *a: pytest.fail("autograd summed a per-source gradient"))
    _, _, grads = run(model, input_ids, projection)
    slots = 1 + (model.config.num_sublayers - 1) // block_size
    assert sorted(taken) == list(range(slots))  # every slot once; slot 0 is the embedding
    assert_same_grads(grads, reference)


@pytest.mark.parametrize("block_size", [1, 4], ids=["full", "block4"])
def test_source_gradients_start_from_zero_in_every_backward_pass(block_size, input_ids):
    """The accumulator belongs to one backward pass: `retain_graph` replays add exactly one more gradient, and a
    partial `torch.autograd.grad` (router queries only, the embedding never reached) leaves nothing behind for the
    next pass; frozen embeddings (router-only training) take no slot gradient."""
    model, projection, reference = with_naive_reference(block_size, input_ids, seed=7)
    queries = {n: p for n, p in model.named_parameters() if n.endswith(".query")}
    model.zero_grad()
    loss = (model(input_ids).logits @ projection).square().mean()
    partial = torch.autograd.grad(loss, list(queries.values()), retain_graph=True)
    loss.backward(retain_graph=True)
    loss.backward()
    assert_same_grads(dict(zip(queries, partial, strict=True)), reference)
    assert_same_grads({n: p.grad for n, p in model.named_parameters()}, reference, 2.0)
    model.get_input_embeddings().weight.requires_grad_(False)
    frozen = naive_grads(model, input_ids, projection)
    _, _, grads = run(model, input_ids, projection)
    assert grads.keys() == frozen.keys() and "model.embed_tokens.weight" not in grads
    assert_same_grads(grads, frozen)


@pytest.mark.parametrize("block_size", [1, 2, 4], ids=["full", "block2", "block4-partial-last"])
def test_source_gradient_sums_are_dropped_when_the_backward_pass_ends(block_size, input_ids, monkeypatch):
    """The accumulator (a buffer's worth of gradients plus the score terms) is freed when its backward pass ends,
    not kept while the forward's outputs live (a training loop holds them through the next forward): after
    `backward`, a `retain_graph` replay and a partial `torch.autograd.grad`, with the same gradients as before."""
    model, projection, reference = with_naive_reference(block_size, input_ids, seed=8)
    made = []
    init = attnres_buffer._SourceGrads.__init__
    monkeypatch.setattr(attnres_buffer._SourceGrads, "__init__",
                        lambda self, *args: made.append(self) or init(self, *args))
    model.zero_grad()
    out = model(input_ids)
    loss = (out.logits @ projection).square().mean()
    (accumulator,) = made

    def released():
        return all(getattr(accumulator, name) is None for name in
                   ("grad", "coefficients", "queries", "grad_rows", "inv_grad", "inv_grad_rows"))

    embed = model.get_input_embeddings().weight
    (partial,) = torch.autograd.grad(loss, [embed], retain_graph=True)
    assert released()
    loss.backward(retain_graph=True)
    assert released()
    loss.backward()
    assert released() and out.logits.grad_fn is not None  # the outputs still live
    assert_same_grad(partial, reference["model.embed_tokens.weight"], "model.embed_tokens.weight")
    assert_same_grads({n: p.grad for n, p in model.named_parameters()}, reference, 2.0)


@pytest.mark.parametrize("frozen", [False, True], ids=["trained", "frozen-weights"])
@pytest.mark.parametrize("block_size", [1, 2, 4], ids=["full", "block2", "block4-partial-last"])
def test_a_leaf_inputs_embeds_gets_its_own_gradient_not_a_view_of_every_slots(block_size, frozen, input_ids):
    """`inputs_embeds` that requires grad (saliency, adversarial inputs) is slot 0's source and a leaf: its `.grad`
    is its own `(B, T, D)` tensor, equal to the reference reads', not a view keeping the whole accumulator (every
    slot's gradient) alive."""
    model = tiny_model(attnres_block_size=block_size).train().requires_grad_(not frozen)
    embeds = model.get_input_embeddings()(input_ids).detach()
    grads = {}
    for name in ("two-phase", "naive"):
        with path(name, model):
            leaf = embeds.clone().requires_grad_(True)
            model(inputs_embeds=leaf).logits.square().mean().backward()
            grads[name] = leaf.grad
    ours = grads["two-phase"]
    assert ours.untyped_storage().nbytes() == ours.numel() * ours.element_size()
    assert_same_grad(ours, grads["naive"], "inputs_embeds")


@pytest.mark.parametrize("block_size", [1, 2, 4], ids=["full", "block2", "block4"])
def test_second_order_gradients_are_refused_not_wrong(block_size, input_ids):
    """The buffer's Functions compute their gradients from the buffer, outside autograd: differentiating them again
    (`create_graph=True`, e.g. a gradient penalty) is a clear error, not silently missing terms."""
    model = tiny_model(attnres_block_size=block_size).train()
    queries = [p for n, p in model.named_parameters() if n.endswith(".query")]
    grads = torch.autograd.grad(model(input_ids, labels=input_ids).loss, queries, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        sum(g.square().sum() for g in grads).backward()


@pytest.mark.parametrize("knobs,dtype,sdpa", [(knobs, torch.float32, False) for knobs in KNOBS] + [
    (knobs, torch.bfloat16, False) for knobs in ("default", "sigmoid-rescale")] + [
    (knobs, dtype, True) for knobs in ("default", "rescale", "no-key-norm") for dtype in (torch.float32,
                                                                                         torch.float64)],
    ids=lambda v: {True: "sdpa", False: "two-phase"}.get(v, str(v).replace("torch.", "")))
@pytest.mark.parametrize("block_size", [1, 2, 4], ids=["full", "block2", "block4-partial-last"])
def test_inference_paths_match_the_autograd_paths(block_size, knobs, dtype, sdpa, input_ids, monkeypatch):
    """Without gradients and depth weights, the merges (`_merge_inference`), phase 1 and the direct reads
    (`AttnResRouter._direct_lean`, `attnres_inference.py`) take their own shorter forms: the same logits as the
    autograd paths (a forward with gradients) and as `naive_attnres`, with and without the KV cache (prefill, then
    one token at a time). `sdpa`: every read one attention call (`SdpaLayout`; softmax scores, few tokens, fp32 or
    wider), else the two-phase ones (`attnres_inference.SDPA_TOKENS` 0)."""
    if not sdpa:
        monkeypatch.setattr(attnres_inference, "SDPA_TOKENS", 0)
    model = tiny_model(attnres_block_size=block_size, **KNOBS[knobs]).to(dtype)
    config = model.config
    tolerance = dict(atol=5e-2, rtol=5e-2) if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-5)
    calls = {"merge": 0, "direct": 0}
    merge, direct = attnres_two_phase._merge_inference, AttnResRouter._direct_lean
    monkeypatch.setattr(mixing_attnres, "_merge_inference",  # (where the router looks it up)
                        lambda *a: calls.__setitem__("merge", calls["merge"] + 1) or merge(*a))
    monkeypatch.setattr(AttnResRouter, "_direct_lean",
                        lambda *a: calls.__setitem__("direct", calls["direct"] + 1) or direct(*a))
    autograd = model(input_ids).logits.detach().float()  # parameters require grad: the autograd Functions
    assert calls == {"merge": 0, "direct": 0}
    with torch.no_grad():
        fast = model(input_ids).logits.float()
        # every router with a partial sum merges it (block size > 1; the final router's direct read too), the
        # others read the buffer directly
        routers, blocks = config.num_sublayers + 1, -(-config.num_sublayers // block_size)
        merges = 0 if block_size == 1 or sdpa else config.num_sublayers - blocks
        blocks = 0 if sdpa else blocks  # (no phase 1: each read a direct one, its partial sum included)
        assert calls == {"merge": merges + (not sdpa), "direct": routers - merges - (0 if block_size == 1 else blocks)}
        out = model(input_ids[:, :5], use_cache=True)
        steps = [out.logits]
        for position in range(5, input_ids.shape[1]):
            out = model(input_ids[:, position:position + 1], cache=out.cache, use_cache=True)
            steps.append(out.logits)
        cached = torch.cat(steps, dim=1).float()

        with path("naive", model):
            reference = model(input_ids).logits.float()
    for name, logits in (("no-grad", fast), ("cached", cached), ("autograd", autograd)):
        torch.testing.assert_close(logits, reference, **tolerance, msg=lambda m: f"{name}: {m}")
    torch.testing.assert_close(fast, autograd, **tolerance)


@pytest.mark.parametrize("routers", [False, True], ids=["uniform", "random_routers"])
@pytest.mark.parametrize("block_size", [1, 2], ids=["full", "block2"])
def test_bf16_autocast_training_stays_close_to_fp32(block_size, routers, input_ids):
    """Under autocast (`Trainer(bf16=True)` on fp32 weights) the routers compute in fp32 (autocast is off inside
    them; the partial sums keep the stream's dtype, as Llama's residual does), and the buffer's readers take
    autocast's gradient dtypes (they raised a dtype error). Worst parameter's relative gradient error against fp32,
    measured here: uniform routers 1.1% (the residual model's 0.9%), random sharp routers 9-11% (bf16 errors of the
    sub-layers, amplified by sharp softmaxes; 13-18% with the routers in bf16)."""
    model = tiny_model(attnres_block_size=block_size, routers=routers).train()
    reference = torch.autograd.grad(model(input_ids, labels=input_ids).loss, list(model.parameters()),
                                    allow_unused=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(input_ids, labels=input_ids).loss
    grads = torch.autograd.grad(loss, list(model.parameters()), allow_unused=True)
    assert torch.isfinite(loss)
    bound = 0.2 if routers else 0.03
    for ours, theirs in zip(grads, reference, strict=True):
        if theirs is not None:
            assert ours is not None and torch.isfinite(ours).all()
            assert (ours - theirs).norm() <= bound * theirs.norm() + 1e-6


@pytest.mark.parametrize("block_size", [1, 2, 4], ids=["full", "block2", "block4-partial-last"])
def test_a_state_moved_by_a_device_hook_reads_and_writes_its_moved_buffer(block_size, input_ids, monkeypatch):
    """Accelerate's device hooks move the depth state into a decoder layer on another device (`device_map` over
    several devices, `send_to_device`), each tensor it holds copied on its own, views of the source buffer included.
    The reads after the move take the moved buffer: the fewest-calls views are made again from it and the in-place
    gradient sums (kept with the first buffer) give way to autograd's: the same logits (no grad, no grad with depth
    weights, grad) and gradients as without the move. Emulated on CPU (`.to` copies), with fresh buffers poisoned
    with NaN, so that a read of a stale copy shows."""
    from accelerate.utils import send_to_device

    model = tiny_model(attnres_block_size=block_size, num_hidden_layers=4).train()
    projection = torch.randn(model.config.vocab_size, generator=torch.Generator().manual_seed(2))
    new_empty = torch.Tensor.new_empty
    monkeypatch.setattr(torch.Tensor, "new_empty", lambda self, *a, **k: new_empty(self, *a, **k).fill_(float("nan"))
                        if (k.get("dtype") or self.dtype).is_floating_point else new_empty(self, *a, **k))

    def results():
        with torch.no_grad():
            logits = [model(input_ids).logits, model(input_ids, output_depth_weights=True).logits]
        model.zero_grad()
        out = model(input_ids)
        (out.logits @ projection).square().mean().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return [*logits, out.logits.detach()], grads

    reference = results()

    def move(module, args, kwargs):
        with monkeypatch.context() as patch:
            patch.setattr(torch.Tensor, "to", lambda self, *a, **k: self.clone())
            return send_to_device((args, kwargs), "cpu")

    model.model.layers[2].register_forward_pre_hook(move, with_kwargs=True)
    moved = results()
    for logits, expected in zip(moved[0], reference[0]):
        torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)
    assert_same_grads(moved[1], reference[1])


@pytest.mark.parametrize("block_size", [1, 2, 4], ids=["full", "block2", "block4-partial-last"])
def test_autocast_gives_the_no_grad_and_the_autograd_reads_the_same_statistics(block_size, input_ids):
    """Under CPU autocast (bf16) the key norm's statistics stay fp32 on every path: the no-grad reads
    (`attnres_inference.py`) and the autograd ones (`inverse_rms`, once computed through `linalg.vecdot`, which
    autocast runs in bf16: their logits then differed by 0.5-3% of the logits' scale; now measured equal) give the
    same logits, within two bf16 steps at their scale (the fp32 reads sum in other orders, and the logits are bf16)."""
    model = tiny_model(attnres_block_size=block_size, num_hidden_layers=4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with torch.no_grad():
            no_grad = model(input_ids).logits.float()
        autograd = model(input_ids).logits.detach().float()
    scale = autograd.abs().max().item()
    torch.testing.assert_close(no_grad, autograd, atol=2 * torch.finfo(torch.bfloat16).eps * scale, rtol=0)
