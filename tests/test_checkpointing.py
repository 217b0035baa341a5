"""Gradient checkpointing changes no gradient, whichever public way turns it on (issue 36, part 2).

A decoder layer passes its depth state (a NamedTuple of tensors) from layer to layer, which torch's reentrant
checkpoint cannot follow: it cut the gradient at every layer, so most parameters got none. torch runs the reentrant
variant whenever `use_reentrant` is not given, which is what `gradient_checkpointing_kwargs={}` or
`{"preserve_rng_state": True}`, PEFT's `prepare_model_for_kbit_training` (the QLoRA recipe) and
`TrainingArguments(gradient_checkpointing=True, gradient_checkpointing_kwargs=...)` ask for. Here every route gives
every trainable parameter the gradient of the same step without checkpointing, for every depth-mixing method on a
dense, a mixture-of-experts and the Kimi Linear and Kimi K3 backbones.

Tolerance: the checkpointed backward replays each layer's forward with the same kernels on the same inputs; measured
max |Δ grad| 0 (every case here, fp32 CPU); checked at atol 1e-6, rtol 1e-5 (fp32 round-off of the gradients,
magnitudes up to ~1), as the other checkpointing tests.
"""

import warnings

import pytest
import torch

from attnres_hf import AttnResForCausalLM
from attnres_hf.conversion.retrofit import retrofit_config
from attnres_hf.modeling.depth_mixing import DEPTH_MIXING
from attnres_hf.modeling.modeling_attnres import AttnResDecoderLayer
from test_backbones_moe import REFUSED, source_config
from utils import BLOCK_METHODS, perturb_mixing, tiny_config

FAMILIES = ("llama", "qwen3_moe", "kimi_linear", "kimi_k3")
"""A dense family, a mixture-of-experts one (with its aux loss), Kimi Linear (KDA/MLA) and Kimi K3."""

CASES = [(family, method) for family in FAMILIES for method in DEPTH_MIXING
         if (family, method) not in REFUSED]

ATOL, RTOL = 1e-6, 1e-5


@pytest.fixture(autouse=True)
def _one_thread():
    """Models this small run ~10x faster on one torch thread than on two contended ones (conftest restores)."""
    torch.set_num_threads(1)


def build(family: str, method: str) -> AttnResForCausalLM:
    """A 2-layer AttnRes model of `family` and `method`, its mixing parameters trained-like (perturbed)."""
    overrides = {"depth_mixing": method} | ({"attnres_block_size": 2} if method in BLOCK_METHODS else {})
    if family == "llama":
        config = tiny_config(num_hidden_layers=2, **overrides)
    else:  # the MoE aux loss (qwen3_moe) is part of the gradient
        config = retrofit_config(source_config(family, output_router_logits=True), **overrides)
    torch.manual_seed(0)
    model = AttnResForCausalLM(config).train()
    perturb_mixing(model)
    return model


def ids(batch=2, length=9, seed=1):
    return torch.randint(3, 99, (batch, length), generator=torch.Generator().manual_seed(seed))


def gradients(model) -> dict:
    """One forward and backward of the LM loss; `{name: grad}` of every trainable parameter (`None`: no gradient)."""
    model.zero_grad(set_to_none=True)
    input_ids = ids()
    model(input_ids, labels=input_ids).loss.backward()
    return {name.replace("_checkpoint_wrapped_module.", ""): param.grad  # (torch's checkpoint_wrapper's prefix)
            for name, param in model.named_parameters() if param.requires_grad}


def assert_same_gradients(checkpointed: dict, plain: dict) -> None:
    assert checkpointed.keys() == plain.keys()
    missing = [name for name, grad in checkpointed.items() if grad is None and plain[name] is not None]
    assert not missing, f"{len(missing)} of {len(plain)} trainable tensors got no gradient: {missing[:3]}"
    for name, grad in plain.items():
        torch.testing.assert_close(checkpointed[name], grad, atol=ATOL, rtol=RTOL, msg=lambda m, n=name: f"{n}: {m}")


def replays(model) -> list:
    """A list that grows by one whenever layer 0's attention starts (twice a step with checkpointing on: the replay,
    which torch may stop early, once it has what the backward needs)."""
    layer = model.model.layers[0]
    calls = []
    layer.get_submodule(layer._attention_module).register_forward_pre_hook(lambda *args: calls.append(1))
    return calls


@pytest.mark.parametrize(("family", "method"), CASES, ids=[f"{f}-{m}" for f, m in CASES])
def test_checkpointing_with_kwargs_without_use_reentrant_keeps_every_gradient(family, method):
    """`gradient_checkpointing_kwargs={}`: `use_reentrant` absent, which torch ran reentrantly (before: 27 of 31
    trainable tensors without gradient on Llama-backed Block AttnRes; Delta AttnRes's backward failed on Kimi)."""
    model = build(family, method)
    plain = gradients(model)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={})
    calls = replays(model)
    assert_same_gradients(gradients(model), plain)
    assert len(calls) == 2  # checkpointing is really on: the forward, then the replay in backward


def enable_with_kwargs(kwargs):
    return lambda model: model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def prepare_for_kbit_training(model):
    """PEFT's QLoRA preparation with its defaults; PEFT turns checkpointing on for a quantized model only, which it
    recognises by the flag a bitsandbytes 4-bit load sets. It freezes every parameter: unfrozen again to compare."""
    from peft import prepare_model_for_kbit_training

    model.is_loaded_in_4bit = True
    prepare_model_for_kbit_training(model)
    assert model.is_gradient_checkpointing
    model.requires_grad_(True)


def accelerate_activation_checkpointing(model):
    """What accelerate's FSDP plugin does with `activation_checkpointing=True`: torch's `checkpoint_wrapper` (its
    default, non-reentrant implementation) around every decoder layer. It replays a layer with its cache, which
    transformers' own layers drop only under their own checkpointing: without the cache turned off, Kimi Linear's
    KDA layers update it twice and the replay fails, in the family's own model as well."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

    apply_activation_checkpointing(model, check_fn=lambda module: isinstance(module, AttnResDecoderLayer))
    model.config.use_cache = False


ROUTES = {
    "default": lambda model: model.gradient_checkpointing_enable(),
    "empty-kwargs": enable_with_kwargs({}),
    "preserve_rng_state": enable_with_kwargs({"preserve_rng_state": True}),
    "use_reentrant-true": enable_with_kwargs({"use_reentrant": True}),
    "use_reentrant-false": enable_with_kwargs({"use_reentrant": False}),
    "activation_checkpointing_enable-offload": lambda model: model.activation_checkpointing_enable(
        {"preserve_rng_state": True}, offload=True),
    "peft-prepare_model_for_kbit_training": prepare_for_kbit_training,
    "accelerate-checkpoint_wrapper": accelerate_activation_checkpointing,
}
"""Every public way to turn activation checkpointing on, each as a function of the model."""


@pytest.mark.parametrize("route", list(ROUTES))
@pytest.mark.parametrize(("family", "method"), [("llama", "attnres"), ("kimi_linear", "delta_attnres")],
                         ids=["llama-attnres", "kimi_linear-delta_attnres"])
def test_every_route_to_checkpointing_keeps_every_gradient(route, family, method):
    model = build(family, method)
    plain = gradients(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # `gradient_checkpointing_enable` is deprecated for v6
        ROUTES[route](model)
    calls = replays(model)
    assert_same_gradients(gradients(model), plain)
    assert len(calls) == 2


def test_use_reentrant_true_is_replaced_with_one_warning(caplog):
    """An explicit `use_reentrant=True` (older recipes) is not obeyed: it becomes non-reentrant, saying so once."""
    import logging

    model = build("llama", "attnres")
    logging.Logger.warning_once.cache_clear()  # transformers' once-per-process warnings: said again here
    with caplog.at_level("WARNING"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    assert model.model.layers[0]._gradient_checkpointing_func.keywords == {"use_reentrant": False}
    assert any("using use_reentrant=False" in record.message for record in caplog.records)


def test_a_trainer_step_with_checkpointing_applies_the_gradients_of_the_step_without(tmp_path):
    """`TrainingArguments(gradient_checkpointing=True, gradient_checkpointing_kwargs={"preserve_rng_state": True})`,
    the route of `attnres train --gradient_checkpointing true --gradient_checkpointing_kwargs ...`: the step's
    gradients (just before the optimizer) and the update are those of the same step without checkpointing (before:
    most parameters moved differently). The Trainer passes empty kwargs on as `None`, transformers' non-reentrant
    default, and the kwargs themselves as the model method does (tested above)."""
    kwargs = {"preserve_rng_state": True}
    from transformers import Trainer, TrainerCallback, TrainingArguments

    class Gradients(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            self.grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    input_ids = ids(batch=4)
    data = [{"input_ids": row, "labels": row} for row in input_ids.tolist()]

    def step(checkpointing: bool):
        model = build("llama", "attnres")
        args = TrainingArguments(tmp_path / str(checkpointing), max_steps=1, per_device_train_batch_size=4,
                                 learning_rate=1e-2, report_to="none", save_strategy="no", use_cpu=True,
                                 dataloader_num_workers=0, gradient_checkpointing=checkpointing,
                                 gradient_checkpointing_kwargs=kwargs if checkpointing else None)
        callback = Gradients()
        Trainer(model=model, args=args, train_dataset=data, callbacks=[callback]).train()
        assert model.is_gradient_checkpointing == checkpointing
        return callback.grads, {n: p.detach().clone() for n, p in model.named_parameters()}

    plain_grads, plain_params = step(False)
    grads, params = step(True)
    assert_same_gradients(grads, plain_grads)
    for name, param in plain_params.items():
        torch.testing.assert_close(params[name], param, atol=ATOL, rtol=RTOL, msg=name)
