"""Kimi Linear's KDA kernel picked by the tensors' device, with flash-linear-attention installed (the test extra).

transformers 5.24 resolves `chunk_kimi_delta_attention` / `recurrent_kimi_delta_attention` to fla's Triton kernels at
import whenever fla is importable, and a CPU forward of its `KimiLinearDeltaAttention` fails (`RuntimeError: 0 active
drivers ([]). There should only be one.`). Our subclass, `backbones_kda.KimiLinearDeltaAttentionByDevice`, runs
transformers' own forward with those two names bound to dispatchers: CUDA tensors go to the function transformers
decorated, every other device to transformers' own torch function. transformers' module is never modified:
`backbones_moe.dispatch_kda_by_device(model)` gives a transformers model's KDA modules the subclass. Importing the
package prints no fla CPU warning.
"""

import inspect
import subprocess
import sys
import textwrap

import pytest
import torch
from transformers import KimiLinearConfig, KimiLinearForCausalLM

from attnres_hf.conversion import retrofit
from attnres_hf.modeling.backbones_k3 import KimiK3DeltaAttention
from attnres_hf.modeling.backbones_kda import KDA_BY_DEVICE, KDA_KERNELS, KimiLinearDeltaAttentionByDevice
from attnres_hf.modeling.backbones_moe import dispatch_kda_by_device
from attnres_hf.modeling.backbones_moe import kimi as lazy_kimi
from test_backbones_moe import COMMON, KIMI, ids, source_config
from utils import perturb_mixing

KDA = {"chunk_kimi_delta_attention": "chunk_kda", "recurrent_kimi_delta_attention": "fused_recurrent_kda"}
"""transformers' KDA functions and the fla kernel each resolves to where fla is installed."""

kimi = lazy_kimi.load()  # transformers' module, imported when Kimi Linear is first used


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


def kda_module(seed=0) -> KimiLinearDeltaAttentionByDevice:
    """Our KDA module of the tiny Kimi Linear config (4 heads of 8, hidden 32), in eval mode. The forget gate's
    `A_log` and `dt_bias` are `torch.empty` in the module's constructor (a model's `_init_weights` sets them): set
    here as Mamba-style gates are, `A = U(1, 16)` and a zero bias, so that no test reads uninitialised memory (it
    made the outputs NaN on some runs)."""
    torch.manual_seed(seed)
    module = KimiLinearDeltaAttentionByDevice(source_config("kimi_linear"), 0).eval()
    with torch.no_grad():
        module.forget_gate.A_log.uniform_(1, 16).log_()
        module.forget_gate.dt_bias.zero_()
    return module


def hidden_states(seed=2):
    return torch.randn(2, 5, COMMON["hidden_size"], generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", list(KDA))
def test_transformers_module_is_left_as_it_is_and_ours_runs_its_own_forward(name):
    """transformers' module keeps the function it decorated (resolved to fla's kernel: the setting this fixes) and its
    class its forward; ours is that forward's code (not a copy) under the same decorators, reading the dispatcher
    where transformers' reads the module's function; the dispatcher's sides are that function and the torch one."""
    pytest.importorskip("fla")
    on_cuda, elsewhere = KDA_KERNELS[name]
    assert getattr(kimi, name) is on_cuda  # never replaced
    assert inspect.getclosurevars(on_cuda).nonlocals["implementation"].__module__.startswith("fla.ops.kda")
    assert inspect.getclosurevars(on_cuda).nonlocals["implementation"].__name__ == KDA[name]
    assert elsewhere is inspect.unwrap(on_cuda) and (elsewhere.__module__, elsewhere.__name__) == (kimi.__name__, name)

    theirs, ours = kimi.KimiLinearDeltaAttention.forward, KimiLinearDeltaAttentionByDevice.forward
    assert kimi.KimiLinearDeltaAttention.__dict__["forward"] is theirs and ours is not theirs
    chain = []
    while theirs is not None:  # the same wrappers (force_accelerate_hooks, deprecate_kwarg), each rebuilt
        assert ours.__code__ is theirs.__code__ and ours is not theirs
        chain.append((theirs, ours))
        theirs, ours = getattr(theirs, "__wrapped__", None), getattr(ours, "__wrapped__", None)
    assert ours is None and len(chain) == 3
    innermost_theirs, innermost_ours = chain[-1]
    assert innermost_theirs.__globals__ is vars(kimi) and innermost_theirs.__globals__[name] is on_cuda
    assert innermost_ours.__globals__[name] is KDA_BY_DEVICE[name]
    assert all(wrapper.__globals__ is theirs_wrapper.__globals__ for theirs_wrapper, wrapper in chain[:-1])


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
    assert KDA_BY_DEVICE[name](q.as_subclass(CudaLooking), k, v, **gates, **extra) == "cuda"
    assert KDA_BY_DEVICE[name](q, k, v, **gates, **extra) == "torch"
    assert [side for side, _, _ in calls] == ["cuda", "torch"]
    (_, cuda_args, cuda_kwargs), (_, torch_args, torch_kwargs) = calls
    assert type(cuda_args[0]) is CudaLooking and cuda_args[1:] == (k, v) and cuda_kwargs == {**gates, **extra}
    assert torch_args == (q, k, v)
    assert torch_kwargs == {**gates, "output_final_state": True}  # the torch function takes no cu_seqlens
    with pytest.raises(ValueError, match="packed sequences"):
        KDA_BY_DEVICE[name](q, k, v, **gates, cu_seqlens=torch.tensor([0, 2, 5]))


def test_the_subclass_forward_calls_the_dispatcher(monkeypatch):
    """Our module's forward reaches the dispatcher: CUDA-looking hidden states take the CUDA side, CPU ones the torch
    side (each recorded, then run by the torch function); both give transformers' torch output."""
    name = "chunk_kimi_delta_attention"
    torch_function = KDA_KERNELS[name][1]
    sides = []

    def recorder(side):
        def record(*args, **kwargs):
            sides.append(side)
            accepted = inspect.signature(torch_function).parameters
            return torch_function(*args, **{key: value for key, value in kwargs.items() if key in accepted})
        return record

    module, x = kda_module(), hidden_states()
    with torch.no_grad():
        expected = module(x)
        monkeypatch.setitem(KDA_KERNELS, name, (recorder("cuda"), recorder("torch")))
        on_cpu, on_cuda = module(x), module(x.as_subclass(CudaLooking))
    assert sides == ["torch", "cuda"]
    torch.testing.assert_close(on_cpu, expected, atol=0, rtol=0)
    torch.testing.assert_close(on_cuda.as_subclass(torch.Tensor), expected, atol=0, rtol=0)


@pytest.mark.parametrize("target", [*KDA, "module"])
def test_the_dispatch_compiles_in_one_graph(target):
    """torch.compile traces the device branch (fullgraph), in each dispatcher and in our module's whole forward (with
    transformers' decorators): the compiled call runs the same torch functions."""
    if target == "module":
        function, args, kwargs = kda_module(), (hidden_states(),), {}
    else:
        (q, k, v), gates = kda_inputs()
        function, args = KDA_BY_DEVICE[target], (q, k, v)
        kwargs = {**gates, "initial_state": None, "output_final_state": True, "use_qk_l2norm_in_kernel": True}
    with torch.no_grad():
        eager = function(*args, **kwargs)
        compiled = torch.compile(function, backend="eager", fullgraph=True)(*args, **kwargs)
    for a, b in zip(*(out if isinstance(out, tuple) else (out,) for out in (compiled, eager))):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)  # the eager backend runs the same ops (0 measured)


def test_dispatch_kda_by_device_switches_only_transformers_own_kda_modules():
    """In place, on exact instances of transformers' class: parameters and names as they were, MLA untouched, K3's
    and ours left as they are (they dispatch already), idempotent; transformers' class builds its own modules still."""
    model = KimiLinearForCausalLM(source_config("kimi_linear"))
    state = {key: tensor.clone() for key, tensor in model.state_dict().items()}
    k3_kda = KimiK3DeltaAttention(source_config("kimi_k3"), 0)
    container = torch.nn.ModuleList([model, k3_kda])
    assert dispatch_kda_by_device(container) is container and dispatch_kda_by_device(container) is container
    kda, mla = model.model.layers[0].self_attn, model.model.layers[1].self_attn
    assert type(kda) is KimiLinearDeltaAttentionByDevice and type(mla) is kimi.KimiLinearAttention
    assert type(k3_kda) is KimiK3DeltaAttention and isinstance(k3_kda, KimiLinearDeltaAttentionByDevice)
    after = model.state_dict()
    assert after.keys() == state.keys() and all(torch.equal(state[key], after[key]) for key in state)
    fresh = kimi.KimiLinearDeltaAttention(source_config("kimi_linear"), 0)
    assert type(fresh) is kimi.KimiLinearDeltaAttention  # the class and its module are transformers' as they were


@pytest.mark.parametrize("model_kind", ["transformers", "attnres"])
def test_kimi_linear_trains_and_decodes_on_cpu_with_fla_installed(model_kind):
    """transformers' KimiLinearForCausalLM made to dispatch by device (`dispatch_kda_by_device`) and the AttnRes model
    retrofitted from transformers' model as it is: a forward and backward (the chunked KDA) reaches every KDA
    parameter, and a cached one-token step (the recurrent KDA) runs. transformers' module keeps its functions."""
    torch.manual_seed(0)
    model = KimiLinearForCausalLM(KimiLinearConfig(**{**COMMON, **KIMI}))
    if model_kind == "attnres":
        model = retrofit(model, attnres_block_size=2)  # reads the source's weights only: it need not dispatch
        perturb_mixing(model)
    else:
        model = dispatch_kda_by_device(model)
    model.train()
    input_ids = ids()
    out = model(input_ids, labels=input_ids)
    out.loss.backward()
    assert torch.isfinite(out.loss)
    kda = model.model.layers[0].self_attn
    assert type(kda) is KimiLinearDeltaAttentionByDevice
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in kda.parameters())
    model.eval()
    with torch.no_grad():
        prefill = model(input_ids[:, :-1], use_cache=True)
        cache = prefill.past_key_values if model_kind == "transformers" else prefill.cache
        step = model(input_ids[:, -1:], **{"past_key_values" if model_kind == "transformers" else "cache": cache},
                     use_cache=True)
    assert step.logits.shape == (2, 1, COMMON["vocab_size"]) and torch.isfinite(step.logits).all()
    assert all(getattr(kimi, name) is KDA_KERNELS[name][0] for name in KDA)  # used, never replaced


IMPORT_SCRIPT = textwrap.dedent("""
    import sys, warnings
    import torch
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        import attnres_hf
        from attnres_hf.modeling.backbones_moe import dispatch_kda_by_device, kimi
        dispatch_kda_by_device(torch.nn.Linear(2, 2))  # no Kimi Linear module can exist yet: nothing imported
        assert not any(name == "fla" or name.startswith("fla.") for name in sys.modules)  # imported on first use
        decorated = kimi.load().chunk_kimi_delta_attention  # Kimi Linear's first use: transformers' module imports fla
        import fla.utils.hardware
        # the filter ends with the import: the warning fla gives at import shows again when fla asks again
        fla.utils.hardware.get_available_device.cache_clear()
        fla.utils.hardware.get_available_device()
    assert kimi.load().chunk_kimi_delta_attention is decorated
    print(sum("Triton is not supported" in str(w.message) for w in caught), torch.cuda.is_available())
""")


@pytest.mark.slow  # a fresh interpreter imports the package (about 7 s)
def test_importing_the_package_prints_no_triton_warning():
    """`import attnres_hf` imports no fla (nor does `dispatch_kda_by_device` of a model without Kimi Linear modules);
    Kimi Linear's first use imports it (through transformers' kimi_linear module) without fla's "Triton is not
    supported on current platform" warning; the filter is the import's only: afterwards fla's warning shows again.
    (A subprocess with `-W error::UserWarning` would not test this: the error makes transformers fall back to torch.)"""
    pytest.importorskip("fla")
    result = subprocess.run([sys.executable, "-c", IMPORT_SCRIPT], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Triton is not supported" not in result.stderr
    count, cuda = result.stdout.split()
    assert count == ("0" if cuda == "True" else "1")  # once, by the re-run call; none on a machine with a GPU
