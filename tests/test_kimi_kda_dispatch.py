"""Kimi Linear's KDA kernel picked by the tensors' device, with flash-linear-attention installed (the test extra).

transformers 5.24 resolves `chunk_kimi_delta_attention` / `recurrent_kimi_delta_attention` to fla's Triton kernels at
import whenever fla is importable, and a CPU forward then failed (`RuntimeError: 0 active drivers ([]). There should
only be one.`). `backbones_moe.kda_by_device` sends CUDA tensors to the function transformers decorated and every
other device to transformers' own torch function; importing the package no longer prints fla's CPU warning.
"""

import inspect
import subprocess
import sys
import textwrap

import pytest
import torch
from transformers import KimiLinearConfig, KimiLinearForCausalLM

from attnres_hf.conversion import retrofit
from attnres_hf.modeling.backbones_moe import KDA_KERNELS, kda_by_device
from attnres_hf.modeling.backbones_moe import kimi as lazy_kimi
from test_backbones_moe import COMMON, KIMI, ids
from utils import perturb_mixing

KDA = {"chunk_kimi_delta_attention": "chunk_kda", "recurrent_kimi_delta_attention": "fused_recurrent_kda"}
"""transformers' KDA functions and the fla kernel each resolves to where fla is installed."""

kimi = lazy_kimi.load()  # transformers' module, imported (and its KDA dispatched) when Kimi Linear is first used


class CudaLooking(torch.Tensor):
    """A CPU tensor whose `is_cuda` is True: the one property the dispatcher reads, so its CUDA branch runs here."""

    @property
    def is_cuda(self):
        return True


def kda_inputs(seq_len=5, heads=2, head_dim=4):
    """Queries, keys, values `(1, seq_len, heads, head_dim)`, the log forget gate (same shape) and beta
    `(1, seq_len, heads)`, as `KimiLinearDeltaAttention` passes them."""
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, seq_len, heads, head_dim, generator=generator) for _ in range(3))
    g = -torch.rand(1, seq_len, heads, head_dim, generator=generator)
    return (q, k, v), {"g": g, "beta": torch.rand(1, seq_len, heads, generator=generator)}


@pytest.mark.parametrize("name", list(KDA))
def test_cuda_keeps_what_transformers_picked_and_other_devices_get_its_torch_function(name):
    """The CUDA side is the function transformers decorated (resolved to fla's kernel: the setting this fixes), the
    other side the torch function it wraps; replacing twice (a remote-code copy of the module) changes nothing."""
    pytest.importorskip("fla")
    on_cuda, elsewhere = KDA_KERNELS[name]
    assert inspect.getclosurevars(on_cuda).nonlocals["implementation"].__module__.startswith("fla.ops.kda")
    assert inspect.getclosurevars(on_cuda).nonlocals["implementation"].__name__ == KDA[name]
    assert elsewhere is inspect.unwrap(on_cuda) and (elsewhere.__module__, elsewhere.__name__) == (kimi.__name__, name)
    installed = getattr(kimi, name)
    kda_by_device(name)
    assert getattr(kimi, name) is installed and KDA_KERNELS[name][0] is on_cuda


@pytest.mark.parametrize("name", list(KDA))
def test_dispatch_by_the_queries_device(name, monkeypatch):
    """CUDA-looking queries reach the CUDA side with every argument as given (the decorated function filters them
    itself); CPU queries reach the torch function with the keywords its signature names; packed sequences on CPU are
    refused as transformers refuses them without fla."""
    calls = []

    def recorder(side):
        return lambda *args, **kwargs: calls.append((side, args, kwargs)) or side

    monkeypatch.setitem(KDA_KERNELS, name, (recorder("cuda"), recorder("torch")))
    (q, k, v), gates = kda_inputs()
    extra = {"output_final_state": True, "cu_seqlens": None, "not_a_parameter": 1}
    assert getattr(kimi, name)(q.as_subclass(CudaLooking), k, v, **gates, **extra) == "cuda"
    assert getattr(kimi, name)(q, k, v, **gates, **extra) == "torch"
    (cuda_side, cuda_args, cuda_kwargs), (torch_side, torch_args, torch_kwargs) = calls
    assert type(cuda_args[0]) is CudaLooking and cuda_args[1:] == (k, v) and cuda_kwargs == {**gates, **extra}
    assert torch_args == (q, k, v)
    assert torch_kwargs == {**gates, "output_final_state": True}  # the torch function takes no cu_seqlens
    with pytest.raises(ValueError, match="packed sequences"):
        getattr(kimi, name)(q, k, v, **gates, cu_seqlens=torch.tensor([0, 2, 5]))


@pytest.mark.parametrize("name", list(KDA))
def test_the_dispatcher_compiles_in_one_graph(name):
    """torch.compile traces the device branch (fullgraph): the compiled call runs the same torch function."""
    (q, k, v), gates = kda_inputs()
    kwargs = {**gates, "initial_state": None, "output_final_state": True, "use_qk_l2norm_in_kernel": True}
    eager = getattr(kimi, name)(q, k, v, **kwargs)
    compiled = torch.compile(getattr(kimi, name), backend="eager", fullgraph=True)(q, k, v, **kwargs)
    for a, b in zip(compiled, eager):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)  # the eager backend runs the same ops (0 measured)


@pytest.mark.parametrize("model_kind", ["transformers", "attnres"])
def test_kimi_linear_trains_and_decodes_on_cpu_with_fla_installed(model_kind):
    """transformers' own KimiLinearForCausalLM and the AttnRes model over it, in one process: a forward and backward
    (the chunked KDA) reaches every KDA parameter, and a cached one-token step (the recurrent KDA) runs."""
    torch.manual_seed(0)
    model = KimiLinearForCausalLM(KimiLinearConfig(**{**COMMON, **KIMI}))
    if model_kind == "attnres":
        model = retrofit(model, attnres_block_size=2)
        perturb_mixing(model)
    model.train()
    input_ids = ids()
    out = model(input_ids, labels=input_ids)
    out.loss.backward()
    assert torch.isfinite(out.loss)
    kda = model.model.layers[0].self_attn
    assert type(kda) is kimi.KimiLinearDeltaAttention
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in kda.parameters())
    model.eval()
    with torch.no_grad():
        prefill = model(input_ids[:, :-1], use_cache=True)
        cache = prefill.past_key_values if model_kind == "transformers" else prefill.cache
        step = model(input_ids[:, -1:], **{"past_key_values" if model_kind == "transformers" else "cache": cache},
                     use_cache=True)
    assert step.logits.shape == (2, 1, COMMON["vocab_size"]) and torch.isfinite(step.logits).all()


IMPORT_SCRIPT = textwrap.dedent("""
    import sys, warnings
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        import attnres_hf
        assert not any(name == "fla" or name.startswith("fla.") for name in sys.modules)  # imported on first use
        from attnres_hf.modeling.backbones_moe import kimi
        kimi.load()  # Kimi Linear's first use: transformers' module imports fla
        import fla.utils.hardware
        # the filter ends with the import: the warning fla gives at import shows again when fla asks again
        fla.utils.hardware.get_available_device.cache_clear()
        fla.utils.hardware.get_available_device()
    import torch
    print(sum("Triton is not supported" in str(w.message) for w in caught), torch.cuda.is_available())
""")


@pytest.mark.slow  # a fresh interpreter imports the package (about 7 s)
def test_importing_the_package_prints_no_triton_warning():
    """`import attnres_hf` imports no fla; Kimi Linear's first use imports it (through transformers' kimi_linear
    module) without fla's "Triton is not supported on current platform" warning; the filter is the import's only: afterwards fla's warning shows again.
    (A subprocess with `-W error::UserWarning` would not test this: the error makes transformers fall back to torch.)"""
    pytest.importorskip("fla")
    result = subprocess.run([sys.executable, "-c", IMPORT_SCRIPT], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Triton is not supported" not in result.stderr
    count, cuda = result.stdout.split()
    assert count == ("0" if cuda == "True" else "1")  # once, by the re-run call; none on a machine with a GPU
