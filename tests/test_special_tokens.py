"""Special tokens reach every consumer: the ids in the nested `backbone` config are where transformers' generation,
`pipeline(...)`, `Trainer`'s tokenizer alignment and `transformers serve` (which use `model.generation_config`) look
for them, and every end token a source declares stops the converted model. The oracle is the equal
`LlamaForCausalLM` (same weights, same ids): an AttnRes model must stop where it stops."""

import json

import pytest
import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, pipeline
from transformers.trainer_utils import align_special_tokens

from attnres_hf import AttnResConfig, AttnResForCausalLM
from attnres_hf.conversion import convert, gguf_stop_token_ids, load_source, retrofit, serializable_copy
from gguf_fixtures import write_gguf
from utils import TINY, word_tokenizer

PROMPTS = torch.tensor([[5, 17, 42, 8], [60, 3, 77, 21]])
NEW_TOKENS = 12


def _llama(**ids) -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**{**TINY, **ids})).eval()


def _greedy(model, prompts=PROMPTS, **kwargs) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(prompts, max_new_tokens=NEW_TOKENS, do_sample=False, **kwargs)


@pytest.fixture(scope="module")
def stop_ids():
    """`(eos, never)`: a token the tiny Llama generates greedily after a few steps for the first prompt (not earlier,
    not in the prompt) and a token it never generates for either prompt in NEW_TOKENS steps."""
    out = _greedy(_llama(), min_new_tokens=NEW_TOKENS)
    first = out[0, PROMPTS.shape[1]:].tolist()
    eos = next(t for k, t in enumerate(first) if k >= 2 and t not in first[:k] and t not in PROMPTS[0].tolist())
    never = next(t for t in range(3, TINY["vocab_size"]) if t not in out.tolist() and t != eos)
    return eos, never


def _ids(stop_ids, kind: str) -> dict:
    eos, never = stop_ids
    return dict(eos_token_id=eos if kind == "int" else [never, eos], bos_token_id=1, pad_token_id=0)


def _from_config(llama, ids, **overrides) -> AttnResForCausalLM:
    model = AttnResForCausalLM(AttnResConfig(**{**TINY, **ids}, depth_mixing="residual", **overrides))
    model.load_state_dict(llama.state_dict())
    return model.eval()


def _saved(llama, ids, tmp_path):
    _from_config(llama, ids).save_pretrained(tmp_path / "saved")
    return AttnResForCausalLM.from_pretrained(tmp_path / "saved").eval()


MADE = {
    "config": lambda llama, ids, tmp_path: _from_config(llama, ids),
    "saved-reloaded": _saved,
    "retrofit-residual": lambda llama, ids, tmp_path: retrofit(llama, depth_mixing="residual"),
    "retrofit-block": lambda llama, ids, tmp_path: retrofit(llama, attnres_block_size=2),
    "retrofit-full": lambda llama, ids, tmp_path: retrofit(llama, attnres_block_size=1),
}
"""The ways an AttnRes model equal to a Llama is made (retrofits: exact up to float rounding)."""


@pytest.mark.parametrize("kind", ["int", "list"])
@pytest.mark.parametrize("made", list(MADE))
def test_generation_stops_at_eos_where_the_equal_llama_stops(stop_ids, made, kind, tmp_path):
    ids = _ids(stop_ids, kind)
    llama = _llama(**ids)
    model = MADE[made](llama, ids, tmp_path)
    for name in ids:
        assert getattr(model.generation_config, name) == getattr(llama.generation_config, name), name
    want = _greedy(llama, PROMPTS[:1])
    assert want.shape[1] < PROMPTS.shape[1] + NEW_TOKENS and want[0, -1] == stop_ids[0]  # the Llama stops at its EOS
    assert torch.equal(_greedy(model, PROMPTS[:1]), want)
    want = _greedy(llama)  # a batch: the finished prompt is padded with pad_token_id while the other goes on
    assert (want[0, PROMPTS.shape[1]:] == 0).any()
    assert torch.equal(_greedy(model), want)


def test_every_generation_attribute_the_backbone_holds_is_in_the_generation_config(stop_ids):
    ids = _ids(stop_ids, "list")
    llama, model = _llama(**ids), _from_config(_llama(**ids), ids)
    assert model.generation_config.to_diff_dict() == llama.generation_config.to_diff_dict()


@pytest.mark.parametrize("folder", ["no-generation-config", "derived-without-ids", "written-by-a-person"])
def test_a_folder_gets_the_backbone_ids_unless_its_generation_config_says_otherwise(stop_ids, folder, tmp_path):
    ids = _ids(stop_ids, "int")
    _from_config(_llama(**ids), ids).save_pretrained(tmp_path)
    path = tmp_path / "generation_config.json"
    if folder == "no-generation-config":  # transformers derives it from config.json's top level
        path.unlink()
    elif folder == "derived-without-ids":  # as this package saved it before the backbone's ids were read
        path.write_text(json.dumps({"_from_model_config": True, "transformers_version": "5.24.0"}))
    else:
        GenerationConfig(eos_token_id=7, max_new_tokens=3).save_pretrained(tmp_path)
    config = AttnResForCausalLM.from_pretrained(tmp_path).generation_config
    if folder == "written-by-a-person":
        assert (config.eos_token_id, config.max_new_tokens, config.pad_token_id) == (7, 3, None)
    else:
        assert (config.eos_token_id, config.bos_token_id, config.pad_token_id) == (stop_ids[0], 1, 0)


def test_pipeline_stops_where_the_llama_pipeline_stops(stop_ids):
    ids = _ids(stop_ids, "int")
    llama = _llama(**ids)
    tokenizer = word_tokenizer()
    prompt = " ".join(f"w{t}" for t in PROMPTS[0].tolist())

    def run(model):
        generator = pipeline("text-generation", model=model, tokenizer=tokenizer, device="cpu")
        return generator(prompt, max_new_tokens=NEW_TOKENS, do_sample=False, return_full_text=False)[0]

    want = run(llama)["generated_text"]
    assert len(want.split()) < NEW_TOKENS  # it stopped at the EOS
    assert run(_from_config(llama, ids))["generated_text"] == want


@pytest.mark.parametrize("config_eos", ["int", "list"])
def test_trainer_token_alignment_updates_the_backbone_and_generation_config(stop_ids, config_eos, tmp_path):
    """transformers' `align_special_tokens` (what `Trainer` runs before training) gives the AttnRes model the
    tokenizer's ids exactly as it gives them to the equal Llama, and they survive a save."""
    ids = _ids(stop_ids, config_eos) | {"bos_token_id": 4, "pad_token_id": 5}  # the tokenizer's are 2, 1 and 0
    llama = _llama(**ids)
    model = _from_config(llama, ids)
    align_special_tokens(llama, word_tokenizer())
    align_special_tokens(model, word_tokenizer())
    for name in ids:
        assert getattr(model.config.backbone, name) == getattr(llama.config, name), name
        assert getattr(model.generation_config, name) == getattr(llama.generation_config, name), name
    assert model.generation_config.eos_token_id[0] == 2 and stop_ids[0] in model.generation_config.eos_token_id
    model.save_pretrained(tmp_path)
    assert "eos_token_id" not in json.loads((tmp_path / "config.json").read_text())  # one home: the backbone
    reloaded = AttnResForCausalLM.from_pretrained(tmp_path)
    assert reloaded.config.eos_token_id == llama.config.eos_token_id
    assert reloaded.generation_config.eos_token_id == llama.generation_config.eos_token_id


def test_a_source_generation_config_eos_list_is_a_stop_token_of_the_converted_folder(stop_ids, tmp_path):
    eos, never = stop_ids
    llama = _llama(eos_token_id=never, bos_token_id=1, pad_token_id=0)  # config.json: one id, as Llama 3's
    llama.generation_config.eos_token_id = [never, eos]  # generation_config.json: every end token
    llama.save_pretrained(tmp_path / "source")
    assert retrofit(llama).generation_config.eos_token_id == [never, eos]
    convert(tmp_path / "source", tmp_path / "out", attnres_block_size=2)
    written = json.loads((tmp_path / "out" / "generation_config.json").read_text())
    assert written["eos_token_id"] == [never, eos]
    converted = AttnResForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert torch.equal(_greedy(converted), _greedy(load_source(tmp_path / "source")))
    assert _greedy(converted, PROMPTS[:1])[0, -1] == eos  # the generation config's second end token stops it


@pytest.mark.parametrize("declared", ["eos", "eos-eot-eom", "eot-equals-eos"])
def test_every_end_token_of_a_gguf_file_is_a_stop_token_of_the_converted_folder(stop_ids, declared, tmp_path):
    eos, never = stop_ids
    llama = _llama(eos_token_id=never, bos_token_id=1, pad_token_id=0)
    metadata = {"eos": {}, "eos-eot-eom": {"tokenizer.ggml.eot_token_id": eos, "tokenizer.ggml.eom_token_id": 9},
                "eot-equals-eos": {"tokenizer.ggml.eot_token_id": never}}[declared]
    path = write_gguf(llama, tmp_path / "tiny.gguf", metadata=metadata)
    want = {"eos": [never], "eos-eot-eom": [never, eos, 9], "eot-equals-eos": [never]}[declared]
    assert gguf_stop_token_ids(path) == want  # llama.cpp's end-of-generation ids, each once
    source = load_source(path)
    assert source.generation_config.eos_token_id == (want if len(want) > 1 else want[0])
    serializable_copy(source).save_pretrained(tmp_path / "hf-copy")  # the demo's HF-format copy of a GGUF file
    copied = json.loads((tmp_path / "hf-copy" / "generation_config.json").read_text())
    assert copied["eos_token_id"] == source.generation_config.eos_token_id
    convert(path, tmp_path / "out", attnres_block_size=2)
    converted = AttnResForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert converted.generation_config.eos_token_id == source.generation_config.eos_token_id
    assert torch.equal(_greedy(converted), _greedy(source))
    out = _greedy(converted, PROMPTS[:1])
    stops = out.shape[1] < PROMPTS.shape[1] + NEW_TOKENS
    assert stops == (declared == "eos-eot-eom")  # it stops at the eot id only when the file declares it
    assert not stops or out[0, -1] == eos


def test_a_gguf_file_without_end_tokens_declares_none(tmp_path):
    llama = _llama(eos_token_id=None, bos_token_id=None, pad_token_id=None)
    assert gguf_stop_token_ids(write_gguf(llama, tmp_path / "tiny.gguf")) == []


@pytest.mark.slow
def test_transformers_serve_stops_at_the_backbone_eos(stop_ids, tmp_path):
    """`attnres serve` (transformers' own server) answers what the equal Llama generates: up to its EOS."""
    from test_serving import _request, _running_server

    ids = _ids(stop_ids, "int")
    llama = _llama(**ids)
    _from_config(llama, ids).save_pretrained(tmp_path / "model")
    tokenizer = word_tokenizer()
    tokenizer.save_pretrained(tmp_path / "model")
    want = _greedy(llama, PROMPTS[:1])[0, PROMPTS.shape[1]:]
    assert want[-1] == stop_ids[0] and len(want) < NEW_TOKENS
    payload = {"prompt": " ".join(f"w{t}" for t in PROMPTS[0].tolist()), "max_tokens": NEW_TOKENS, "temperature": 0}
    with _running_server(tmp_path / "model", tmp_path / "server.log") as base:
        answer = json.loads(_request(f"{base}/v1/completions", payload))["choices"][0]["text"]
    assert answer.split() == tokenizer.decode(want, skip_special_tokens=True).split()
