"""Training dynamics across depth (the paper's Figure 5 b/c): output and gradient magnitude per layer.

`DepthDynamicsCallback` records, every `every` steps, on a fixed probe batch:

- `hidden_rms[l]`: RMS of the stream after layer `l` (baseline: the residual stream; AttnRes: the routed input of
  the next layer, and for the last layer the final router's output), always before the final norm;
- `output_rms[l]`: RMS of layer `l`'s own output, attention plus MLP (what it adds to the stream or the sources);
- `grad_norm[l]`: L2 norm of the gradients of layer `l`'s parameters at that step, after the Trainer's global
  gradient clipping (a uniform scale, so the depth profile is unchanged).

`run_dynamics` trains a baseline (`depth_mixing="residual"`) and an AttnRes model of the same shape from scratch on
the same data and plots both.
"""

import json
import os
from pathlib import Path

import torch
from transformers import TrainerCallback, TrainingArguments

from .._checks import check_int, check_paths
from ..modeling import AttnResConfig, AttnResForCausalLM


class DepthDynamicsCallback(TrainerCallback):
    """Record per-layer magnitudes during `Trainer` training; `history` is JSON-ready."""

    def __init__(self, probe_input_ids: torch.Tensor, every: int = 10):
        _check_input_ids(probe_input_ids)
        self.probe = probe_input_ids
        check_int("every", every, 1, "steps")
        self.every = every
        self.history = {"steps": [], "hidden_rms": [], "output_rms": [], "grad_norm": []}
        self._grads = None

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        step = state.global_step + 1  # the step this optimizer update completes
        if step % self.every == 0 or step == 1 or step == state.max_steps:
            self._grads = [
                float(torch.sqrt(sum((p.grad.float() ** 2).sum() for p in layer.parameters() if p.grad is not None)))
                for layer in _layers(model)
            ]

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if self._grads is None:
            return
        hidden_rms, output_rms = layer_magnitudes(model, self.probe)
        self.history["steps"].append(state.global_step)
        self.history["hidden_rms"].append(hidden_rms)
        self.history["output_rms"].append(output_rms)
        self.history["grad_norm"].append(self._grads)
        self._grads = None


def _layers(model):
    inner = model.module if hasattr(model, "module") else model
    return inner.model.layers


def _check_input_ids(input_ids) -> None:
    if not isinstance(input_ids, torch.Tensor) or input_ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"input_ids must be an integer torch.Tensor (batch, seq_len), got {type(input_ids).__name__}")
    if input_ids.dim() != 2 or input_ids.numel() == 0:
        raise ValueError(f"input_ids must be a non-empty (batch, seq_len) tensor, got shape {tuple(input_ids.shape)}")


def _rms(x: torch.Tensor) -> float:
    return float(x.float().pow(2).mean().sqrt())


@torch.no_grad()
def layer_magnitudes(model, input_ids: torch.Tensor) -> tuple[list[float], list[float]]:
    """`(hidden_rms, output_rms)` per layer on `input_ids` (`(batch, seq_len)` int64; see the module docstring).

    Raises:
        TypeError / ValueError: `input_ids` is not a non-empty integer tensor of shape `(batch, seq_len)`.
    """
    _check_input_ids(input_ids)
    outputs: dict[int, float] = {}
    final: list[float] = []
    inner = model.module if hasattr(model, "module") else model
    hooks = [inner.model.norm.register_forward_hook(lambda module, args, out: final.append(_rms(args[0])))]
    for index, layer in enumerate(_layers(model)):
        def capture(module, args, out, index=index):
            value = out[0] if isinstance(out, tuple) else out
            outputs[index] = outputs.get(index, 0.0) + _rms(value) ** 2  # attn and mlp: add their mean squares
        hooks += [layer.self_attn.register_forward_hook(capture), layer.mlp.register_forward_hook(capture)]
    was_training = model.training
    model.eval()
    try:
        out = model(input_ids.to(next(model.parameters()).device), output_hidden_states=True, use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
        model.train(was_training)
    hidden_rms = [_rms(h) for h in out.hidden_states[1:-1]] + final  # the last entry of hidden_states is normed
    return hidden_rms, [outputs[i] ** 0.5 for i in range(len(outputs))]


def run_dynamics(
    data: list[str | os.PathLike],
    tokenizer,
    output_dir: str | Path,
    steps: int = 300,
    num_hidden_layers: int = 8,
    hidden_size: int = 128,
    seq_len: int = 128,
    batch_size: int = 8,
    learning_rate: float = 1e-3,
    every: int = 25,
    seed: int = 0,
) -> dict:
    """Train a baseline and a Block AttnRes model (same shape, same data, same seed) from scratch and record their
    depth dynamics. Writes `dynamics.json` and `dynamics.png` to `output_dir`; returns the histories.

    Raises:
        TypeError: a setting of the wrong type (`data` takes a path or a list of paths).
        ValueError: a count below 1, a non-positive learning rate (and the data errors of `packed_lm_dataset`).

    Both before any model is built.
    """
    from ..training import AttnResTrainer, packed_lm_dataset

    data = check_paths("data", data)
    if not callable(tokenizer) or not hasattr(tokenizer, "__len__"):
        raise TypeError(f"tokenizer must be a transformers tokenizer, got {type(tokenizer).__name__}")
    if not isinstance(output_dir, (str, os.PathLike)):
        raise TypeError(f"output_dir must be a folder path, got {type(output_dir).__name__}")
    for name, value in (("steps", steps), ("num_hidden_layers", num_hidden_layers), ("hidden_size", hidden_size),
                        ("seq_len", seq_len), ("batch_size", batch_size), ("every", every)):
        check_int(name, value, 1)
    if isinstance(learning_rate, bool) or not isinstance(learning_rate, (int, float)) or not learning_rate > 0:
        raise ValueError(f"learning_rate must be a positive number, got {learning_rate!r}")
    output_dir = Path(output_dir)
    dataset = packed_lm_dataset(data, tokenizer, seq_len=seq_len, eval_fraction=0.02)
    probe = torch.tensor(dataset["eval"][: min(4, len(dataset["eval"]))]["input_ids"])
    histories = {}
    for name, depth_mixing in (("baseline (residual)", "residual"), ("Block AttnRes", "attnres")):
        torch.manual_seed(seed)
        config = AttnResConfig(
            vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=4 * hidden_size,
            num_hidden_layers=num_hidden_layers, num_attention_heads=max(1, hidden_size // 32),
            max_position_embeddings=seq_len, depth_mixing=depth_mixing, tie_word_embeddings=True,
            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        model = AttnResForCausalLM(config)
        callback = DepthDynamicsCallback(probe, every=every)
        args = TrainingArguments(
            output_dir=str(output_dir / "runs" / depth_mixing), max_steps=steps, per_device_train_batch_size=batch_size,
            learning_rate=learning_rate, warmup_steps=max(1, steps // 10), lr_scheduler_type="cosine",
            logging_steps=max(1, steps // 10), save_strategy="no", eval_strategy="no", report_to="none", seed=seed,
        )
        trainer = AttnResTrainer(model=model, args=args, train_dataset=dataset["train"], callbacks=[callback],
                                 entropy_batches=0)
        trainer.train()
        losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
        histories[name] = callback.history | {"last_logged_train_loss": losses[-1] if losses else None}
    from .plots import plot_dynamics

    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "dynamics.json").write_text(json.dumps(histories, indent=2) + "\n")
    plot_dynamics(histories, output_dir / "dynamics.png")
    return histories
