"""Checks made before any model is loaded, for `attnres eval`, `attnres lm-eval` and the Python API: argument types
and values, the code-execution opt-ins, the local data, the model and output folders. Each failure is one line that
names the fix.
"""

from __future__ import annotations

import math
import os
import re
import shlex
from collections.abc import Sequence
from pathlib import Path

from .benchmarks import BENCHMARKS, PAPER_TABLE, Benchmark
from .code_execution import OPT_IN_VARIABLE, REFUSAL, CodeExecutionNotAllowed
from .local import check_prepared, fewshot_capacity

PAPER_TAG = "offline_paper_table"  # the `tag:` of the pack's paper-table tasks (their YAML files)


def check_type(name: str, value, types, optional: bool = False) -> None:
    """TypeError naming `name` and the expected type(s) unless `value` is an instance (None allowed if `optional`).
    A bool is not accepted as a number."""
    types = types if isinstance(types, tuple) else (types,)
    if value is None and optional:
        return
    numeric = any(t in (int, float) for t in types)
    if not isinstance(value, types) or (numeric and bool not in types and isinstance(value, bool)):
        expected = " or ".join(getattr(t, "__name__", str(t)) for t in types) + (" or None" if optional else "")
        raise TypeError(f"{name} must be {expected}, got {type(value).__name__} {value!r}")


def _model_folder(model) -> Path | None:
    return Path(model) if isinstance(model, (str, os.PathLike)) else None


def preflight(benchmarks: list[Benchmark], allow_code_execution: bool, data_dir: str | os.PathLike | None,
              models=(), output_dir: str | os.PathLike | None = None, limit: float | None = None,
              num_fewshot: int | None = None, batch_size: int = 1) -> None:
    """Checks made before any model is loaded: task settings, the code-execution opt-in, the local data (parsed and
    counted), the model folders, and that the output folder would not replace a model folder.

    Raises:
        CodeExecutionNotAllowed: a benchmark executes generated code and there is no opt-in.
        MissingBenchmarkData: a benchmark's local data is not prepared (names the command that prepares it).
        ValueError: a bad limit, few-shot count or batch size, malformed local data, or an output folder that is,
            or holds, a model folder.
        FileNotFoundError: a model folder (or its config.json) does not exist.
        TypeError: an argument of the wrong type.
    """
    check_type("limit", limit, (int, float), optional=True)
    check_type("num_fewshot", num_fewshot, int, optional=True)
    check_type("allow_code_execution", allow_code_execution, bool)
    check_type("data_dir", data_dir, (str, os.PathLike), optional=True)
    check_type("output_dir", output_dir, (str, os.PathLike), optional=True)
    if not all(isinstance(b, Benchmark) for b in benchmarks):
        raise TypeError("benchmarks must be records from attnres_hf.eval.BENCHMARKS (see resolve_benchmarks)")
    if limit is not None and not (limit >= 1 and float(limit).is_integer() or 0 < limit < 1):
        raise ValueError(f"--limit must be a whole number of questions (>= 1) or a fraction in (0, 1), got {limit}")
    check_batch_size(batch_size)
    if num_fewshot is not None and num_fewshot < 0:
        raise ValueError(f"--num-fewshot must be at least 0, got {num_fewshot}")
    executing = [b.title for b in benchmarks if b.executes_code]
    if executing and not allow_code_execution:
        raise CodeExecutionNotAllowed(f"refusing to run {', '.join(executing)} without --allow-code-execution: "
                                      + REFUSAL)
    for benchmark in benchmarks:
        check_prepared(benchmark.name, data_dir, validate=True)
        if num_fewshot:
            capacity = fewshot_capacity(benchmark.name, data_dir)
            if capacity is None:
                raise ValueError(f"{benchmark.title} is evaluated 0-shot (as lm-eval's version); drop --num-fewshot "
                                 "or run it separately")
            if num_fewshot > capacity:
                raise ValueError(f"--num-fewshot {num_fewshot}: {benchmark.title} has at most {capacity} few-shot "
                                 "examples for some of its questions")
    for model in models:
        folder = _model_folder(model)
        if folder is not None and not (folder / "config.json").is_file():
            raise FileNotFoundError(f"{folder} is not a model folder (no config.json); runs are offline, so models "
                                    "are local folders")
    if output_dir is not None:
        out = Path(output_dir).resolve()
        for model in models:
            folder = _model_folder(model)
            if folder is not None and (out == folder.resolve() or out in folder.resolve().parents):
                raise ValueError(f"--output-dir {output_dir} is or holds the model folder {folder}; choose another")


def lm_eval_run_settings(argv: Sequence[str]) -> dict | None:
    """What an lm-eval command line runs, read by lm-eval's own parser (`lm_eval._cli.HarnessCLI`: `run` implied
    when no subcommand is given, `--tasks`/`-t` space- or comma-separated, `--model_args`/`-a` as `k=v,k=v`, separate
    `k=v` words or JSON, repeated ones merged) over its `--config` YAML file, which the command line overrides as
    `EvaluatorConfig.from_cli` merges them.

    Returns:
        `{"model": str, "tasks": [str], "model_args": dict, "confirm_run_unsafe_code": bool}`, or None for another
        subcommand (`ls`, `validate`) or a help request. A command line lm-eval's parser refuses exits with its usage
        error (status 2), as lm-eval would.
    """
    from lm_eval._cli.harness import HarnessCLI
    from lm_eval.config.evaluate_config import EvaluatorConfig
    from lm_eval.utils import simple_parse_args_string

    cli, argv = HarnessCLI(), list(argv)
    if {"-h", "--help"} & set(argv):
        return None
    if len(argv) > 1 and argv[0] not in cli._subparsers.choices:  # lm-eval's legacy form (HarnessCLI.parse_args)
        argv = ["run", *argv]
    namespace = cli._parser.parse_args(argv)
    if namespace.command != "run":
        return None
    settings = EvaluatorConfig.load_yaml_config(namespace.config) if getattr(namespace, "config", None) else {}
    settings |= {k: v for k, v in vars(namespace).items() if (v or v == 0) and k not in ("command", "func")}
    tasks = settings.get("tasks") or []
    tasks = tasks.split(",") if isinstance(tasks, str) else [str(t) for t in tasks]
    model_args = settings.get("model_args") or {}
    if isinstance(model_args, str):
        model_args = simple_parse_args_string(model_args)
    return {"model": settings.get("model") or "hf", "tasks": [t.strip() for t in tasks if t.strip()],
            "model_args": dict(model_args), "confirm_run_unsafe_code": bool(settings.get("confirm_run_unsafe_code"))}


def code_executing_tasks(tasks: str | Sequence[str]) -> list[Benchmark]:
    """The benchmarks among lm-eval task names (the pack's `offline_humaneval`, the `offline_paper_table` tag, and
    lm-eval's own `humaneval`, `mbpp`, ... tasks) whose scoring executes model-written code."""
    names = tasks.split(",") if isinstance(tasks, str) else list(tasks)
    chosen = []
    for name in (n.strip() for n in names):
        if name == PAPER_TAG:
            chosen += [BENCHMARKS[n] for n in PAPER_TABLE]
        elif name.startswith("offline_") and name.removeprefix("offline_") in BENCHMARKS:
            chosen.append(BENCHMARKS[name.removeprefix("offline_")])
        else:  # lm-eval's own tasks of a code benchmark (`humaneval`, `mbpp_plus`, ...) execute code too
            chosen += [b for b in BENCHMARKS.values() if name == b.name or name.startswith(b.name + "_")]
    return [b for b in dict.fromkeys(chosen) if b.executes_code]


def check_lm_eval_arguments(argv: Sequence[str] | str) -> None:
    """Checks `attnres lm-eval` makes on lm-eval's own arguments before lm-eval loads a model: a
    `--model_args pretrained=` folder must exist, and a task that executes generated code (HumanEval, MBPP) needs
    both lm-eval's `--confirm_run_unsafe_code` and `HF_ALLOW_CODE_EVAL=1` in the environment (lm-eval itself refuses
    the first only after loading the model, and the second only after generating every completion).

    Raises:
        FileNotFoundError: a missing model folder. CodeExecutionNotAllowed: an opt-in is missing (the message names
            it).
    """
    from .._checks import check_model_source

    argv = shlex.split(argv) if isinstance(argv, str) else list(argv)
    settings = lm_eval_run_settings(argv)
    if settings is None:
        return
    executing = code_executing_tasks(settings["tasks"])
    titles = ", ".join(b.title for b in executing)
    if executing and not settings["confirm_run_unsafe_code"]:
        raise CodeExecutionNotAllowed(f"refusing to run {titles}: pass --confirm_run_unsafe_code (and set "
                                      f"{OPT_IN_VARIABLE}=1) to execute model-written code. " + REFUSAL)
    if executing and os.environ.get(OPT_IN_VARIABLE) != "1":
        raise CodeExecutionNotAllowed(f"refusing to run {titles}: set {OPT_IN_VARIABLE}=1 in the environment as well "
                                      "as passing --confirm_run_unsafe_code (the sandbox executes a program only "
                                      "with both)")
    model_args = settings["model_args"]
    if isinstance(model_args.get("pretrained"), str) and model_args["pretrained"]:
        check_model_source(model_args["pretrained"], "model folder (--model_args pretrained=)")


def check_batch_size(batch_size) -> int | str:
    """lm-eval's `batch_size` (HFLM's, with its meaning): a positive int, or its digits as a string (as lm-eval's
    command line passes it); `"auto"`, the largest batch that fits, searched from `max_batch_size` down; or
    `"auto:N"`, that search repeated N times over the run as the (length-sorted) requests get shorter, N > 0.

    Returns:
        the int, or the `"auto"` / `"auto:N"` string, to pass to HFLM.

    Raises:
        TypeError: neither int nor str. ValueError: below 1, or a string of another form (lm-eval would take
            `"autofoo"` as a batch size and `"auto:0"` divides by zero, both after loading).
    """
    check_type("batch_size", batch_size, (int, str))
    if isinstance(batch_size, str):
        if batch_size.isascii() and batch_size.isdigit():
            batch_size = int(batch_size)
        elif batch_size == "auto":
            return batch_size
        else:
            schedule = batch_size.removeprefix("auto:") if batch_size.startswith("auto:") else None
            try:
                valid = schedule is not None and math.isfinite(float(schedule)) and float(schedule) > 0
            except ValueError:
                valid = False
            if not valid:
                raise ValueError(f"--batch-size must be a whole number, 'auto' or 'auto:N' (N > 0: how many times "
                                 f"lm-eval searches the batch size again), got {batch_size!r}")
            return batch_size
    if batch_size < 1:
        raise ValueError(f"--batch-size must be at least 1, got {batch_size}")
    return batch_size


def _available(kind: str) -> int:
    """How many devices of a torch device type this process can use (0 where the backend is absent)."""
    import torch

    if kind == "cpu":
        return 1
    if kind == "mps":
        return int(torch.backends.mps.is_available())
    module = getattr(torch, kind, None)  # torch.npu / torch.hpu exist only with their plugins
    if module is None or not module.is_available():
        return 0
    return module.device_count()


# the device strings lm-eval's HFLM places a model from a folder on (its `__init__`'s single-device list, where the
# indices run over the devices present; it replaces any other string with cuda or cpu)
_HFLM_DEVICE = re.compile(r"cpu|cuda|mps|mps:0|(?:cuda|npu|xpu|hpu):(?:0|[1-9][0-9]*)")


def check_device(device: str | None, model=None) -> None:
    """`device` as lm-eval's HFLM takes it: for a model folder, one of the strings HFLM places a model on (`"cpu"`,
    `"cuda"`, `"cuda:N"`, `"mps"`, `"mps:0"`, `"npu:N"`, `"xpu:N"`, `"hpu:N"`; HFLM silently uses cuda or cpu for
    any other, `"cpu:0"` or `"xpu"` included), of a device this machine has (HFLM would fail only once the model is
    loaded); for a loaded model, None or the device it is on (HFLM evaluates a loaded model where it is).

    Raises:
        TypeError: not a str. ValueError: a string HFLM does not honour, an absent device, or a loaded model on
            another device.
    """
    check_type("device", device, str, optional=True)
    if device is None:
        return
    if not _HFLM_DEVICE.fullmatch(device):
        raise ValueError(f"device must be one of lm-eval's: 'cpu', 'cuda', 'cuda:N', 'mps', 'npu:N', 'xpu:N', 'hpu:N' "
                         f"(lm-eval ignores any other and picks cuda or cpu itself), got {device!r}")
    kind, _, index = device.partition(":")
    count = _available(kind)
    if count == 0 or int(index or 0) >= count:
        raise ValueError(f"device {device!r} is not available here ({count} {kind} device(s))")
    if model is not None and not isinstance(model, (str, os.PathLike)):
        on = next(model.parameters()).device
        if on.type != kind or (index and int(index) != (on.index or 0)):
            raise ValueError(f"the loaded model is on {on}, and lm-eval evaluates a loaded model where it is: move it "
                             f"with model.to({device!r}), or leave device unset")


def check_eval_dtype(dtype, model=None):
    """`dtype` as lm-eval's HFLM takes it (and passes to transformers' `from_pretrained`): `"auto"` (the dtype of the
    checkpoint's config, else of its weights) or a floating point torch dtype, as a `torch.dtype` or its name
    (`"bfloat16"`, `"half"`). None: float32 for a model folder (the same numbers on every machine), the model's own
    for a loaded model. A loaded model is evaluated in its own dtype (HFLM does not cast it), so another is refused.

    Returns:
        `"auto"` or a `torch.dtype`, to pass to HFLM.

    Raises:
        ValueError: another value, or a loaded model in another dtype.
    """
    import torch

    from ..conversion.retrofit import check_dtype

    loaded = model is not None and not isinstance(model, (str, os.PathLike))
    if dtype is None:
        return "auto" if loaded else torch.float32
    if isinstance(dtype, str) and dtype == "auto":
        return dtype
    try:
        dtype = check_dtype(dtype)
    except ValueError:
        raise ValueError(f"dtype must be 'auto' or a floating point torch dtype (torch.bfloat16, or a name such as "
                         f"'float32', 'bfloat16', 'half'), got {dtype!r}") from None
    if loaded and dtype != model.dtype:
        raise ValueError(f"the loaded model is in {model.dtype}, and lm-eval evaluates a loaded model as it is: cast it "
                         f"with model.to({dtype}), or leave dtype unset")
    return dtype


def check_run_settings(model, tokenizer=None, *, seed=1234, dtype=None, device=None, gen_kwargs=None,
                       trust_remote_code=False, batch_size=1, max_batch_size=64) -> dict:
    """Types and values of one lm-eval run's settings (`run_lm_eval`, `evaluate_pair`), before any model loads.

    Returns:
        `{"dtype", "device", "batch_size"}` as lm-eval's HFLM takes them (`check_eval_dtype`, `check_device`,
        `check_batch_size`).

    Raises:
        TypeError: `model` is neither a folder path nor a loaded `PreTrainedModel`, or a setting has the wrong type.
        ValueError: a loaded model without its `tokenizer`, or a dtype, device or batch size lm-eval does not take.
    """
    from transformers import PreTrainedModel

    if not isinstance(model, (str, os.PathLike, PreTrainedModel)):
        raise TypeError(f"model must be a model folder path or a loaded PreTrainedModel, got {type(model).__name__}")
    if isinstance(model, PreTrainedModel) and tokenizer is None:
        raise ValueError("a loaded model needs its tokenizer: pass tokenizer= (or give the model folder instead)")
    check_type("seed", seed, int)
    check_type("max_batch_size", max_batch_size, int)
    if max_batch_size < 1:
        raise ValueError(f"--max-batch-size must be at least 1, got {max_batch_size}")
    settings = {"dtype": check_eval_dtype(dtype, model), "batch_size": check_batch_size(batch_size)}
    check_device(device, model)
    settings["device"] = device
    check_type("gen_kwargs", gen_kwargs, (str, dict), optional=True)
    check_type("trust_remote_code", trust_remote_code, bool)
    return settings
