"""`attnres_implementation="triton"`'s kernels compiled for real GPUs without one: every kernel of
`attnres_kernels.py`, forward and backward, compiled ahead of time by Triton's own compiler for sm_80 (A100) and
sm_90 (H100) down to cubin (`triton.compile` with an explicit `GPUTarget`, the `ptxas` its wheel ships), at the
shapes the models use, with the constexprs, warps and argument specialisations the launchers give them; a compile
error, or a register spill in `ptxas`'s report, fails.

Why: `tests/test_triton_kernels.py` runs the kernels in Triton's interpreter, which accepts code a GPU backend
rejects and cannot spill; no GPU has run them. The launchers run here on meta tensors with each kernel replaced by a
recorder of its launches (`launches`), so the compiled specialisations are the ones a GPU would compile: block
sizes, warps, `HAS_*` flags, and the runtime's own specialisation of the arguments (Triton's JIT binder: pointer
dtypes and 16-byte alignment, integers divisible by 16). They compile in a fresh interpreter, without
`TRITON_INTERPRET` (`conftest.py` sets it here, and Triton reads it at its first import), one batch for the module.

Shapes: hidden sizes 576 (SmolLM2-135M), 2048 (SmolLM2-1.7B), 4096 (Llama-3-8B), 7168 (Kimi K2, DeepSeek-V3)
and 8192 (Llama-3-70B), each with one query (Full AttnRes, the final router) and with its default block
(`default_attnres_block_size` of its layer count: 8, 6, 8, 16 and 20 queries), values in bf16; fp32 and fp16 values
at two of them; every backward gradient combination (each `HAS_*` flag both ways, with the key norm and without,
the sources' gradients added in place, written or not needed) at one. The runtime's specialisations of a single
query tile (`tiles == 1`) and of many are both compiled; not those of one source or one token (`n == 1`,
`rows == 1`: constants, simpler code).

Measured (Triton 3.9; its ptxas 12.9 for sm_80, 13.4 for sm_90): 137 distinct compiles, none spills or has a stack
frame, 19 to 137 registers a thread; the fixture takes about 20 s on 2 quiet cores (one compiling process per
architecture, side by side; 31 s as one process). Launched as they were before the
split of a token's `S x D` across programs (`attnres_kernels.TILE`: one program a token, 4 warps), phase 1 forward
and backward spilled from `D = 2048, S = 8` on (at 7168 and 16 queries, some 45 KB of spill stores a thread).
"""

import contextlib
import io
import json
import os
import re
import subprocess
import sys

import pytest
import torch

triton = pytest.importorskip("triton")

ARCHS = {"sm_80": 80, "sm_90": 90}

MODELS = {"SmolLM2-135M": (576, 30), "SmolLM2-1.7B": (2048, 24), "Llama-3-8B": (4096, 32), "Kimi-K2": (7168, 61),
          "Llama-3-70B": (8192, 80)}
"""Hidden size and decoder layers of checkpoints users bring, from the smallest to the widest."""

TRAINING = {"grad_mixed": True, "grad_lse": True, "grad_probs": False, "grad_values": "accumulate",
            "grad_hidden": True, "grad_logit": False}
"""The gradients eager training gives the kernels: phase 1's weighted sums and log-sum-exp through the merges (not
its depth weights), the sources' added in place into their sums; the merges' output (not the logit)."""

EVERY_BACKWARD = [dict(grad_mixed=bool(mixed), grad_lse=bool(lse), grad_probs=bool(probs), grad_values=values,
                       grad_hidden=bool(hidden), grad_logit=bool(logit))
                  for mixed, lse, probs in ((1, 1, 1), (1, 0, 0), (0, 1, 0), (0, 0, 1))
                  for values in ("accumulate", "overwrite", None) for hidden, logit in ((1, 1), (1, 0), (0, 1))]
"""Each backward `HAS_*` flag both ways: phase 1's outputs' gradients (at least one), the sources' (added in place,
written, not needed), the merge's (at least one)."""


def _cases() -> dict[str, dict]:
    from attnres_hf.modeling.configuration_attnres import default_attnres_block_size

    cases = {}
    for name, (dim, layers) in MODELS.items():
        for S in (1, default_attnres_block_size(layers)):
            cases[f"{name}-D{dim}-S{S}-bf16"] = dict(dim=dim, S=S, dtype="bfloat16", key_norm=True,
                                                     backward=[TRAINING])
    for dtype, (dim, S) in (("float32", (7168, 16)), ("float16", (576, 8))):  # (the other dtypes, one shape each)
        cases[f"D{dim}-S{S}-{dtype}"] = dict(dim=dim, S=S, dtype=dtype, key_norm=True, backward=[TRAINING])
    for key_norm in (True, False):
        cases[f"D4096-S8-bf16-{'' if key_norm else 'no_'}key_norm-every_backward"] = dict(
            dim=4096, S=8, dtype="bfloat16", key_norm=key_norm, backward=EVERY_BACKWARD)
    return cases


CASES = _cases()


def launches(kernels, case: dict) -> list[tuple]:
    """The kernel launches of phase 1 and a merge, forward (the merge also with inference's add of a sub-layer's
    output) and backward (each of `case["backward"]`'s gradients), at `case`'s shape (3 completed sources, 2 x 8
    tokens; the merge of the block's last query, whose views of phase 1's outputs are the least aligned), run on meta
    tensors: `(JITFunction, args, kwargs)` each."""
    recorded = []

    class Recorder:
        def __init__(self, fn):
            self.fn = fn

        def __getitem__(self, grid):
            return lambda *args, **kwargs: recorded.append((self.fn, args, kwargs))

    names = [name for name, value in vars(kernels).items() if isinstance(value, triton.runtime.jit.JITFunction)]
    saved = {name: getattr(kernels, name) for name in names}
    n, batch, seq, dim, S = 3, 2, 8, case["dim"], case["S"]
    dtype = getattr(torch, case["dtype"])

    def empty(*shape, dtype=torch.float32):
        return torch.empty(*shape, dtype=dtype, device="meta")

    try:
        for name in names:
            setattr(kernels, name, Recorder(saved[name]))
        values, queries = empty(n, batch, seq, dim, dtype=dtype), empty(S, dim)
        inv_rms = empty(batch, seq, n) if case["key_norm"] else None
        probs, lse, mixed = kernels.phase1_forward(values, inv_rms, queries)
        partial, last = empty(batch, seq, dim, dtype=dtype), S - 1
        merge = (partial, mixed[:, :, last], queries[last], lse[:, :, last])
        _, logit = kernels.merge_forward(*merge, 1e-6, case["key_norm"])
        kernels.merge_forward(*merge, 1e-6, case["key_norm"], empty(batch, seq, dim, dtype=dtype))  # (inference's add)
        for grads in case["backward"]:
            kernels.phase1_backward(values, inv_rms, queries, probs,
                                    torch.empty_like(mixed) if grads["grad_mixed"] else None,
                                    torch.empty_like(lse) if grads["grad_lse"] else None,
                                    torch.empty_like(probs) if grads["grad_probs"] else None,
                                    None if grads["grad_values"] is None else torch.empty_like(values),
                                    grads["grad_values"] == "accumulate")
            kernels.merge_backward(*merge, logit, torch.empty_like(partial) if grads["grad_hidden"] else None,
                                   torch.empty_like(logit) if grads["grad_logit"] else None, 1e-6, case["key_norm"])
    finally:
        for name in names:
            setattr(kernels, name, saved[name])
    return recorded


PTXAS_REPORT = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads"
                          r".*?Used (\d+) registers", re.S)


def specialise(arch: int, fn, args, kwargs) -> tuple:
    """`fn`'s compile inputs for `args` as the runtime would make them on a GPU of `arch` (Triton's JIT binder and
    the backend's options): `(target, ASTSource, options)`."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
    return target, ASTSource(fn, signature, constexprs, attrs), options


def compile_to_cubin(target, source, options) -> dict:
    """`source` compiled for `target`: what `ptxas -v` reported (registers a thread, spill bytes), or the error."""
    fn = source.fn
    described = {"kernel": fn.__name__, "num_warps": options.num_warps,
                 "constexprs": {fn.arg_names[path[0]]: value for path, value in source.constants.items()}}
    log = io.StringIO()
    try:
        with contextlib.redirect_stdout(log):  # (Triton prints ptxas's report with `dump_ptxas_log`)
            compiled = triton.compile(source, target=target, options=options.__dict__)
    except Exception as error:  # noqa: BLE001 (any compile error is the result)
        return {**described, "error": f"{type(error).__name__}: {error}"[-3000:]}
    report = PTXAS_REPORT.search(log.getvalue())
    if report is None or "cubin" not in compiled.asm:
        return {**described, "error": f"no cubin or no ptxas report: {log.getvalue()[-2000:]}"}
    stack, stores, loads, registers = map(int, report.groups())
    return {**described, "registers": registers, "spill_stores": stores, "spill_loads": loads, "stack": stack,
            "error": None}


def compile_cases(cases: dict[str, dict], archs: dict[str, int] = ARCHS) -> dict:
    """In a fresh interpreter without `TRITON_INTERPRET`: each case's launches compiled for each of `archs` (an
    identical specialisation once). Returns `{"kernels": every kernel's name, "results": {arch: {case: [...]}}}`."""
    from triton import knobs

    from attnres_hf.modeling import attnres_kernels as kernels

    assert not kernels.INTERPRETED
    knobs.nvidia.dump_ptxas_log = True
    knobs.compilation.always_compile = True  # (a cached kernel would bring no ptxas report)
    done, results = {}, {}
    for case_name, case in cases.items():
        recorded = launches(kernels, case)
        for arch_name, arch in archs.items():
            out = results.setdefault(arch_name, {}).setdefault(case_name, [])
            for fn, args, kwargs in recorded:
                target, source, options = specialise(arch, fn, args, kwargs)
                key = (arch, source.hash(), repr(options))
                if key not in done:
                    done[key] = compile_to_cubin(target, source, options)
                if done[key] not in out:
                    out.append(done[key])
    names = [name for name, value in vars(kernels).items() if isinstance(value, triton.runtime.jit.JITFunction)]
    return {"kernels": names, "results": results}


def _unavailable() -> str | None:
    """Why the kernels cannot be compiled here, or `None`."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas
        from triton.runtime.jit import JITFunction, create_function_from_signature  # noqa: F401
    except ImportError as error:
        return f"Triton {triton.__version__} has no NVIDIA backend or JIT binder to compile with: {error}"
    if not hasattr(JITFunction, "_pack_args"):
        return f"Triton {triton.__version__}'s JIT has no _pack_args (written against Triton 3.9)"
    try:
        for arch in ARCHS.values():
            get_ptxas(arch)
    except RuntimeError as error:  # ("Cannot find ptxas": a wheel without it, TRITON_PTXAS_PATH unset)
        return f"no ptxas: {error}"
    return None


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """Every case's compile results: one fresh interpreter per architecture (its own empty Triton cache), side by
    side (ptxas is single-threaded: two cores compile the two architectures in about half the time of one)."""
    reason = _unavailable()
    if reason is not None:
        pytest.skip(reason)
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    runs = {}
    for arch_name, arch in ARCHS.items():
        script = (f"import json, sys; sys.path.insert(0, {os.path.dirname(__file__)!r}); import test_triton_compile "
                  f"as t; print(json.dumps(t.compile_cases(t.CASES, {{{arch_name!r}: {arch}}})))")
        cache = {"TRITON_CACHE_DIR": str(tmp_path_factory.mktemp(f"triton-cache-{arch_name}"))}
        runs[arch_name] = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                                           stderr=subprocess.PIPE, text=True, env={**env, **cache})
    merged = {"kernels": None, "results": {}}
    for arch_name, run in runs.items():
        stdout, stderr = run.communicate(timeout=600)  # (a kernel that spills heavily takes ptxas minutes)
        assert run.returncode == 0, stderr[-5000:]
        result = json.loads(stdout.splitlines()[-1])
        merged["kernels"] = result["kernels"]
        merged["results"].update(result["results"])
    return merged


@pytest.mark.slow  # (the fixture: two fresh interpreters compile every case, about 20 s on 2 cores)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("arch", list(ARCHS))
def test_every_kernel_compiles_without_spilling(compiled, arch, case):
    """Every `@triton.jit` kernel of `attnres_kernels.py` (each case launches them all) compiles to cubin for `arch`
    at `case`'s shape, and `ptxas` reports no spill store or load."""
    results = compiled["results"][arch][case]
    assert {r["kernel"] for r in results} == set(compiled["kernels"])
    failed = [r for r in results if r["error"] is not None or r["spill_stores"] or r["spill_loads"]]
    assert not failed, json.dumps(failed, indent=1)
