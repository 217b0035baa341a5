"""`attnres serve`: transformers' own OpenAI-compatible server on a tiny AttnRes folder, answers equal to `generate`.

Each server runs in a subprocess on 127.0.0.1 and a free port; every request and the start have a timeout, and the
server is terminated (then killed) whatever happens.
"""

import contextlib
import functools
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import attnres_hf
from attnres_hf.quantization import qlora_quantization_config
from utils import FOUR_BIT_SHAPE, tiny_model, word_tokenizer

CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }} {% endfor %}"
START_TIMEOUT_S = 300
SIGTERM_TIMEOUT_S = 30
"""How long a server may take to exit after SIGTERM (measured: 3-6 s on 2 busy cores, most of it the interpreter's
own teardown; continuous batching included, which before `serving._stop_generation_workers` never exited)."""
REQUEST_TIMEOUT_S = 180  # generous: the test machines are shared
MAX_TOKENS = 6
PROMPTS = ["w5 w6 w7", "w40 w41 w42 w43 w44"]


def _chat_folder(root: Path, **shape) -> Path:
    """A saved tiny AttnRes model (trained-like routers) with a word tokenizer that has a chat template."""
    folder = root / "model"
    tiny_model(seed=3, **shape).save_pretrained(folder)
    tokenizer = word_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def chat_model_dir(tmp_path_factory):
    return _chat_folder(tmp_path_factory.mktemp("served"))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _request(url: str, payload: dict | None = None) -> bytes:
    data = None if payload is None else json.dumps(payload).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as response:
        return response.read()


@contextlib.contextmanager
def _running_server(folder, log: Path, *options: str):
    """`attnres serve folder options` on 127.0.0.1 and a free port; yields its base URL, then stops it."""
    port = _free_port()
    source = str(Path(attnres_hf.__file__).parents[1])  # the attnres_hf under test, installed or not
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([source, os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "attnres_hf.cli", "serve", str(folder), "--host", "127.0.0.1"]
    command += ["--port", str(port), "--device", "cpu", *options]
    with open(log, "wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if process.poll() is not None:
                pytest.fail(f"the server exited with {process.returncode}:\n{log.read_text()[-3000:]}")
            try:
                _request(f"{base}/health")
                break
            except (urllib.error.URLError, ConnectionError):
                if time.monotonic() > deadline:
                    pytest.fail(f"the server did not answer within {START_TIMEOUT_S} s:\n{log.read_text()[-3000:]}")
                time.sleep(0.5)
        yield base
    finally:
        process.terminate()
        try:
            process.wait(timeout=SIGTERM_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=20)
            pytest.fail(f"the server outlived SIGTERM by {SIGTERM_TIMEOUT_S} s:\n{log.read_text()[-3000:]}")


# --cb-num-blocks: without it transformers' continuous batching reserves 60% of a CPU machine's memory for its paged
# KV cache (14.2 GB of 23, the test suite's peak)
@pytest.fixture(scope="module", params=[[], ["--continuous-batching", "--cb-num-blocks", "16"]],
                ids=["generate", "continuous-batching"])
def server(request, chat_model_dir, tmp_path_factory):
    with _running_server(chat_model_dir, tmp_path_factory.mktemp("log") / "server.log", *request.param) as base:
        yield base, str(chat_model_dir)


@functools.cache
def _load(folder: str, four_bit: bool = False):
    kwargs = {"quantization_config": qlora_quantization_config()} if four_bit else {}
    return AutoTokenizer.from_pretrained(folder), AutoModelForCausalLM.from_pretrained(folder, **kwargs).eval()


def _expected(folder: str, prompt: str, chat: bool, four_bit: bool = False) -> str:
    """Greedy `generate` of the same folder on the same prompt, decoded as the server decodes."""
    tokenizer, model = _load(folder, four_bit)
    if chat:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )["input_ids"]
    else:
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False)
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


def _ask(base: str, endpoint: str, prompt: str, stream: bool) -> str:
    payload = {"max_tokens": MAX_TOKENS, "temperature": 0, "stream": stream}
    if endpoint == "chat/completions":
        payload["messages"] = [{"role": "user", "content": prompt}]
    else:
        payload["prompt"] = prompt
    body = _request(f"{base}/v1/{endpoint}", payload).decode()
    if not stream:
        choice = json.loads(body)["choices"][0]
        return choice["message"]["content"] if endpoint == "chat/completions" else choice["text"]
    pieces = []
    for line in body.splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        choice = json.loads(line[len("data: ") :])["choices"][0]
        pieces.append((choice.get("delta") or {}).get("content") or choice.get("text") or "")
    return "".join(pieces)


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("endpoint", ["chat/completions", "completions"])
def test_served_answer_equals_generate(server, endpoint, stream):
    base, folder = server
    for prompt in PROMPTS:
        expected = _expected(folder, prompt, chat=endpoint == "chat/completions")
        assert len(expected.split()) == MAX_TOKENS  # no early end of sequence: the whole answer is compared
        assert _ask(base, endpoint, prompt, stream).strip() == expected.strip()


@pytest.mark.slow
def test_two_concurrent_requests(server):
    base, folder = server
    with ThreadPoolExecutor(max_workers=2) as pool:
        answers = list(pool.map(lambda prompt: _ask(base, "chat/completions", prompt, False), PROMPTS))
    assert [a.strip() for a in answers] == [_expected(folder, p, chat=True).strip() for p in PROMPTS]


@pytest.mark.slow
def test_models_lists_the_folder(server):
    base, folder = server
    assert [model["id"] for model in json.loads(_request(f"{base}/v1/models"))["data"]] == [folder]


@pytest.mark.slow
def test_four_bit_server_answers_as_the_four_bit_model(tmp_path):
    """`--quantization bnb-4bit` is transformers serve's NF4 + double quantization, QLoRA's 4-bit load."""
    folder = _chat_folder(tmp_path, **FOUR_BIT_SHAPE)
    with _running_server(folder, tmp_path / "server.log", "--quantization", "bnb-4bit") as base:
        answer = _ask(base, "chat/completions", PROMPTS[0], stream=False)
    assert answer.strip() == _expected(str(folder), PROMPTS[0], chat=True, four_bit=True).strip()


REFUSED = {"after": ["FOLDER", "--quantization", "bnb-4bit"], "before": ["--quantization=bnb-4bit", "FOLDER"],
           "device-cpu": ["--device", "cpu", "FOLDER", "--quantization", "bnb-4bit"],
           "last-wins": ["FOLDER", "--quantization", "bnb-8bit", "--quantization", "bnb-4bit"],
           "saved-in-4-bit": ["FOLDER-4BIT"]}


@pytest.fixture
def cpu_kernel_repacks(monkeypatch):
    """bitsandbytes' AVX-512 BF16 repacking forced on and no GPU, so that the refusal is tested on every machine."""
    from attnres_hf import quantization

    monkeypatch.setattr(quantization, "cpu_4bit_repacking", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.mark.parametrize("argv", REFUSED.values(), ids=REFUSED.keys())
def test_four_bit_server_refuses_shapes_the_cpu_kernel_cannot_run(argv, chat_model_dir, tmp_path, cpu_kernel_repacks,
                                                                  capsys):
    """Where bitsandbytes repacks 4-bit weights for its AVX-512 BF16 CPU kernel, a folder with a layer it cannot run
    (hidden 32: in_features not a multiple of 64) is refused in one line before the server starts, instead of an HTTP
    500 at every request: the options parsed as `transformers serve` parses them, and a folder saved in 4 bits too."""
    from attnres_hf.cli import main

    four_bit = tmp_path / "four-bit"
    if "FOLDER-4BIT" in argv:
        AutoModelForCausalLM.from_pretrained(chat_model_dir, quantization_config=qlora_quantization_config()
                                             ).save_pretrained(four_bit)
    folders = {"FOLDER": str(chat_model_dir), "FOLDER-4BIT": str(four_bit)}
    capsys.readouterr()
    assert main(["serve", *[folders.get(arg, arg) for arg in argv], "--port", str(_free_port())]) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("attnres serve: error: bitsandbytes' 4-bit CPU kernel") and "\n" not in error
    assert "model.layers.0.self_attn.q_proj (32 -> 32) and 17 more layers are not" in error


def test_four_bit_check_leaves_other_loads_to_the_server(chat_model_dir, tmp_path, cpu_kernel_repacks):
    """No refusal where the load is not 4-bit on the CPU, where the folder's layers run, or where transformers has no
    causal-LM class for the folder (transformers serve reports that itself, as it would without attnres)."""
    from attnres_hf.serving import _check_cpu_4bit

    fits = _chat_folder(tmp_path / "fits", **FOUR_BIT_SHAPE)
    (tmp_path / "vision").mkdir()
    (tmp_path / "vision" / "config.json").write_text(json.dumps({"model_type": "clip_vision_model"}))
    for folder, options in [(chat_model_dir, {"quantization": "bnb-8bit"}), (chat_model_dir, {}),
                            (chat_model_dir, {"quantization": "bnb-4bit", "device": "cuda"}),
                            (fits, {"quantization": "bnb-4bit"}), (tmp_path / "vision", {"quantization": "bnb-4bit"})]:
        _check_cpu_4bit(str(folder), options)
    with pytest.raises(ValueError, match="more layers are not"):
        _check_cpu_4bit(str(chat_model_dir), {"quantization": "bnb-4bit", "device": "auto"})


def test_register_with_transformers_is_idempotent():
    import transformers

    from attnres_hf.serving import SERVED_CLASSES, register_with_transformers

    register_with_transformers()
    register_with_transformers()
    assert all(getattr(transformers, cls.__name__) is cls for cls in SERVED_CLASSES)


def test_serve_rejects_a_folder_without_config(tmp_path, capsys):
    from attnres_hf.cli import main

    assert main(["serve", str(tmp_path), "--port", "1"]) == 2
    assert "has no config.json" in capsys.readouterr().err


@pytest.mark.slow
def test_transformers_serve_with_remote_code_alone_still_fails(chat_model_dir, tmp_path):
    """The upstream limit the README states: transformers 5.24's server looks the class up on the `transformers`
    module, so remote code alone cannot serve the folder. When this fails, transformers fixed it: update the README."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"HF_MODULES_CACHE": str(tmp_path)}
    command = [sys.executable, "-m", "transformers.cli.transformers", "serve", str(chat_model_dir),
               "--trust-remote-code", "--device", "cpu", "--host", "127.0.0.1", "--port", str(_free_port())]
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=START_TIMEOUT_S, env=env)
    except subprocess.TimeoutExpired:
        pytest.fail("transformers serve started with remote code alone: the README's upstream limit is gone")
    assert result.returncode != 0
    assert "has no attribute AttnResForCausalLM" in result.stderr + result.stdout
