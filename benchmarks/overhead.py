"""Overhead of AttnRes against the matching `transformers` Llama, measured in one run.

Shape: SmolLM2-135M (30 layers, hidden 576, 9 heads, 3 kv heads, intermediate 1536, vocab 49152), random weights
shared by all models, fp32. Models: `LlamaForCausalLM`, Block AttnRes (about 8 blocks) and Full AttnRes. For each
workload the models run alternately, `--repeats` times, and the median is reported:

- train:   forward + backward of a causal-LM loss on `--train-batch` x `--train-len` tokens;
- prefill: forward of 1 x `--prefill-len` tokens, no grad;
- decode:  per-token forward with the KV cache, `--decode-tokens` new tokens after a 16-token prompt (median
           per token).

Peak memory of the training step: on CUDA `torch.cuda.max_memory_allocated`; on CPU the bytes of the tensors the
step keeps alive (parameters, gradients and every tensor saved for backward, deduplicated by storage), counted with
autograd's saved-tensor hooks, since CPU has no allocator statistics.

Targets from the paper's efficiency claims (GPU, fused kernels): Block <= 1.04x on the training step and <= 1.02x on prefill and
decode; Full <= 1.10x; Block training peak memory <= 1.10x.

    python benchmarks/overhead.py                 # CPU
    python benchmarks/overhead.py --device cuda   # GPU
"""

import argparse
import statistics
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from attnres_hf import AttnResConfig, AttnResForCausalLM, default_attnres_block_size

SMOLLM2_135M = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    max_position_embeddings=2048,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
)


def build_models(device: torch.device, attn_implementation: str) -> dict[str, torch.nn.Module]:
    torch.manual_seed(0)
    llama = LlamaForCausalLM(LlamaConfig(**SMOLLM2_135M, attn_implementation=attn_implementation))
    block_size = default_attnres_block_size(SMOLLM2_135M["num_hidden_layers"])
    models = {"llama": llama}
    for name, size in ((f"block(S={block_size})", block_size), ("full(S=1)", 1)):
        config = AttnResConfig(**SMOLLM2_135M, attnres_block_size=size, attn_implementation=attn_implementation)
        model = AttnResForCausalLM(config)
        model.load_state_dict(llama.state_dict(), strict=False)  # same backbone; routers stay zero
        models[name] = model
    return {name: model.to(device) for name, model in models.items()}


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def train_step(model, batch) -> None:
    model.zero_grad(set_to_none=True)
    model(batch, labels=batch).loss.backward()


@torch.no_grad()
def prefill(model, tokens) -> None:
    model(tokens, use_cache=False)


@torch.no_grad()
def decode_per_token(model, prompt, new_tokens: int, device) -> float:
    out = model(prompt, use_cache=True)
    cache, token = out.cache, out.logits[:, -1:].argmax(-1)
    times = []
    for _ in range(new_tokens):
        synchronize(device)
        start = time.perf_counter()
        out = model(token, cache=cache, use_cache=True)
        synchronize(device)
        times.append(time.perf_counter() - start)
        token = out.logits[:, -1:].argmax(-1)
    return statistics.median(times)


def timed(fn, device) -> float:
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - start


def training_peak_bytes(model, batch, device) -> int:
    """Peak bytes of a training step (see the module docstring for how CPU is counted)."""
    if device.type == "cuda":
        model.zero_grad(set_to_none=True)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        train_step(model, batch)
        return torch.cuda.max_memory_allocated(device)
    saved: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    model.zero_grad(set_to_none=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = model(batch, labels=batch).loss
    params = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}
    activations = sum(nbytes for ptr, nbytes in saved.items() if ptr not in params)
    loss.backward()
    return 2 * sum(params.values()) + activations  # parameters + gradients + saved activations


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--train-batch", type=int, default=4)
    parser.add_argument("--train-len", type=int, default=256)
    parser.add_argument("--prefill-len", type=int, default=512)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--attn-implementation", default="sdpa")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    device = torch.device(args.device)
    models = build_models(device, args.attn_implementation)
    generator = torch.Generator().manual_seed(0)
    vocab = SMOLLM2_135M["vocab_size"]
    batch = torch.randint(vocab, (args.train_batch, args.train_len), generator=generator).to(device)
    tokens = torch.randint(vocab, (1, args.prefill_len), generator=generator).to(device)
    prompt = torch.randint(vocab, (1, 16), generator=generator).to(device)

    results = {name: {"train": [], "prefill": [], "decode": []} for name in models}
    for name, model in models.items():  # warm-up
        model.train()
        train_step(model, batch)
        model.eval()
        prefill(model, tokens)
        decode_per_token(model, prompt, 4, device)
    for repeat in range(args.repeats):
        for name, model in models.items():
            model.train()
            results[name]["train"].append(timed(lambda: train_step(model, batch), device))
            model.eval()
            results[name]["prefill"].append(timed(lambda: prefill(model, tokens), device))
            results[name]["decode"].append(decode_per_token(model, prompt, args.decode_tokens, device))
        print(f"repeat {repeat + 1}/{args.repeats} done", flush=True)

    peaks = {}
    for name, model in models.items():
        model.train()
        peaks[name] = training_peak_bytes(model, batch, device)

    print(
        f"\ndevice={device} threads={torch.get_num_threads()} dtype=fp32 attn={args.attn_implementation} "
        f"train={args.train_batch}x{args.train_len} prefill=1x{args.prefill_len} decode={args.decode_tokens} tokens "
        f"repeats={args.repeats} (medians)"
    )
    header = f"{'model':<14}{'train s':>10}{'ratio':>8}{'prefill s':>11}{'ratio':>8}{'decode ms/tok':>15}{'ratio':>8}"
    print(header + f"{'train peak MiB':>16}{'ratio':>8}")
    base = {kind: statistics.median(values) for kind, values in results["llama"].items()}
    for name, runs in results.items():
        med = {kind: statistics.median(values) for kind, values in runs.items()}
        print(
            f"{name:<14}{med['train']:>10.3f}{med['train'] / base['train']:>8.3f}"
            f"{med['prefill']:>11.3f}{med['prefill'] / base['prefill']:>8.3f}"
            f"{med['decode'] * 1e3:>15.2f}{med['decode'] / base['decode']:>8.3f}"
            f"{peaks[name] / 2**20:>16.0f}{peaks[name] / peaks['llama']:>8.3f}"
        )
    print("targets (paper, GPU): block train <= 1.04, prefill/decode <= 1.02, full <= 1.10, block train peak <= 1.10")


if __name__ == "__main__":
    main()
