"""Serve an AttnRes folder behind transformers' own OpenAI-compatible server (`transformers serve`).

`transformers serve` (transformers 5.24, `transformers/cli/serving/model_manager.py`) loads a model as
`getattr(transformers, config.architectures[0]).from_pretrained(...)`: it finds a class by its name on the
`transformers` module, not through the Auto registry, so a folder whose architecture is `AttnResForCausalLM`
fails with `AttributeError: module transformers has no attribute AttnResForCausalLM`, even with
`--trust-remote-code` (the remote class is never put on that module). `attnres serve` registers this package's
classes with the Auto classes (importing `attnres_hf` does) and under their names on the `transformers` module,
then hands every argument over to transformers' own `serve` command unchanged: same endpoints
(`/v1/chat/completions`, `/v1/completions`, `/v1/models`, `/health`), same options (`--port`, `--host`,
`--continuous-batching`, `--quantization bnb-4bit`, ...).

    attnres serve path/to/attnres-folder --port 8000
    curl localhost:8000/v1/chat/completions -H 'Content-Type: application/json' \
        -d '{"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 20, "temperature": 0}'

Needs the `serve` extra: `pip install "attnres-hf[serve]"` (transformers' `serving` extra: fastapi, uvicorn,
openai, pydantic).
"""

from __future__ import annotations

import os
import sys

import transformers

from . import AttnResConfig, AttnResForCausalLM, AttnResModel

SERVED_CLASSES = (AttnResConfig, AttnResModel, AttnResForCausalLM)
"""The classes `transformers serve` may look up by name (`config.architectures[0]`)."""


def register_with_transformers() -> None:
    """Make this package's classes reachable as `transformers.<ClassName>`, as transformers' own model classes are.

    Idempotent; a name transformers already defines is never replaced. The Auto-class registration
    (`AutoModelForCausalLM.register`) is done by importing `attnres_hf`.

    Raises:
        RuntimeError: transformers defines another class under one of these names.
    """
    for cls in SERVED_CLASSES:
        if getattr(transformers, cls.__name__, cls) is not cls:
            raise RuntimeError(f"transformers already defines a different {cls.__name__}; cannot serve AttnRes")
        setattr(transformers, cls.__name__, cls)


def main(argv: list[str] | None = None) -> int:
    """`attnres serve [MODEL] [transformers serve options]`: register the AttnRes classes, then run transformers'
    own `serve` command with `argv` (all of `transformers serve --help` applies). Returns the exit code.

    Raises:
        ImportError: the serving dependencies are missing (install `attnres-hf[serve]`).
        FileNotFoundError: MODEL is a local folder without `config.json`.
        ValueError: a 4-bit load (`--quantization bnb-4bit`, or a folder saved in 4 bits) on a CPU whose bitsandbytes
            kernel cannot run the folder's layer shapes (`quantization.check_4bit_shapes`).
    """
    from transformers.utils.import_utils import is_serve_available

    argv = list(sys.argv[1:] if argv is None else argv)
    if not is_serve_available():
        raise ImportError('attnres serve needs fastapi, uvicorn, openai and pydantic: pip install "attnres-hf[serve]"')
    from transformers.cli.transformers import app

    register_with_transformers()  # before the 4-bit check too: it builds the class `config.architectures` names
    options = app.get_command(None, "serve").make_context("serve", list(argv), resilient_parsing=True).params
    folder = options.get("force_model")
    if folder and os.path.isdir(folder) and "--help" not in argv:
        if not os.path.isfile(os.path.join(folder, "config.json")):
            raise FileNotFoundError(f"{folder} has no config.json: give a model folder (e.g. from `attnres convert`)")
        _check_cpu_4bit(folder, options)

    # typer/click parse the arguments, print `--help` and report bad options exactly as `transformers serve` does,
    # then exit: the code of that exit is returned.
    try:
        app(args=["serve", *argv], prog_name="attnres")
    except SystemExit as exit_:
        return exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    finally:
        _stop_generation_workers()
    return 0


def _stop_generation_workers() -> None:
    """Stop the generation workers transformers' server leaves running once it has stopped (SIGTERM or SIGINT:
    uvicorn ends the blocking `Serve`). transformers 5.24 stops them only in `Serve.kill_server`, the non-blocking
    path's, and `--continuous-batching`'s worker is a non-daemon thread: without this the process outlived SIGTERM.
    The server's `GenerationState` is found among live objects (the command keeps no reference to it);
    `GenerationState.shutdown` is transformers' own."""
    import gc

    from transformers.cli.serving.utils import GenerationState

    # (`type(obj) is`, not `isinstance`: that reads `__class__`, which makes lazy proxies such as openai's import)
    for state in [obj for obj in gc.get_objects() if type(obj) is GenerationState]:
        state.shutdown()


def _check_cpu_4bit(folder: str, options: dict) -> None:
    """Before the server starts: refuse a 4-bit load on the CPU (`--quantization bnb-4bit`, or a folder saved in 4
    bits) of a folder whose layers bitsandbytes' CPU kernel cannot run here (`quantization.check_4bit_shapes`), which
    would answer every request with an HTTP 500. A folder transformers cannot build a model class for is left to
    `transformers serve` to report."""
    import torch
    from transformers import AutoConfig, BitsAndBytesConfig

    from .quantization import unsupported_4bit_message, unsupported_4bit_shapes

    device, trust = options.get("device") or "auto", bool(options.get("trust_remote_code"))
    if not (device == "cpu" or (device == "auto" and not torch.cuda.is_available())):
        return
    config = AutoConfig.from_pretrained(folder, trust_remote_code=trust)
    saved = getattr(config, "quantization_config", None)
    saved = BitsAndBytesConfig.from_dict(saved) if isinstance(saved, dict) and saved.get("load_in_4bit") else None
    if options.get("quantization") != "bnb-4bit" and saved is None:
        return
    try:
        bad = unsupported_4bit_shapes(config, saved, trust_remote_code=trust)
    except (ValueError, KeyError, TypeError, ImportError, OSError, AttributeError):  # no model class for the folder:
        return  # transformers serve says so itself
    if bad:
        raise ValueError(unsupported_4bit_message(bad))


if __name__ == "__main__":
    sys.exit(main())
