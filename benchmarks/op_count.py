"""Operator calls of AttnRes against the matching `transformers` Llama, counted: a deterministic cost that does not
depend on the machine's speed or load.

Every aten operator call a model makes is counted (a `TorchDispatchMode` that sees each call below autograd, views
and in-place operations included, forward and backward). On a GPU each non-view call is about one kernel launch,
and at one decoded token (or a small batch) the launches, not the arithmetic, set the time, so the ratio to Llama
predicts the launch-bound overhead on any machine; on a CPU it is the per-call Python and dispatch cost.

Shape: SmolLM2-135M (`overhead.SMOLLM2_135M`: 30 layers, hidden 576), random weights shared by all models, fp32,
eager, sdpa attention. Models: `LlamaForCausalLM`, Block AttnRes (8 blocks, `S = 8`: two-phase inference) and
Full AttnRes (`S = 1`). Workloads:

- decode:  one token's forward with the KV cache (`DynamicCache`), after a 16-token prompt and one decoded token
           (not counted), no grad;
- prefill: the forward of 1 x 32 tokens, no grad;
- train:   forward + backward of a causal-LM loss on 1 x 32 tokens (`model.train()`, no KV cache).

Python calls (`--python`, also in `--results`): a decoded token's Python function calls (`CountPythonCalls`), for
Llama, Block and Full AttnRes with the torch reads. A decoded token's eager overhead is its aten calls' dispatch and
the Python around them (AttnRes's depth state, routers and checks), which the aten counts do not show: this one
does, deterministically as they do.

Kernel launches (`--launches`, also in `--results`): a decoded token's launches as a GPU's profiler would count them,
counted on the CPU: each aten call that computes (views and allocations launch nothing, `CountLaunches`) and one per
Triton kernel launch, for Llama, Block and Full AttnRes with the torch reads and with `attnres_implementation=
"triton"` (the two-phase kernels, run by Triton's interpreter, `TRITON_INTERPRET=1`, their inner operations not
counted), and a training step's launches with the torch reads (`count_training_launches`). Target
(`LAUNCH_TARGETS`): Block with the Triton kernels, decode, at most 1.05x Llama's launches.

The counts do not depend on the hidden size, the vocabulary or the batch (`--smoke` counts at a tiny width to show
it; tests/test_op_count.py holds the counts at that width), only on the layer count, the block size and the code
paths. Targets (`TARGETS`): the ratio to Llama's count, PASS when at or below it (one count, no interval).

    python benchmarks/op_count.py                                   # the table, a few seconds
    python benchmarks/op_count.py --results docs/results/op_count.md   # the table in docs/speed.md
    python benchmarks/op_count.py --ops                              # plus the operators AttnRes adds, per workload
    python benchmarks/op_count.py --launches                         # plus the kernel launches (decode, train)
    python benchmarks/op_count.py --python                           # plus a decoded token's Python calls
"""

import argparse
import collections
import os
import sys

# the launch count runs the Triton kernels on the CPU in Triton's interpreter, which must be chosen before Triton is
# first imported (torch or transformers may import it); set it to 0 to count on a GPU
os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from transformers import DynamicCache  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _results import Run, results_path  # noqa: E402  (the results fragments, benchmarks/_results.py)
from overhead import SMOKE, SMOLLM2_135M, build_models  # noqa: E402  (the benchmarks' one SmolLM2-135M shape and models)

WORKLOADS = ("decode", "prefill", "train")
PROMPT_LEN, PREFILL_LEN, TRAIN_LEN = 16, 32, 32
TARGETS = {  # model -> {workload: largest ratio of aten calls to Llama's}
    "block": dict(decode=1.10, prefill=1.10, train=1.20),
    "full": dict(decode=1.20, train=1.50),
}


LAUNCH_TARGETS = {"block+triton": 1.05}  # model -> largest ratio of a decoded token's kernel launches to Llama's
NO_KERNEL = frozenset({"empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided"})
"""Aten operators that allocate without launching a kernel (views launch none either: `OpOverload.is_view`)."""


class CountCalls(TorchDispatchMode):
    """Counts every aten operator call made while active, by operator name (`calls`) and in all (`total`)."""

    def __init__(self):
        super().__init__()
        self.calls = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.calls.values())


class CountLaunches(CountCalls):
    """Counts the kernel launches of a run, by operator or kernel name: every aten call that computes (not a view,
    `OpOverload.is_view`, nor an allocation, `NO_KERNEL`), and one per Triton kernel launch (`triton:<kernel>`), whose
    own operations are not counted (under Triton's interpreter they are torch and numpy calls on the CPU)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.is_view or func.overloadpacket.__name__ in NO_KERNEL:
            return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)

    def __enter__(self):
        # (Triton has no launch hook under its interpreter: its launchers' `run` is wrapped while counting)
        from triton.runtime.interpreter import InterpretedFunction
        from triton.runtime.jit import JITFunction
        from torch.utils._python_dispatch import _disable_current_modes

        self._launchers = [(cls, cls.run) for cls in (InterpretedFunction, JITFunction)]
        for cls, launch in self._launchers:
            def run(kernel, *args, _launch=launch, **kwargs):
                self.calls[f"triton:{kernel.fn.__name__}"] += 1
                with _disable_current_modes():
                    return _launch(kernel, *args, **kwargs)
            cls.run = run
        return super().__enter__()

    def __exit__(self, *exc):
        for cls, launch in self._launchers:
            cls.run = launch
        return super().__exit__(*exc)


class CountPythonCalls:
    """Counts the Python function calls made while active (`sys.setprofile`'s `call` events: each Python frame run,
    generator resumptions included; builtins and torch's C++ bindings not), by the file that holds the function
    (`calls`) and in all (`total`). A context manager, as `CountCalls`; it puts back the profile function it found."""

    def __init__(self):
        self.calls = collections.Counter()

    def _profile(self, frame, event, arg):
        if event == "call":
            self.calls[frame.f_code.co_filename] += 1

    def __enter__(self):
        self._previous = sys.getprofile()
        sys.setprofile(self._profile)
        return self

    def __exit__(self, *exc):
        sys.setprofile(self._previous)

    @property
    def total(self) -> int:
        return sum(self.calls.values())


def count(model, workload: str, vocab_size: int, counter=None) -> collections.Counter:
    """The aten calls of one `workload` of `model` (see the module docstring), by operator name; or what another
    `counter` counts (`CountLaunches`, `CountPythonCalls`)."""
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab_size, (1, max(PROMPT_LEN, PREFILL_LEN, TRAIN_LEN)), generator=generator)
    counter = counter if counter is not None else CountCalls()
    if workload == "train":
        model.train()
        model.zero_grad(set_to_none=True)
        batch = tokens[:, :TRAIN_LEN]
        with counter:
            model(batch, labels=batch, use_cache=False).loss.backward()
        model.zero_grad(set_to_none=True)
        return counter.calls
    model.eval()
    with torch.no_grad():
        if workload == "prefill":
            with counter:
                model(tokens[:, :PREFILL_LEN], use_cache=False)
            return counter.calls
        cache = DynamicCache(config=model.config)
        logits = model(tokens[:, :PROMPT_LEN], cache=cache, use_cache=True).logits
        for position in (PROMPT_LEN, PROMPT_LEN + 1):  # one warm step (caches sized), then the counted one
            token = logits[:, -1:].argmax(-1)
            step = dict(cache=cache, position_ids=torch.tensor([[position]]), use_cache=True)
            if position == PROMPT_LEN:
                logits = model(token, **step).logits
            else:
                with counter:
                    model(token, **step)
    return counter.calls


def count_all(shape: dict, models: tuple[str, ...] = ("llama", "block", "full")) -> dict:
    """`{model: {workload: Counter}}` at `shape` for Llama, Block and Full AttnRes (`overhead.build_models`)."""
    built = build_models(torch.device("cpu"), "sdpa", [], shape)
    return {name: {workload: count(built[name], workload, shape["vocab_size"]) for workload in WORKLOADS}
            for name in models}


def count_launches(shape: dict, models: tuple[str, ...] | None = None) -> dict:
    """`{model: Counter}` of a decoded token's kernel launches (`CountLaunches`) at `shape`: Llama, Block and Full
    AttnRes with the torch reads and with the Triton kernels (`models`: these of them only), on the CPU: Triton's
    interpreter runs the kernels (`TRITON_INTERPRET=1`, set when this module is imported)."""
    shape = dict(shape, **SMOKE)  # (the same counts at any width; the interpreter's time grows with it)
    built = build_models(torch.device("cpu"), "sdpa", [], shape, triton=True)
    return {name: count(model, "decode", shape["vocab_size"], CountLaunches()) for name, model in built.items()
            if models is None or name in models}


def count_python_calls(shape: dict) -> dict:
    """`{model: Counter}` of a decoded token's Python function calls (`CountPythonCalls`, by file) for Llama, Block
    and Full AttnRes with the torch reads, at `SMOKE`'s width (the counts do not depend on it)."""
    shape = dict(shape, **SMOKE)
    built = build_models(torch.device("cpu"), "sdpa", [], shape)
    return {name: count(built[name], "decode", shape["vocab_size"], CountPythonCalls())
            for name in ("llama", "block", "full")}


def python_call_report(calls: dict) -> str:
    """The Markdown table of `count_python_calls`: Python function calls per decoded token, those in this package's
    files, and the ratio to Llama's."""
    base = sum(calls["llama"].values())
    lines = ["Python function calls of one decoded token (each Python frame run, `sys.setprofile`; builtins and "
             "torch's bindings not counted), with the torch reads:", "",
             "| model | Python calls | of them in attnres_hf | added to Llama's | ratio to Llama |",
             "|---|---|---|---|---|"]
    for name, counted in calls.items():
        total = sum(counted.values())
        own = sum(n for path, n in counted.items() if f"{os.sep}attnres_hf{os.sep}" in path)
        added = f"{total - base:+,}" if name != "llama" else ""
        lines.append(f"| {name} | {total:,} | {own:,} | {added} | {total / base:.3f}x |")
    return "\n".join(lines)


def count_training_launches(shape: dict) -> dict:
    """`{model: Counter}` of a training step's kernel launches (`CountLaunches`; forward and backward of 1 x
    `TRAIN_LEN` tokens) for Llama, Block and Full AttnRes with the torch reads: the share of a step's aten calls that
    launches kernels on a GPU (its views and allocations launch none)."""
    shape = dict(shape, **SMOKE)  # (the same counts at any width)
    built = build_models(torch.device("cpu"), "sdpa", [], shape)
    return {name: count(built[name], "train", shape["vocab_size"], CountLaunches()) for name in ("llama", "block", "full")}


def training_launch_report(launches: dict) -> str:
    """The Markdown table of `count_training_launches`: launches per training step and the ratio to Llama's."""
    base = sum(launches["llama"].values())
    lines = [f"Kernel launches of a training step (forward + backward, 1 x {TRAIN_LEN}, the torch reads; counted as "
             "above):", "", "| model | launches | added to Llama's | ratio to Llama |", "|---|---|---|---|"]
    for name, calls in launches.items():
        total = sum(calls.values())
        added = f"{total - base:+,}" if name != "llama" else ""
        lines.append(f"| {name} | {total:,} | {added} | {total / base:.3f}x |")
    return "\n".join(lines)


def launch_report(launches: dict) -> str:
    """The Markdown table of `count_launches`: launches per decoded token, the ratio to Llama's and the verdict."""
    base = sum(launches["llama"].values())
    lines = ["Kernel launches of one decoded token (each aten call that computes, views and allocations not counted, "
             "plus one per Triton kernel launch; the Triton kernels run by Triton's interpreter on the CPU, at hidden "
             f"{SMOKE['hidden_size']}: the counts do not depend on the width):", "",
             "| model | launches | of them Triton kernels | added to Llama's | ratio to Llama | target |",
             "|---|---|---|---|---|---|"]
    for name, calls in launches.items():
        total = sum(calls.values())
        kernels = sum(n for op, n in calls.items() if op.startswith("triton:"))
        added = f"{total - base:+,}" if name != "llama" else ""
        lines.append(f"| {name} | {total:,} | {kernels} | {added} | {total / base:.3f}x | "
                     f"{verdict(total / base, LAUNCH_TARGETS.get(name))} |")
    return "\n".join(lines)


def verdict(ratio: float, target: float | None) -> str:
    if target is None:
        return ""
    return f"{'PASS' if ratio <= target else 'FAIL'} (<= {target:.2f}x)"


def report(counts: dict, shape: dict) -> str:
    """The Markdown table (also what `--results` writes): calls per workload, the ratio to Llama and the verdict."""
    lines = [f"Aten operator calls, {shape['num_hidden_layers']} layers, hidden {shape['hidden_size']}, fp32, eager, "
             f"sdpa (decode: one cached token; prefill: 1 x {PREFILL_LEN}; train: forward + backward, 1 x {TRAIN_LEN}):",
             "", "| model | workload | aten calls | added to Llama's | ratio to Llama | target |",
             "|---|---|---|---|---|---|"]
    passed = failed = 0
    for name, workloads in counts.items():
        for workload in WORKLOADS:
            total, base = sum(workloads[workload].values()), sum(counts["llama"][workload].values())
            ratio = total / base
            target = TARGETS.get(name, {}).get(workload)
            judged = verdict(ratio, target)
            passed += judged.startswith("PASS")
            failed += judged.startswith("FAIL")
            added = f"{total - base:+,}" if name != "llama" else ""
            lines.append(f"| {name} | {workload} | {total:,} | {added} | {ratio:.3f}x | {judged} |")
    lines += ["", f"Targets met: {passed} of {passed + failed}."]
    return "\n".join(lines)


def added_operators(counts: dict, name: str, workload: str, top: int = 25) -> str:
    """The operators `name` calls more often than Llama in `workload`, most added first."""
    added = counts[name][workload].copy()
    added.subtract(counts["llama"][workload])
    rows = sorted(((n, op) for op, n in added.items() if n), reverse=True)[:top]
    return f"{name} {workload}: " + ", ".join(f"{op} {n:+d}" for n, op in rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="count at a tiny width (the same counts, in seconds)")
    parser.add_argument("--ops", action="store_true", help="also print the operators AttnRes adds, per workload")
    parser.add_argument("--launches", action="store_true",
                        help="also count the kernel launches of a decoded token, the Triton kernels' included (needs "
                             "triton), and of a training step (always with --results)")
    parser.add_argument("--python", action="store_true",
                        help="also count a decoded token's Python function calls (always with --results)")
    parser.add_argument("--results", metavar="PATH", type=results_path,
                        help="also write the table, with how it was measured, to PATH (a Markdown fragment)")
    args = parser.parse_args(argv)
    measured = Run(__file__, sys.argv[1:] if argv is None else argv)
    shape = dict(SMOLLM2_135M, **SMOKE) if args.smoke else SMOLLM2_135M
    counts = count_all(shape)
    text = report(counts, shape)
    if args.launches or args.results:
        launches = count_launches(shape)
        text += "\n\n" + launch_report(launches) + "\n\n" + training_launch_report(count_training_launches(shape))
    if args.python or args.results:
        text += "\n\n" + python_call_report(count_python_calls(shape))
    print(text)
    if args.ops:
        for name in ("block", "full"):
            for workload in WORKLOADS:
                print(added_operators(counts, name, workload))
        if args.launches or args.results:
            base = launches["llama"]
            for name in ("block+triton", "full+triton"):
                print(added_operators({"llama": {"decode": base}, name: {"decode": launches[name]}}, name, "decode"))
    if args.results:
        measured.write(args.results, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
