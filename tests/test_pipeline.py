"""`pipeline("text-generation", model=folder)` and chat templates on a saved AttnRes folder, with the package
installed (Auto registry) and with `trust_remote_code=True` alone (the folder's own modeling files)."""

import os
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

from utils import tiny_model, word_tokenizer

CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }} {% endfor %}"


@pytest.fixture(scope="module")
def chat_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("pipeline") / "model"
    tiny_model(seed=4).save_pretrained(folder)
    tokenizer = word_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)
    return folder


def _greedy(folder, ids, new_tokens):
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False)
    return out[0, len(ids) :].tolist()


def test_text_generation_pipeline_on_a_prompt_and_on_chat_messages(chat_folder):
    generator = pipeline("text-generation", model=str(chat_folder))
    tokenizer = AutoTokenizer.from_pretrained(chat_folder)
    prompt = "w5 w6 w7 w8"
    text = generator(prompt, max_new_tokens=5, do_sample=False, return_full_text=False)[0]["generated_text"]
    expected = _greedy(chat_folder, tokenizer(prompt)["input_ids"], 5)
    assert text.split() == tokenizer.decode(expected, skip_special_tokens=True).split()

    messages = [{"role": "user", "content": "w10 w11 w12"}]
    reply = generator(messages, max_new_tokens=5, do_sample=False)[0]["generated_text"][-1]
    chat_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    assert reply["role"] == "assistant"
    assert reply["content"].split() == tokenizer.decode(_greedy(chat_folder, chat_ids, 5), skip_special_tokens=True).split()


@pytest.mark.slow
def test_pipeline_with_trust_remote_code_alone(chat_folder, tmp_path):
    """A process that never imports attnres_hf: the folder's `auto_map` and modeling files are enough."""
    code = (
        "import sys; from transformers import pipeline\n"
        f"g = pipeline('text-generation', model={str(chat_folder)!r}, trust_remote_code=True)\n"
        "assert 'attnres_hf' not in sys.modules, 'the package was imported'\n"
        "print(g([{'role': 'user', 'content': 'w10 w11 w12'}], max_new_tokens=5, do_sample=False)"
        "[0]['generated_text'][-1]['content'])\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"HF_MODULES_CACHE": str(tmp_path)}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                            env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    generator = pipeline("text-generation", model=str(chat_folder))
    expected = generator([{"role": "user", "content": "w10 w11 w12"}], max_new_tokens=5, do_sample=False)
    assert result.stdout.split() == expected[0]["generated_text"][-1]["content"].split()


def test_converted_checkpoint_chats_as_its_source_and_its_card_says_how_to_serve(tmp_path):
    """A retrofit computes its source's function at conversion time, so its chat replies are the source's."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from attnres_hf.conversion import convert
    from utils import TINY

    torch.manual_seed(0)
    source = LlamaForCausalLM(LlamaConfig(**TINY)).eval()
    tokenizer = word_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    convert(source, tmp_path / "converted", tokenizer=tokenizer, source_name="tiny-llama", dtype="float32")
    messages = [{"role": "user", "content": "w10 w11 w12"}]
    reply = pipeline("text-generation", model=str(tmp_path / "converted"))(messages, max_new_tokens=6, do_sample=False)
    want = pipeline("text-generation", model=source, tokenizer=tokenizer)(messages, max_new_tokens=6, do_sample=False)
    assert reply[0]["generated_text"][-1]["content"] == want[0]["generated_text"][-1]["content"]
    assert len(reply[0]["generated_text"][-1]["content"].split()) == 6
    card = (tmp_path / "converted" / "README.md").read_text()
    assert "attnres serve converted --port 8000" in card
    assert 'BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")' in card  # NF4, not load_in_4bit's FP4
    assert "attnres train converted --data train.txt --method lora" in card
