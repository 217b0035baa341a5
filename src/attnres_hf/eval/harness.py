"""lm-eval-harness runs of a model and its baseline on the offline task pack, and the paper's table.

`evaluate_pair` checks everything that can fail before a model is loaded (task names, the code-execution opt-in,
the local data, the output folder), runs lm-eval's `simple_evaluate` on the baseline and then the model with the same
tasks, few-shot count, limit and seeds, and writes `results.json`, `table.md` (Benchmark | Baseline | +AttnRes |
Gain, as in the paper's benchmark table) and `table.png`. Per-sample scores of the two models are compared too:
a conversion is exact when every sample scores the same.

Arguments passed through to lm-eval keep lm-eval's meaning, and a value lm-eval would refuse (or silently replace)
is refused before any model loads (`checks.check_run_settings`):

| argument (`run_lm_eval`, `evaluate_pair`, `attnres eval`) | goes to | takes |
|---|---|---|
| `batch_size` / `--batch-size` | `HFLM(batch_size=)` | an int >= 1, `"auto"`, `"auto:N"` (N > 0) |
| `max_batch_size` / `--max-batch-size` | `HFLM(max_batch_size=)` | an int >= 1 (where `"auto"` starts; lm-eval's 64) |
| `device` / `--device` | `HFLM(device=)` | `cpu`, `cuda`, `cuda:N`, `mps`, `npu:N`, `xpu:N`, `hpu:N` present here |
| `dtype` / `--dtype` | `HFLM(dtype=)`, then `from_pretrained(dtype=)` | `"auto"`, a floating torch dtype or its name |
| `limit`, `num_fewshot`, `gen_kwargs`, `seed` | `simple_evaluate` | as `preflight` / `check_run_settings` say |

A loaded model is evaluated where it is and as it is (HFLM ignores `device` and `dtype` for one): another device or
dtype is refused rather than ignored. `attnres lm-eval` hands its whole command line to lm-eval; what it checks first
(the code-execution opt-ins, the model folder) it reads with lm-eval's own parser (`checks.lm_eval_run_settings`).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import time
from importlib import resources
from pathlib import Path

from .._io import staged_folder
from .benchmarks import BENCHMARKS, PAPER_TABLE, Benchmark, resolve_benchmarks
from .checks import _model_folder, check_eval_dtype, check_run_settings, check_type, preflight
from .code_execution import OPT_IN_VARIABLE
from .local import default_data_dir


def task_dir() -> Path:
    """The offline task pack (lm-eval `--include_path`)."""
    return Path(str(resources.files("attnres_hf.eval") / "tasks"))


class _PackNoticeFilter(logging.Filter):
    """Drops lm-eval's per-task hint that custom datasets take `--metadata`: every pack task uses one, and
    `attnres eval` passes the data folder itself."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Custom kwargs can be passed to `--metadata`" not in record.getMessage()


logging.getLogger("lm_eval.api.task").addFilter(_PackNoticeFilter())


def task_manager(data_dir: str | os.PathLike | None = None):
    """An lm-eval `TaskManager` that knows the pack's tasks (only those: `run_lm_eval` runs nothing else, and indexing
    every YAML file of lm-eval's own tasks took 6 s or more of each process on a 2-core CPU, the pack's under 2 s) and reads local data from `data_dir`: one per process and folder pair. It keeps only the index and builds
    fresh task objects on every load, so runs share it."""
    return _task_manager(str(task_dir()), str(data_dir or default_data_dir()))


@functools.lru_cache(maxsize=4)
def _task_manager(include_path: str, data_dir: str):
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=include_path, include_defaults=False, metadata={"data_dir": data_dir})


_OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")


def offline_environment() -> dict:
    """Switch off hub access for this process and its children; returns what to pass to `restore_environment`.

    The libraries read their offline flags at import time, so the flags already loaded are set too
    (`huggingface_hub.constants.HF_HUB_OFFLINE`, which transformers consults, and `datasets.config`).
    """
    import datasets.config
    import huggingface_hub.constants as hub_constants

    saved = {"env": {v: os.environ.get(v) for v in _OFFLINE_VARIABLES}, "hub": hub_constants.HF_HUB_OFFLINE,
             "datasets": (datasets.config.HF_HUB_OFFLINE, datasets.config.HF_DATASETS_OFFLINE)}
    for variable in _OFFLINE_VARIABLES:
        os.environ[variable] = "1"
    hub_constants.HF_HUB_OFFLINE = True
    datasets.config.HF_HUB_OFFLINE = datasets.config.HF_DATASETS_OFFLINE = True
    return saved


def restore_environment(saved: dict) -> None:
    import datasets.config
    import huggingface_hub.constants as hub_constants

    for variable, value in saved["env"].items():
        if value is None:
            os.environ.pop(variable, None)
        else:
            os.environ[variable] = value
    hub_constants.HF_HUB_OFFLINE = saved["hub"]
    datasets.config.HF_HUB_OFFLINE, datasets.config.HF_DATASETS_OFFLINE = saved["datasets"]


def run_lm_eval(model, benchmarks: list[Benchmark] | str, *, tokenizer=None, num_fewshot: int | None = None,
                limit: float | None = None, batch_size: int | str = 1, max_batch_size: int = 64, data_dir=None,
                allow_code_execution=False, seed: int = 1234, dtype=None, device: str | None = None,
                trust_remote_code=False, gen_kwargs: str | dict | None = None) -> dict:
    """lm-eval's `simple_evaluate` of one model (a folder, or a `PreTrainedModel` with `tokenizer`) on `benchmarks`
    (records, or names as `resolve_benchmarks` takes them), with per-sample logs. Seeds: python/numpy/torch and
    few-shot sampling all `seed`. Settings, opt-ins and local data are checked before the model loads (`preflight`).

    `batch_size`, `max_batch_size`, `device` and `dtype` go to lm-eval's `HFLM` with its meaning (see the module
    docstring): `batch_size` an int, `"auto"` or `"auto:N"`; `dtype` `"auto"` or a floating torch dtype (default
    float32 for a folder; a loaded model is evaluated as it is, on its device and in its dtype).

    Raises:
        TypeError: see `preflight` and `check_run_settings` (as the others; all before loading).
        ValueError: see `preflight` and `check_run_settings`.
        FileNotFoundError: see `preflight`.
        CodeExecutionNotAllowed: see `preflight`.
        MissingBenchmarkData: see `preflight`.
    """
    if isinstance(benchmarks, (str, list, tuple)) and not all(isinstance(b, Benchmark) for b in benchmarks):
        benchmarks = resolve_benchmarks(benchmarks)
    settings = check_run_settings(model, tokenizer, seed=seed, dtype=dtype, device=device, gen_kwargs=gen_kwargs,
                                  trust_remote_code=trust_remote_code, batch_size=batch_size,
                                  max_batch_size=max_batch_size)
    preflight(benchmarks, allow_code_execution, data_dir, [model], None, limit, num_fewshot, batch_size)
    if limit is not None and limit >= 1:
        limit = int(limit)
    import torch
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM

    from ..modeling.backbones_moe import dispatch_kda_by_device

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    batching = {"batch_size": settings["batch_size"], "max_batch_size": max_batch_size}
    if isinstance(model, (str, os.PathLike)):
        lm = HFLM(pretrained=str(model), backend="causal", dtype=settings["dtype"], device=device,
                  trust_remote_code=trust_remote_code, **batching)
        dispatch_kda_by_device(lm.model)  # a transformers Kimi Linear baseline: fla's KDA kernels on CUDA tensors only
    else:  # HFLM evaluates a loaded model where it is, as it is (check_run_settings refused anything else)
        lm = HFLM(pretrained=model, backend="causal", tokenizer=tokenizer, **batching)
    previous = os.environ.get(OPT_IN_VARIABLE)
    if allow_code_execution:
        os.environ[OPT_IN_VARIABLE] = "1"  # the sandbox's opt-in, for this run only
    try:
        return simple_evaluate(
            model=lm, tasks=[b.task for b in benchmarks], num_fewshot=num_fewshot, limit=limit, log_samples=True,
            task_manager=task_manager(data_dir), random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed,
            fewshot_random_seed=seed, confirm_run_unsafe_code=allow_code_execution, gen_kwargs=gen_kwargs,
        )
    finally:
        if previous is None:
            os.environ.pop(OPT_IN_VARIABLE, None)
        else:
            os.environ[OPT_IN_VARIABLE] = previous


def metric_value(results: dict, benchmark: Benchmark) -> float | None:
    value = results["results"].get(benchmark.task, {}).get(benchmark.metric)
    return None if value is None or value == "N/A" else float(value)


def _sample_outputs(results: dict, benchmark: Benchmark) -> dict[int, tuple]:
    """`doc_id -> (metric value, log-likelihoods or None, raw generations or None)` of one run."""
    metric, filter_name = benchmark.metric.split(",")
    outputs = {}
    for sample in results.get("samples", {}).get(benchmark.task, []):
        if sample.get("filter", filter_name) != filter_name:
            continue
        raw = sample.get("resps") or []
        flat = [r[0] if isinstance(r, (list, tuple)) and len(r) == 1 else r for r in raw]
        if flat and all(isinstance(r, (list, tuple)) and len(r) == 2 and isinstance(r[0], float) for r in flat):
            outputs[sample["doc_id"]] = (sample.get(metric), [r[0] for r in flat], None)  # (logprob, is_greedy)
        else:
            outputs[sample["doc_id"]] = (sample.get(metric), None, json.dumps(flat, default=str))
    return outputs


def compare_samples(baseline: dict, model: dict, benchmark: Benchmark) -> dict:
    """Per-sample agreement of two runs: equal metric values, the largest log-likelihood difference (scored tasks)
    and equal raw generations (generative tasks, compared before any answer-extraction filter)."""
    a, b = _sample_outputs(baseline, benchmark), _sample_outputs(model, benchmark)
    shared = sorted(set(a) & set(b))
    same_score = sum(a[i][0] == b[i][0] for i in shared)
    max_delta, generations, same_generation = 0.0, 0, 0
    for i in shared:
        left, right = a[i][1], b[i][1]
        if left is not None and right is not None and len(left) == len(right):
            max_delta = max(max_delta, *(abs(x - y) for x, y in zip(left, right)))
        if a[i][2] is not None:
            generations += 1
            same_generation += a[i][2] == b[i][2]
    return {"samples": len(shared), "same_score": same_score, "max_abs_loglikelihood_delta": max_delta,
            "generations": generations, "same_generation": same_generation,
            "identical": len(shared) > 0 and same_score == len(shared) and same_generation == generations}


def _percent(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}"


def table_markdown(rows: list[dict], baseline_label: str, model_label: str) -> str:
    """The paper's table layout; scores in % with one decimal, Gain the difference of the printed scores."""
    lines = [f"| Benchmark | {baseline_label} | {model_label} | Gain |", "|---|---:|---:|---:|"]
    for row in rows:
        base, new = _percent(row["baseline"]), _percent(row["model"])
        gain = "n/a" if "n/a" in (base, new) else f"{float(new) - float(base):+.1f}"
        lines.append(f"| {row['title']} | {base} | {new} | {gain} |")
    return "\n".join(lines) + "\n"


def plot_table(rows: list[dict], path: Path, baseline_label: str, model_label: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    titles = [r["title"] for r in rows]
    base = np.array([np.nan if r["baseline"] is None else 100 * r["baseline"] for r in rows])
    new = np.array([np.nan if r["model"] is None else 100 * r["model"] for r in rows])
    x = np.arange(len(rows))
    fig, ax = plt.subplots(figsize=(max(4.0, 1.1 * len(rows) + 1.5), 3.6))
    ax.bar(x - 0.2, base, 0.4, label=baseline_label, color="#9aa5b1")
    bars = ax.bar(x + 0.2, new, 0.4, label=model_label, color="#d1495b")
    for bar, b, n in zip(bars, base, new):
        if not (np.isnan(b) or np.isnan(n)):
            ax.annotate(f"{n - b:+.1f}", (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center",
                        va="bottom", fontsize=8)
    ax.set_xticks(x, titles, rotation=30, ha="right")
    ax.set_ylabel("score (%)")
    top = np.nanmax(np.concatenate([base, new, [1.0]]))
    ax.set_ylim(0, top * 1.15)
    ax.legend(frameon=False, fontsize=8, ncol=2, loc="lower center", bbox_to_anchor=(0.5, 1.0))
    ax.spines[["top", "right"]].set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=150)
    plt.close(fig)


def _default_label(model) -> str:
    """"+AttnRes" for an AttnRes checkpoint (the paper's column), else the model folder's name."""
    folder = _model_folder(model)
    config = getattr(model, "config", None)
    if folder is not None and (folder / "config.json").is_file():
        model_type = json.loads((folder / "config.json").read_text()).get("model_type")
    else:
        model_type = getattr(config, "model_type", None)
    if model_type == "attnres":
        return "+AttnRes"
    return folder.name if folder is not None else type(model).__name__


def evaluate_pair(model, baseline=None, tasks: str | list[str] = "mmlu", *, output_dir: str | os.PathLike,
                  limit: float | None = None, num_fewshot: int | None = None, batch_size: int | str = 1,
                  max_batch_size: int = 64, data_dir: str | os.PathLike | None = None,
                  allow_code_execution: bool = False, force: bool = False, seed: int = 1234, dtype=None,
                  device: str | None = None,
                  trust_remote_code: bool = False, model_label: str | None = None,
                  baseline_label: str = "Baseline", tokenizer=None, baseline_tokenizer=None,
                  gen_kwargs: str | dict | None = None) -> dict:
    """Evaluate `model` (and `baseline`, if given) with lm-eval on the offline task pack and write the table.

    Args:
        model: a model folder (or a loaded model, with `tokenizer`).
        baseline: the baseline's folder (or a loaded model, with `baseline_tokenizer`); None evaluates `model` alone.
        tasks: comma-separated benchmark names (see `BENCHMARKS`), or "paper" for the paper's whole table.
        limit: lm-eval's `--limit` (questions per task; a fraction below 1 is a share of each task).
        num_fewshot: few-shot examples; None keeps each task's own default.
        gen_kwargs: generation settings for the generative tasks (lm-eval's `--gen_kwargs`, e.g. "max_gen_toks=256").
        batch_size: lm-eval's, with its meaning (an int, `"auto"` or `"auto:N"`; the module docstring and
            `run_lm_eval` say more).
        max_batch_size: lm-eval's: the largest batch `"auto"` tries.
        device: lm-eval's (`"cpu"`, `"cuda"`, `"cuda:N"`, ...).
        dtype: lm-eval's: `"auto"` or a floating torch dtype.
        output_dir: written through a temporary folder; refused if it exists unless `force`, and if it is or holds
            a model folder.
        model_label: the model's column in the table (default "+AttnRes" for an AttnRes model, else the model
            folder's name).
        baseline_label: the baseline's column (default "Baseline").

    Returns:
        `{"rows": [...], "comparison": {...}, "results": {...}}`, the content of `results.json`.

    Raises:
        ValueError: unknown task.
        CodeExecutionNotAllowed: HumanEval/MBPP without `allow_code_execution`.
        MissingBenchmarkData: data not prepared.
        FileExistsError: `output_dir` exists and `force` is false.
        FileNotFoundError: a model folder does not exist.
        TypeError: an argument of the wrong type.

    All of these are raised before a model is loaded.
    """
    import lm_eval

    benchmarks = resolve_benchmarks(tasks)
    for target, tok in ((model, tokenizer), (baseline, baseline_tokenizer)):
        if target is not None:
            check_run_settings(target, tok, seed=seed, dtype=dtype, device=device, gen_kwargs=gen_kwargs,
                               trust_remote_code=trust_remote_code, batch_size=batch_size,
                               max_batch_size=max_batch_size)
    check_type("output_dir", output_dir, (str, os.PathLike))
    check_type("force", force, bool)
    for name, value in (("model_label", model_label), ("baseline_label", baseline_label)):
        check_type(name, value, str, optional=True)
    output_dir = Path(output_dir)
    preflight(benchmarks, allow_code_execution, data_dir, [m for m in (model, baseline) if m is not None],
              output_dir, limit, num_fewshot, batch_size)
    if output_dir.exists() and not force:
        raise FileExistsError(f"{output_dir} already exists; pass --force to replace it")
    if limit is not None and limit >= 1:
        limit = int(limit)
    if model_label is None:
        model_label = _default_label(model)
    saved_environment = offline_environment()
    common = {"num_fewshot": num_fewshot, "limit": limit, "batch_size": batch_size, "max_batch_size": max_batch_size,
              "data_dir": data_dir,
              "allow_code_execution": allow_code_execution, "seed": seed, "dtype": dtype, "device": device,
              "trust_remote_code": trust_remote_code, "gen_kwargs": gen_kwargs}
    runs, timings = {}, {}
    try:
        for label, target, tok in (("baseline", baseline, baseline_tokenizer), ("model", model, tokenizer)):
            if target is None:
                continue
            start = time.perf_counter()
            runs[label] = run_lm_eval(target, benchmarks, tokenizer=tok, **common)
            timings[label] = time.perf_counter() - start
    finally:
        restore_environment(saved_environment)
    rows, comparison = [], {}
    for benchmark in benchmarks:
        rows.append({"benchmark": benchmark.name, "title": benchmark.title, "task": benchmark.task,
                     "metric": benchmark.metric,
                     "baseline": metric_value(runs["baseline"], benchmark) if "baseline" in runs else None,
                     "model": metric_value(runs["model"], benchmark)})
        if "baseline" in runs:
            comparison[benchmark.name] = compare_samples(runs["baseline"], runs["model"], benchmark)
    describe = (lambda m: str(m) if isinstance(m, (str, os.PathLike)) else type(m).__name__)
    report = {
        "rows": rows, "comparison": comparison,
        "settings": {"model": describe(model), "baseline": None if baseline is None else describe(baseline),
                     "tasks": [b.task for b in benchmarks], "limit": limit, "num_fewshot": num_fewshot,
                     "batch_size": batch_size, "max_batch_size": max_batch_size, "seed": seed,
                     "dtype": str(check_eval_dtype(dtype, model)).removeprefix("torch."),
                     "gen_kwargs": gen_kwargs,
                     "data_dir": str(data_dir or default_data_dir()), "lm_eval_version": lm_eval.__version__,
                     "wall_time_s": timings},
        "versions": {label: run.get("versions") for label, run in runs.items()},
    }
    from lm_eval.utils import handle_non_serializable

    with staged_folder(output_dir, replace=force) as staging:
        results = {**report, "lm_eval": {label: {k: v for k, v in run.items() if k != "samples"}
                                         for label, run in runs.items()}}
        (staging / "results.json").write_text(json.dumps(results, indent=2, default=handle_non_serializable) + "\n")
        for label, run in runs.items():
            with (staging / f"samples_{label}.jsonl").open("w") as handle:
                for task, samples in run.get("samples", {}).items():
                    for sample in samples:
                        handle.write(json.dumps({"task": task, **sample}, default=handle_non_serializable) + "\n")
        (staging / "table.md").write_text(table_markdown(rows, baseline_label, model_label))
        plot_table(rows, staging / "table.png", baseline_label, model_label)
    return report


__all__ = ["BENCHMARKS", "PAPER_TABLE", "Benchmark", "evaluate_pair", "resolve_benchmarks", "run_lm_eval",
           "task_dir", "task_manager"]
