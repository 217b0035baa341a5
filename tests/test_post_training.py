"""Post-training with TRL (issue 39, part 1): SFT, DPO and GRPO on every AttnRes model users post-train.

Full AttnRes, Block AttnRes and Block Delta AttnRes on a dense (Llama), a mixture-of-experts (Qwen3-MoE), the Kimi
Linear and the Kimi K3 backbone; TRL 1.16's trainers through `attnres_hf.training.post_training` (our subclasses add
the depth-mixing parameters' handling and early checks; TRL's own trainers take the models as they are, one test
shows it). What is checked beyond "it takes steps": the routers train under a LoRA config and are saved with the
adapter, which reloads to the trained model's logits; TRL's default gradient checkpointing changes no trained
weight; padding-free packing keeps the packed sequences apart (each one's logits as if alone); DPO's implicit
reference (PEFT's adapter disabled) is the base model, routers included; GRPO's policy moves; and the inputs TRL
would fail on late are refused first, with nothing written.

Tolerances (fp32, CPU, one torch thread): the same weights through the same code give the same logits to a few
ulps (measured max |Δ logits| 0 to 6e-8 for the reloads, 1.1e-7 dense and 2.7e-6 mixture-of-experts for the packed
vs separate sequences: their experts see other token counts per batch); checked at atol 1e-5. The checkpointed run's
trained weights equal the plain run's at atol 1e-6 (measured 0).
"""

import copy

import pytest
import torch

pytest.importorskip("trl")

from datasets import Dataset  # noqa: E402
from peft import LoraConfig  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402
from trl import DPOConfig, GRPOConfig, SFTConfig, SFTTrainer  # noqa: E402
from trl.trainer.sft_trainer import DataCollatorForLanguageModeling  # noqa: E402

from attnres_hf import AttnResForCausalLM  # noqa: E402
from attnres_hf.conversion.retrofit import retrofit_config  # noqa: E402
from attnres_hf.training import load_adapter, lora_config  # noqa: E402
from attnres_hf.training.post_training import (  # noqa: E402
    AttnResDPOTrainer,
    AttnResGRPOTrainer,
    AttnResSFTTrainer,
)
from test_backbones_moe import source_config  # noqa: E402
from test_checkpointing import CASES as EVERY_METHOD  # noqa: E402
from utils import perturb_mixing, tiny_config, word_tokenizer  # noqa: E402

FAMILIES = ("llama", "qwen3_moe", "kimi_linear", "kimi_k3")
"""A dense family, a mixture-of-experts one, Kimi Linear (KDA/MLA) and Kimi K3."""

VARIANTS = {
    "full": {"depth_mixing": "attnres", "attnres_block_size": 1},
    "block": {"depth_mixing": "attnres", "attnres_block_size": 2},
    "delta": {"depth_mixing": "delta_attnres", "attnres_block_size": 2},
}
"""The methods post-training is for: Full and Block AttnRes, Block Delta AttnRes."""

CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'user' %}w3 {{ message['content'] }} "
    "{% else %}w4 {% generation %}{{ message['content'] }} </s>{% endgeneration %} {% endif %}{% endfor %}"
    "{% if add_generation_prompt %}w4 {% endif %}")
"""A chat template over the word tokenizer: `w3` opens a user turn, `w4` an assistant turn, whose text and end of turn
are the `{% generation %}` span TRL's assistant-only loss trains on."""

ATOL = 1e-5


@pytest.fixture(autouse=True)
def _one_thread():
    """Models this small run several times faster on one torch thread than on two contended ones (conftest
    restores)."""
    torch.set_num_threads(1)


def build(family: str = "llama", variant: str = "block", seed: int = 0) -> AttnResForCausalLM:
    """A 2-layer AttnRes model of `family` with trained-like (perturbed) depth mixing."""
    overrides = VARIANTS[variant]
    config = (tiny_config(num_hidden_layers=2, **overrides) if family == "llama"
              else retrofit_config(source_config(family), **overrides))
    torch.manual_seed(seed)
    model = AttnResForCausalLM(config)
    perturb_mixing(model, seed)
    model.generation_config.pad_token_id = 0
    return model


def tokenizer():
    tokenizer = word_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def words(start: int, count: int) -> str:
    """`count` consecutive words of the counting language from `w{5 + start}`."""
    return " ".join(f"w{5 + (start + k) % 90}" for k in range(count))


TEXTS = {"text": [words(i, 6 + i % 5) for i in range(16)]}
CHATS = {"messages": [[{"role": "user", "content": words(i, 4)}, {"role": "assistant", "content": words(i + 4, 3)}]
                      for i in range(16)]}
PROMPT_COMPLETIONS = {"prompt": [words(i, 4) for i in range(16)], "completion": [" " + words(i + 4, 3) for i in range(16)]}
PREFERENCES = PROMPT_COMPLETIONS | {"chosen": PROMPT_COMPLETIONS["completion"],
                                    "rejected": [" " + words(i + 40, 3) for i in range(16)]}
PREFERENCES.pop("completion")


def config(kind, out, **fields):
    """Two steps of four rows, nothing saved, reported or drawn on the terminal."""
    common = dict(max_steps=2, per_device_train_batch_size=4, learning_rate=1e-2, report_to=[], save_strategy="no",
                  logging_steps=1, disable_tqdm=True, use_cpu=True, seed=0)
    return kind(str(out), **(common | fields))


def routed_sources(model) -> set[str]:
    """The pseudo-queries that read more than one source: the first attention sub-layer's router reads the embedding
    alone, so its softmax is 1 whatever its query and it gets no gradient."""
    names = {name for name, _ in model.named_parameters() if name.endswith(".query")}
    return names - {"model.layers.0.attn_res.query"}


def state(model) -> dict:
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


def trained_copy(trainer, name: str) -> torch.Tensor:
    """A parameter of the model the trainer trained, under PEFT its trained copy (`modules_to_save`)."""
    for key, param in trainer.model.named_parameters():
        plain = key.replace("base_model.model.", "").replace("modules_to_save.default.", "")
        if plain == name and ("modules_to_save" in key or "base_model" not in key):
            return param.detach()
    raise KeyError(name)


def trained(trainer):
    """The trained model, its forward freed of the bf16 autocast TRL's configs turn on by default (`bf16=True`, on CPU
    too), which accelerate leaves wrapped around it after training: fp32 logits, as a reloaded model computes."""
    return trainer.accelerator.unwrap_model(trainer.model, keep_fp32_wrapper=False)


def probe_logits(model) -> torch.Tensor:
    ids = torch.tensor([[1, 7, 8, 9, 10, 11, 12]])
    with torch.no_grad():
        return model.eval()(ids, use_cache=False).logits


CASES = [(family, variant) for family in FAMILIES for variant in VARIANTS]


@pytest.mark.parametrize(("family", "variant"), CASES, ids=[f"{f}-{v}" for f, v in CASES])
def test_sft_with_lora_trains_the_routers_and_the_adapter_reloads(family, variant, tmp_path):
    """SFT with `lora_config(model)` and packing: the LoRA adapters and every routed pseudo-query move, the base stays,
    and the saved adapter (with its routers) reloads on a fresh base to the trained model's logits. Kimi backbones pack
    with `"wrapped"` here (padding-free packing needs CUDA for their KDA layers: refused, tested below)."""
    model = build(family, variant)
    before = state(model)
    packing = "wrapped" if family.startswith("kimi") else "bfd"
    trainer = AttnResSFTTrainer(model=model, args=config(SFTConfig, tmp_path, packing=True, packing_strategy=packing,
                                                         max_length=24), train_dataset=Dataset.from_dict(TEXTS),
                                processing_class=tokenizer(), peft_config=lora_config(model))
    history = trainer.train()
    assert torch.isfinite(torch.tensor(history.training_loss))
    queries = routed_sources(build(family, variant))
    assert queries and all(not torch.equal(trained_copy(trainer, name), before[name]) for name in queries)
    lora = {name: param for name, param in trainer.model.named_parameters() if "lora_B" in name}
    assert lora and all(param.abs().max() > 0 for param in lora.values())  # B starts at zero
    base = trainer.model.get_base_model()
    for name, tensor in base.state_dict().items():
        if "lora_" not in name and "modules_to_save" not in name:
            plain = name.replace("base_layer.", "").replace("original_module.", "")
            assert torch.equal(tensor, before[plain]), name
    trainer.save_model(str(tmp_path / "adapter"))
    reloaded = load_adapter(build(family, variant), tmp_path / "adapter")
    torch.testing.assert_close(probe_logits(reloaded), probe_logits(trained(trainer)), atol=ATOL, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_sft_of_chats_with_trls_gradient_checkpointing_equals_the_plain_run(family, tmp_path):
    """Full fine-tuning on a conversational set with assistant-only loss under TRL's default gradient checkpointing:
    every trained weight equals the run without checkpointing (the faults issue's reentrant checkpoint trained only the
    last layers), and the saved folder loads with `AutoModelForCausalLM` to the trained model's logits."""
    runs = {}
    for checkpointing in (True, False):
        trainer = AttnResSFTTrainer(
            model=build(family), train_dataset=Dataset.from_dict(CHATS), processing_class=tokenizer(),
            args=config(SFTConfig, tmp_path / str(checkpointing), assistant_only_loss=True,
                        gradient_checkpointing=checkpointing))
        assert trainer.args.gradient_checkpointing is checkpointing  # (True is SFTConfig's default)
        trainer.train()
        runs[checkpointing] = trainer
    plain, checkpointed = state(runs[False].model), state(runs[True].model)
    untouched = state(build(family))
    moved = [name for name in plain if not torch.equal(plain[name], untouched[name])]
    assert len(moved) > len(plain) // 2  # full fine-tuning: most tensors move (norms of unread positions may not)
    for name, tensor in plain.items():
        torch.testing.assert_close(checkpointed[name], tensor, atol=1e-6, rtol=0, msg=lambda m, n=name: f"{n}: {m}")
    runs[True].save_model(str(tmp_path / "model"))
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "model")
    torch.testing.assert_close(probe_logits(loaded), probe_logits(trained(runs[True])), atol=ATOL, rtol=0)


@pytest.mark.parametrize(("family", "method"), [case for case in EVERY_METHOD if not case[0].startswith("kimi")],
                         ids=[f"{f}-{m}" for f, m in EVERY_METHOD if not f.startswith("kimi")])
def test_padding_free_packing_keeps_the_sequences_apart(family, method):
    """TRL's padding-free collator (what `packing=True` with `"bfd"` trains on) puts several sequences in one row with
    restarting `position_ids`, `cu_seq_lens_*`, `max_length_*` and `seq_idx`: the model takes those keywords and each
    sequence's logits are the ones it gets alone. Every depth-mixing method, dense and mixture-of-experts backbones."""
    overrides = {"depth_mixing": method} | ({"attnres_block_size": 2} if "attnres" in method else {})
    config_ = (tiny_config(num_hidden_layers=2, **overrides) if family == "llama"
               else retrofit_config(source_config(family), **overrides))
    torch.manual_seed(0)
    model = AttnResForCausalLM(config_).train()
    perturb_mixing(model)
    model.eval()  # (dropout off; the mask comes from the position ids, as in training, with use_cache=False)
    generator = torch.Generator().manual_seed(1)
    sequences = [torch.randint(3, 99, (length,), generator=generator) for length in (7, 4, 9)]
    batch = DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True)([{"input_ids": s} for s in sequences])
    assert {"position_ids", "cu_seq_lens_q", "seq_idx"} <= batch.keys() and "attention_mask" not in batch
    labels = batch.pop("labels")
    with torch.no_grad():
        packed = model(**batch, use_cache=False).logits[0]
        alone = torch.cat([model(s[None], use_cache=False).logits[0] for s in sequences])
        assert torch.isfinite(model(**batch, labels=labels, use_cache=False).loss)
    torch.testing.assert_close(packed, alone, atol=ATOL, rtol=0)


@pytest.mark.parametrize("family", ["kimi_linear", "kimi_k3"])
@pytest.mark.parametrize("fields", [{"packing": True}, {"padding_free": True}], ids=["bfd-packing", "padding_free"])
def test_padding_free_packing_of_kda_backbones_is_refused_off_cuda(family, fields, tmp_path):
    """On CPU the KDA layers cannot keep packed sequences apart; TRL would prepare the data and fail at the first step
    (transformers' own Kimi Linear as well). Refused first, in one line, with nothing written."""
    with pytest.raises(ValueError, match="padding-free packing of a .* backbone needs CUDA.*packing_strategy='wrapped'"):
        AttnResSFTTrainer(model=build(family), args=config(SFTConfig, tmp_path / "out", max_length=24, **fields),
                          train_dataset=Dataset.from_dict(TEXTS), processing_class=tokenizer())
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_sft_on_prompt_completions_trains_on_completions_only(family, tmp_path):
    """A prompt-completion set (TRL's completion-only loss, its default there) with the routers at a rate of their own:
    the depth-mixing parameters get the optimizer group `router_learning_rate` asks for, and the prompt tokens carry
    no label."""
    trainer = AttnResSFTTrainer(model=build(family), args=config(SFTConfig, tmp_path), router_learning_rate=3e-2,
                                train_dataset=Dataset.from_dict(PROMPT_COMPLETIONS), processing_class=tokenizer())
    batch = next(iter(trainer.get_train_dataloader()))
    prompt_length = len(tokenizer()(PROMPT_COMPLETIONS["prompt"][0])["input_ids"])
    assert (batch["labels"][:, :prompt_length] == -100).all() and (batch["labels"][:, prompt_length:] != -100).any()
    trainer.train()
    groups = [group for group in trainer.optimizer.param_groups if group.get("depth_mixing")]
    assert groups and {group["initial_lr"] for group in groups} == {3e-2}


@pytest.mark.parametrize("family", ["llama", "kimi_k3"])
def test_dpo_with_a_reference_model(family, tmp_path):
    """DPO with an explicit reference model (a frozen copy): the policy moves, the reference does not."""
    model, reference = build(family), build(family)
    before = state(reference)
    trainer = AttnResDPOTrainer(model=model, ref_model=reference, args=config(DPOConfig, tmp_path, max_length=24),
                                train_dataset=Dataset.from_dict(PREFERENCES), processing_class=tokenizer())
    history = trainer.train()
    assert torch.isfinite(torch.tensor(history.training_loss))
    assert all(torch.equal(tensor, before[name]) for name, tensor in state(reference).items())
    assert any(not torch.equal(tensor, before[name]) for name, tensor in state(trainer.model).items())


@pytest.mark.parametrize(("family", "variant"), [("llama", "block"), ("qwen3_moe", "delta"), ("kimi_linear", "full")])
def test_dpo_implicit_reference_is_the_base_model_routers_included(family, variant, tmp_path):
    """DPO under a LoRA config that trains the routers has no reference model: TRL disables the adapter for the
    reference pass. That must be the base model, its routers as they were (PEFT keeps each original beside the trained
    copy), while the adapter-enabled policy has moved."""
    model = build(family, variant)
    base_logits = probe_logits(copy.deepcopy(model))
    trainer = AttnResDPOTrainer(model=model, args=config(DPOConfig, tmp_path, max_length=24),
                                train_dataset=Dataset.from_dict(PREFERENCES), processing_class=tokenizer(),
                                peft_config=lora_config(model))
    trainer.train()
    assert trainer.ref_model is None
    policy = trained(trainer)
    with policy.disable_adapter():
        torch.testing.assert_close(probe_logits(policy), base_logits, atol=ATOL, rtol=0)
    assert (probe_logits(policy) - base_logits).abs().max() > 1e-3


def odd_words(completions, **kwargs) -> list[float]:
    """The share of a completion's words that are odd (`w7`, `w9`, ...): a reward with spread over any model's samples."""
    return [sum(word[1:].isdigit() and int(word[1:]) % 2 for word in words) / max(len(words), 1)
            for words in (completion.split() for completion in completions)]


@pytest.mark.parametrize(("family", "variant"), [("llama", "block"), ("kimi_linear", "delta"), ("kimi_k3", "full")])
def test_grpo_samples_with_transformers_generation_and_moves_the_policy(family, variant, tmp_path):
    """GRPO on a CPU: completions sampled with transformers' generation (the KV and KDA caches), scored by a reward
    function, and the policy's weights, routers included, move."""
    model = build(family, variant)
    before, queries = state(model), routed_sources(model)
    prompts = Dataset.from_dict({"prompt": PROMPT_COMPLETIONS["prompt"][:8]})
    trainer = AttnResGRPOTrainer(model=model, reward_funcs=odd_words, train_dataset=prompts,
                                 processing_class=tokenizer(),
                                 args=config(GRPOConfig, tmp_path, num_generations=4, max_completion_length=6,
                                             temperature=1.5, beta=0.0))
    trainer.train()
    logged = [entry for entry in trainer.state.log_history if "reward" in entry]
    assert logged and any(entry["reward_std"] > 0 for entry in logged)
    after = state(trainer.model)
    assert any(not torch.equal(after[name], before[name]) for name in queries)


def test_trls_own_sft_trainer_takes_an_attnres_model_and_its_lora_config(tmp_path):
    """Nothing requires our subclasses: TRL's `SFTTrainer` with `lora_config(model)` trains the routers too."""
    model = build()
    before, queries = state(model), routed_sources(model)
    trainer = SFTTrainer(model=model, args=config(SFTConfig, tmp_path), train_dataset=Dataset.from_dict(TEXTS),
                         processing_class=tokenizer(), peft_config=lora_config(model))
    trainer.train()
    assert all(not torch.equal(trained_copy(trainer, name), before[name]) for name in queries)


BAD_DATASETS = {
    "sft": (AttnResSFTTrainer, SFTConfig, {"content": TEXTS["text"]},
            "'text' or 'messages' or 'conversations' or 'prompt' \\+ 'completion'"),
    "dpo": (AttnResDPOTrainer, DPOConfig, {"prompt": PREFERENCES["prompt"], "chosen": PREFERENCES["chosen"]},
            "'chosen' \\+ 'rejected'"),
    "grpo": (AttnResGRPOTrainer, GRPOConfig, {"question": PREFERENCES["prompt"]}, "'prompt'"),
}


def trainer_inputs(kind: str) -> tuple[dict, dict]:
    """The trainer's own keyword arguments and its config's, beyond the tests' defaults."""
    if kind == "grpo":
        return {"reward_funcs": odd_words}, {"num_generations": 4}
    return {"ref_model": build()} if kind == "dpo" else {}, {}


def generated(columns: dict):
    """`columns` as an iterable dataset from a generator: features unknown until a row is read."""
    from datasets import IterableDataset

    rows = [dict(zip(columns, values)) for values in zip(*columns.values())]
    return IterableDataset.from_generator(lambda: iter(rows))


@pytest.mark.parametrize("which", ["train", "eval", "eval-dict", "iterable"])
@pytest.mark.parametrize("kind", list(BAD_DATASETS))
def test_a_dataset_without_the_columns_a_trainer_reads_is_refused_first(kind, which, tmp_path):
    """TRL raises `KeyError: 'text'` (or `'rejected'`) from inside its tokenisation; ours names what it has and what
    the trainer reads, before anything is prepared or written: for the training set, an evaluation set (alone or in a
    dict), and an iterable set whose features are known only from its first row."""
    trainer_class, config_class, columns, wanted = BAD_DATASETS[kind]
    good = {"sft": TEXTS, "dpo": PREFERENCES, "grpo": {"prompt": PREFERENCES["prompt"]}}[kind]
    extra, fields = trainer_inputs(kind)
    datasets_ = {"train": (Dataset.from_dict(columns), None),
                 "eval": (Dataset.from_dict(good), Dataset.from_dict(columns)),
                 "eval-dict": (Dataset.from_dict(good), {"a": Dataset.from_dict(good), "b": Dataset.from_dict(columns)}),
                 "iterable": (generated(columns), None)}[which]
    name = {"train": "train_dataset", "eval": "eval_dataset", "eval-dict": "eval_dataset\\['b'\\]",
            "iterable": "train_dataset"}[which]
    fields |= {"max_steps": 2}
    with pytest.raises(ValueError, match=f"{name} has columns .*reads {wanted}"):
        trainer_class(model=build(), args=config(config_class, tmp_path / "out", **fields), train_dataset=datasets_[0],
                      eval_dataset=datasets_[1], processing_class=tokenizer(), **extra)
    assert not (tmp_path / "out").exists()


def test_sharegpt_conversations_are_read(tmp_path):
    """A `conversations` column of `from`/`value` turns, which TRL converts to messages itself, is accepted."""
    shared = {"conversations": [[{"from": "human", "value": m[0]["content"]}, {"from": "gpt", "value": m[1]["content"]}]
                                for m in CHATS["messages"]]}
    trainer = AttnResSFTTrainer(model=build(), args=config(SFTConfig, tmp_path), processing_class=tokenizer(),
                                train_dataset=Dataset.from_dict(shared))
    assert torch.isfinite(torch.tensor(trainer.train().training_loss))


def saved(tmp_path, family="llama") -> str:
    folder = tmp_path / f"saved-{family}"
    build(family).save_pretrained(folder)
    return str(folder)


@pytest.mark.parametrize("given", ["object", "peft-model", "folder"])
def test_padding_free_packing_of_kda_backbones_is_refused_however_the_model_is_given(given, tmp_path):
    """A model object, one already wrapped by PEFT, or a folder TRL loads itself (its config read, nothing loaded)."""
    from peft import get_peft_model

    model = {"object": lambda: build("kimi_linear"), "folder": lambda: saved(tmp_path, "kimi_linear"),
             "peft-model": lambda: get_peft_model(build("kimi_linear"), lora_config(build("kimi_linear")))}[given]()
    with pytest.raises(ValueError, match="padding-free packing of a kimi_linear backbone needs CUDA"):
        AttnResSFTTrainer(model=model, args=config(SFTConfig, tmp_path / "out", packing=True, max_length=24),
                          train_dataset=Dataset.from_dict(TEXTS), processing_class=tokenizer())
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("kind", "fields"), [("dpo", {}), ("grpo", {"beta": 0.04, "num_generations": 4})])
def test_a_reference_trl_cannot_load_is_refused_first(kind, fields, tmp_path):
    """Without `ref_model` or PEFT, DPO (and GRPO with `beta > 0`) loads its reference from
    `model.config._name_or_path`, which a model made or retrofitted in memory does not have: TRL fails with a hub error
    about an empty repository id. Refused in one line naming the ways out; from a folder it trains."""
    trainer_class, config_class, _, _ = BAD_DATASETS[kind]
    data = Dataset.from_dict(PREFERENCES if kind == "dpo" else {"prompt": PREFERENCES["prompt"]})
    extra = {"reward_funcs": odd_words} if kind == "grpo" else {}
    with pytest.raises(ValueError, match="loads its reference model from model.config._name_or_path, which this "
                                         "in-memory model does not have"):
        trainer_class(model=build(), args=config(config_class, tmp_path / "out", **fields), train_dataset=data,
                      processing_class=tokenizer(), **extra)
    assert not (tmp_path / "out").exists()
    model = AutoModelForCausalLM.from_pretrained(saved(tmp_path))
    length = {"max_length": 24} if kind == "dpo" else {"max_completion_length": 4}
    trainer = trainer_class(model=model, args=config(config_class, tmp_path / "ok", **length, **fields),
                            train_dataset=data, processing_class=tokenizer(), **extra)
    assert trainer.ref_model is not None and torch.isfinite(torch.tensor(trainer.train().training_loss))


def test_the_checks_read_arguments_given_in_trls_positional_order(tmp_path):
    """`SFTTrainer(model, args, data_collator, train_dataset, ...)`: checked as if given by keyword."""
    with pytest.raises(ValueError, match="train_dataset has columns \\['content'\\]"):
        AttnResSFTTrainer(build(), config(SFTConfig, tmp_path / "out"), None, Dataset.from_dict({"content": ["w5"]}))
    with pytest.raises(ValueError, match="padding-free packing of a kimi_linear backbone needs CUDA"):
        AttnResSFTTrainer(build("kimi_linear"), config(SFTConfig, tmp_path / "out", packing=True), None,
                          Dataset.from_dict(TEXTS), router_learning_rate=1e-3)
    assert not (tmp_path / "out").exists()


LORA_CONFIGS = {
    "router": ({"target_modules": ["q_proj", "attn_res"]}, "names depth-mixing modules \\(attn_res\\)"),
    "router-regex": ({"target_modules": r".*\.(q_proj|attn_res)"}, "names depth-mixing modules \\(model.layers.0.attn_res"),
    "misspelt": ({"target_modules": ["q_proj", "qq_proj"]}, "not found in this model: qq_proj"),
    "one-name-string": ({"target_modules": "q_proj"}, "for the module name give a list, \\['q_proj'\\]"),
    "misspelt-modules_to_save": ({"target_modules": ["q_proj"], "modules_to_save": ["attn_rez"]},
                                 "modules_to_save not found in this model: attn_rez"),
    "modules_to_save-string": ({"target_modules": ["q_proj"], "modules_to_save": "attn_res"},
                               "modules_to_save must be a list of module names, got the string 'attn_res'"),
}


@pytest.mark.parametrize("given", ["object", "folder"])
@pytest.mark.parametrize("case", list(LORA_CONFIGS))
def test_a_lora_config_naming_a_router_or_nothing_is_refused_first(case, given, tmp_path):
    """PEFT fails on a router target with a message naming neither the module's role nor the fix, and skips a
    misspelt target or `modules_to_save` silently (the routers would stay frozen); refused before the trainer wraps
    the model, whether it is given as an object or as a folder TRL loads."""
    fields, match = LORA_CONFIGS[case]
    model = build() if given == "object" else saved(tmp_path)
    with pytest.raises((ValueError, TypeError), match=match):
        AttnResSFTTrainer(model=model, args=config(SFTConfig, tmp_path / "out"), processing_class=tokenizer(),
                          train_dataset=Dataset.from_dict(TEXTS), peft_config=LoraConfig(**fields))
    assert not (tmp_path / "out").exists()


def test_check_post_training_knows_its_trainers_and_router_rates_need_routers(tmp_path):
    from attnres_hf.training.post_training import check_post_training

    for kind in ("SFT", "ppo"):
        with pytest.raises(ValueError, match="kind must be one of sft, dpo, grpo"):
            check_post_training(kind, build())
    residual = AttnResForCausalLM(tiny_config(depth_mixing="residual"))
    with pytest.raises(ValueError, match="router_learning_rate is set, but the model has no depth-mixing parameters"):
        AttnResSFTTrainer(model=residual, args=config(SFTConfig, tmp_path / "out"), processing_class=tokenizer(),
                          train_dataset=Dataset.from_dict(TEXTS), router_learning_rate=1e-3)
    assert not (tmp_path / "out").exists()


def test_trls_own_errors_come_before_any_checkpoint(tmp_path):
    """A chat set with a tokenizer without a chat template, and a reward function returning one reward for four
    completions: TRL's own errors, raised before the first step completes, and no checkpoint written."""
    with pytest.raises(ValueError, match="chat_template is not set"):
        AttnResSFTTrainer(model=build(), args=config(SFTConfig, tmp_path / "sft"), processing_class=word_tokenizer(),
                          train_dataset=Dataset.from_dict(CHATS))
    trainer = AttnResGRPOTrainer(model=build(), reward_funcs=lambda completions, **kwargs: [1.0],
                                 args=config(GRPOConfig, tmp_path / "grpo", num_generations=4, max_completion_length=4,
                                             save_strategy="steps", save_steps=1),
                                 train_dataset=Dataset.from_dict({"prompt": PREFERENCES["prompt"]}),
                                 processing_class=tokenizer())
    with pytest.raises(ValueError, match="returned 1 rewards, but 4 were expected"):
        trainer.train()
    assert not list((tmp_path / "grpo").glob("checkpoint-*"))
