"""The stages of the AttnRes pipeline and the schedule that runs them: each rank's kept sources and their gradients
(`CrossStageCache`, the paper's cross-stage caching, §4), one virtual stage's modules (`AttnResStageModule`), and this
rank's part of the interleaved pipeline (`AttnResPipeline`, on `ScheduleInterleaved1F1B`).

Part of the pipeline-parallel training in `pipeline_parallel.py`, whose docstring states the design (what crosses a
stage boundary, which sources a rank keeps, how their gradients come back, the loss).
"""

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, ScheduleInterleaved1F1B

from .._checks import check_int
from ..modeling.backbones import backbone_adapter
from ..modeling.depth_mixing import DEPTH_MIXING
from ..modeling.mixing_base import register_modules, registered_modules
from .pipeline_plan import RUNNING_FIELDS, SOURCE_FIELDS, PipelinePlan, StateCodec, plan_pipeline

# ---------------------------------------------------------------------------------------------------------------
# The kept sources and their gradients
# ---------------------------------------------------------------------------------------------------------------


class CrossStageCache:
    """One rank's kept sources (paper §4): for each `(micro_batch, stage)`, the completed sources the rank's previous
    stage produced for that micro-batch, as detached leaves that stage `stage` reads and whose `.grad` its backward
    fills."""

    def __init__(self):
        self._kept: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        self._backward_done: set[tuple[int, int]] = set()

    def __len__(self) -> int:
        return len(self._kept)

    def keep(self, micro_batch: int, stage: int, sources: dict[str, torch.Tensor]) -> None:
        if (micro_batch, stage) in self._kept:
            raise RuntimeError(f"sources for micro-batch {micro_batch}, stage {stage} are already kept")
        self._kept[micro_batch, stage] = {name: t.detach().requires_grad_(t.requires_grad)
                                          for name, t in sources.items()}

    def read(self, micro_batch: int, stage: int) -> dict[str, torch.Tensor]:
        try:
            return self._kept[micro_batch, stage]
        except KeyError:
            raise RuntimeError(f"no kept sources for micro-batch {micro_batch} at stage {stage}: the rank's previous "
                               "stage did not run it first") from None

    def backward_done(self, micro_batch: int, stage: int) -> None:
        """Stage `stage` has run its backward of `micro_batch`: the kept leaves hold their gradient."""
        if (micro_batch, stage) in self._kept:
            self._backward_done.add((micro_batch, stage))

    def pop_gradients(self, micro_batch: int, stage: int) -> tuple[torch.Tensor | None, ...]:
        """The gradients stage `stage` left on the kept sources of `micro_batch` (`None`: a source it did not use),
        in `SOURCE_FIELDS` order; forgets the entry."""
        if (micro_batch, stage) not in self._backward_done:
            raise RuntimeError(f"stage {stage}'s backward of micro-batch {micro_batch} has not run before its "
                               "previous stage on this rank needs the gradient of the sources it kept")
        self._backward_done.discard((micro_batch, stage))
        return tuple(leaf.grad for leaf in self._kept.pop((micro_batch, stage)).values())

    def clear(self) -> None:
        self._kept.clear()
        self._backward_done.clear()


class _ReturnKeptGradients(torch.autograd.Function):
    """Identity on a stage's outputs whose backward also returns, for the sources the rank kept, the gradient the
    rank's later stage left on them (see `pipeline_parallel`'s docstring, "Backward")."""

    @staticmethod
    def forward(ctx, cache, key, num_kept, *tensors):
        ctx.cache, ctx.key, ctx.num_kept = cache, key, num_kept
        return tuple(t.view_as(t) for t in tensors[num_kept:])

    @staticmethod
    def backward(ctx, *grads):
        kept = ctx.cache.pop_gradients(*ctx.key)
        return (None, None, None, *kept, *grads)


# ---------------------------------------------------------------------------------------------------------------
# Stages
# ---------------------------------------------------------------------------------------------------------------


class AttnResStageModule(nn.Module):
    """The modules of one virtual stage, shared with `model` (same parameters): the embedding (stage 0), decoder
    layers `layer_ranges[stage]`, the rotary embedding, and (last stage) the final router, `model.norm`, `lm_head`.

    `forward(*inputs)`: stage 0 takes `input_ids` `(b, T)`; the others the sent sources (if any: one tensor per
    `SOURCE_FIELDS` entry, `(b, T, k, d)` and `(b, T, k)`) and the running fields (`(b, T, d)`). Returns the same
    kind of tuple for the next stage, or the logits `(b, T, vocab_size)` on the last stage.
    """

    def __init__(self, model: nn.Module, plan: PipelinePlan, stage: int, codec: StateCodec,
                 cache: CrossStageCache | None):
        super().__init__()
        inner, config = model.model, model.config
        self.config, self.plan, self.stage, self.codec, self.cache = config, plan, stage, codec, cache
        self.is_first, self.is_last = stage == 0, stage == plan.num_stages - 1
        first, end = plan.layer_ranges[stage]
        self.first_sublayer = 2 * first
        if self.is_first:
            self.embed_tokens = inner.embed_tokens
        self.layers = nn.ModuleList(inner.layers[first:end])
        self.adapter = backbone_adapter(config)  # the backbone family's masks, rotary, embedding and head
        self.layer_types = self.adapter.layer_types(config)
        if getattr(inner, "rotary_emb", None) is not None:
            self.rotary_emb = inner.rotary_emb
        if self.is_last:
            self._final_type = DEPTH_MIXING[config.depth_mixing].final_modules
            register_modules(self, registered_modules(inner, self._final_type))
            self.norm = inner.norm
            self.lm_head = model.lm_head
        self.micro_batch: int | None = None  # set by the stage around each forward

    def forward(self, *inputs: torch.Tensor):
        plan, codec, stage = self.plan, self.codec, self.stage
        if self.is_first:
            (input_ids,) = inputs
            hidden = self.embed_tokens(input_ids)  # (b, T, d)
            if self.adapter.embedding_multiplier is not None:  # Granite: part of the embedding source
                hidden = hidden * getattr(self.config, self.adapter.embedding_multiplier)
            state = codec.start(hidden)
        else:
            count = len(SOURCE_FIELDS) if len(inputs) > len(RUNNING_FIELDS) else 0
            received = dict(zip(SOURCE_FIELDS, inputs[:count]))
            running = dict(zip(RUNNING_FIELDS, inputs[count:], strict=True))
            if plan.kept_sources(stage):
                kept = self.cache.read(self.micro_batch, stage)
                received = {name: torch.cat([kept[name], received[name]], dim=axis) if received else kept[name]
                            for name, axis in SOURCE_FIELDS.items()}  # (b, T, n, d), (b, T, n)
            state = codec.join(received, running, self.first_sublayer)
            hidden = running[RUNNING_FIELDS[0]]
        position_ids = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        # The masks and position embeddings of each layer type, as `AttnResModel.forward` builds them.
        masks = self.adapter.attention_masks(self.config, self.layer_types, inputs_embeds=hidden, attention_mask=None,
                                             cache=None, position_ids=position_ids)
        position_embeddings = self.adapter.position_embeddings(getattr(self, "rotary_emb", None), hidden,
                                                               position_ids, self.layer_types)
        for layer in self.layers:
            layer_type = self.layer_types[layer.layer_idx]
            state, _, _ = layer(state, attention_mask=masks[layer_type],
                                position_embeddings=position_embeddings[layer_type], position_ids=position_ids)
        if self.is_last:
            final = state.read_final(registered_modules(self, self._final_type))
            logits = self.lm_head(self.norm(final.hidden))
            if self.adapter.logits is not None:  # the family's head: Gemma's soft-capping, Granite's logits_scaling
                logits = self.adapter.logits(self.config.backbone, logits)
            return logits

        sources, running = codec.split(state)
        if codec.num_sources(sources) != plan.sources_after[stage]:
            raise RuntimeError(f"stage {stage} holds {codec.num_sources(sources)} sources, the plan expects "
                               f"{plan.sources_after[stage]}: the block rule of {type(state).__name__} changed")
        first, end = plan.sent_sources(stage)
        outputs = [sources[name].narrow(axis, first, end - first).contiguous()
                   for name, axis in SOURCE_FIELDS.items() if end > first]
        outputs += [running[name].contiguous() for name in RUNNING_FIELDS]
        consumer = stage + plan.num_ranks
        if plan.cache and consumer < plan.num_stages:
            # AttnRes §4: this rank keeps the sources for its next stage, which then receives only newer ones.
            self.cache.keep(self.micro_batch, consumer, sources)
            outputs = _ReturnKeptGradients.apply(self.cache, (self.micro_batch, consumer), len(sources),
                                                 *sources.values(), *outputs)
        return tuple(outputs)


class _AttnResStage(PipelineStage):
    """A `PipelineStage` that tells its module which micro-batch runs (to find the kept sources) and counts the bytes
    its send ops carry (`bytes_sent["forward"]`, `bytes_sent["backward"]`)."""

    def __init__(self, *args, bytes_sent: dict[str, int], **kwargs):
        super().__init__(*args, **kwargs)
        self.bytes_sent = bytes_sent

    def forward_one_chunk(self, fwd_chunk_id, *args, **kwargs):
        self.submod.micro_batch = fwd_chunk_id
        try:
            return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)
        finally:
            self.submod.micro_batch = None

    def backward_one_chunk(self, bwd_chunk_id, *args, **kwargs):
        super().backward_one_chunk(bwd_chunk_id, *args, **kwargs)
        if self.submod.cache is not None:
            self.submod.cache.backward_done(bwd_chunk_id, self.stage_index)

    def _count(self, direction: str, ops: list) -> list:
        self.bytes_sent[direction] += sum(op.tensor.numel() * op.tensor.element_size() for op in ops)
        return ops

    def get_fwd_send_ops(self, fwd_chunk_id):
        return self._count("forward", super().get_fwd_send_ops(fwd_chunk_id))

    def get_bwd_send_ops(self, bwd_chunk_id):
        return self._count("backward", super().get_bwd_send_ops(bwd_chunk_id))


class AttnResPipeline:
    """This rank's part of an interleaved pipeline over an `AttnResForCausalLM` (see `pipeline_parallel`'s docstring).

    Every rank builds (or loads) the same full model and passes it here; the pipeline runs the rank's stages with the
    model's own modules and parameters, so after training the rank's model holds the trained weights of its stages.

    Args:
        model: `AttnResForCausalLM` with `depth_mixing="attnres"`, identical on every rank, on `device`.
        micro_batch_size: sequences per micro-batch `b`.
        seq_len: tokens per sequence `T` (fixed: the stages' buffers are allocated once).
        num_micro_batches: micro-batches per step; a `step` takes `b * num_micro_batches` sequences.
        virtual_stages: stages per rank `V` (>= 2).
        cache: keep received sources on each rank (paper §4); False sends the full depth state at each hand-off
            (same numbers, more bytes).
        layers_per_stage: see `plan_pipeline`.
        group: the pipeline's process group (default: the world). With tied embeddings every rank of the world
            takes part in creating the pair group of stage 0 and stage `S - 1` (`dist.new_group`), so several
            pipeline groups side by side (pipeline x data parallel) need untied embeddings for now.
        device: where the stages run (default: the model's device).

    Raises:
        RuntimeError: `torch.distributed` is not initialised.
        ValueError: see `plan_pipeline`; non-positive sizes; `num_micro_batches` that ScheduleInterleaved1F1B rejects.

    Attributes:
        plan: the `PipelinePlan`. bytes_sent: `{"forward": int, "backward": int}`, bytes this rank's stages have put
            in send ops since construction (or `reset_bytes_sent`).
    """

    def __init__(self, model: nn.Module, *, micro_batch_size: int, seq_len: int, num_micro_batches: int,
                 virtual_stages: int = 2, cache: bool = True, layers_per_stage: Sequence[int] | None = None,
                 group: dist.ProcessGroup | None = None, device: torch.device | None = None):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("AttnResPipeline needs torch.distributed initialised on every rank (e.g. launch with "
                               "torchrun and call torch.distributed.init_process_group())")
        for value, name in ((micro_batch_size, "micro_batch_size"), (seq_len, "seq_len"),
                            (num_micro_batches, "num_micro_batches")):
            check_int(name, value, minimum=1)
        self.model, self.group = model, group
        self.micro_batch_size, self.seq_len, self.num_micro_batches = micro_batch_size, seq_len, num_micro_batches
        self.rank, num_ranks = dist.get_rank(group), dist.get_world_size(group)
        self.plan = plan_pipeline(model.config, num_ranks, virtual_stages, cache, layers_per_stage)
        self.codec = StateCodec(model.config)
        self.cache = CrossStageCache()
        self.bytes_sent = {"forward": 0, "backward": 0}
        device = device or next(model.parameters()).device
        dtype = model.get_input_embeddings().weight.dtype
        plan = self.plan

        def hand_off(stage: int) -> list[torch.Tensor]:  # what stage `stage` sends
            first, end = plan.sent_sources(stage)
            return self.codec.examples(micro_batch_size, seq_len, end - first, dtype)

        self.stages = []
        for stage in range(self.rank, plan.num_stages, num_ranks):
            module = AttnResStageModule(model, plan, stage, self.codec, self.cache)
            inputs = ((torch.empty(micro_batch_size, seq_len, dtype=torch.long, device="meta"),) if stage == 0
                      else tuple(hand_off(stage - 1)))
            outputs = (torch.empty(micro_batch_size, seq_len, model.config.vocab_size, dtype=dtype, device="meta")
                       if stage == plan.num_stages - 1 else tuple(hand_off(stage)))
            self.stages.append(_AttnResStage(module, stage, plan.num_stages, device, input_args=inputs,
                                             output_args=outputs, group=group, bytes_sent=self.bytes_sent))
        # Summed per-micro-batch losses over the global token count = the whole batch's mean (scale_grads=False).
        self.schedule = ScheduleInterleaved1F1B(self.stages, num_micro_batches, loss_fn=self._loss, scale_grads=False)
        self.last_rank = (plan.num_stages - 1) % num_ranks
        self._tied, self._tied_group = None, None
        embedding = model.get_input_embeddings().weight
        if model.get_output_embeddings().weight is embedding:  # tie_word_embeddings: stage 0 and S-1, two ranks
            ranks = sorted({dist.get_global_rank(group, 0) if group else 0,
                            dist.get_global_rank(group, self.last_rank) if group else self.last_rank})
            tied_group = dist.new_group(ranks)  # every rank of the world takes part in new_group
            if self.rank in (0, self.last_rank):
                self._tied, self._tied_group = embedding, tied_group

    def _loss(self, logits: torch.Tensor, labels: torch.Tensor, num_items_in_batch: torch.Tensor) -> torch.Tensor:
        return self.model.loss_function(logits=logits, labels=labels, vocab_size=self.model.config.vocab_size,
                                        num_items_in_batch=num_items_in_batch)

    def parameters(self) -> list[nn.Parameter]:
        """The parameters this rank trains (its stages'), each once: give these to the optimizer."""
        seen, params = set(), []
        for stage in self.stages:
            for param in stage.submod.parameters():
                if id(param) not in seen:
                    seen.add(id(param))
                    params.append(param)
        return params

    def save_pretrained(self, save_directory, tokenizer=None) -> None:
        """Write the trained model as one checkpoint (`model.save_pretrained`, with `tokenizer` if given).

        Collective: call it on every rank. Each rank writes the parameters of its stages to
        `save_directory/pipeline-rank{r}.safetensors`; rank 0 loads them into its model, saves it and removes the
        parts. Needs a `save_directory` every rank can read and write (one machine, or a shared file system).

        Raises:
            RuntimeError: a parameter no rank trained (rank 0; a bug).
        """
        from pathlib import Path

        from safetensors.torch import load_file, save_file

        output = Path(save_directory)
        output.mkdir(parents=True, exist_ok=True)
        owned = {id(p) for p in self.parameters()}
        save_file({name: p.detach().cpu().contiguous() for name, p in self.model.named_parameters() if id(p) in owned},
                  str(output / f"pipeline-rank{self.rank}.safetensors"))
        dist.barrier(group=self.group)
        if self.rank == 0:
            parts = [output / f"pipeline-rank{rank}.safetensors" for rank in range(self.plan.num_ranks)]
            state = {name: tensor for path in parts for name, tensor in load_file(str(path)).items()}
            missing = {name for name, _ in self.model.named_parameters()} - set(state)
            if missing:
                raise RuntimeError(f"no rank holds the trained {sorted(missing)}")
            self.model.load_state_dict(state, strict=False)
            self.model.save_pretrained(output)
            if tokenizer is not None:
                tokenizer.save_pretrained(output)
            for path in parts:
                path.unlink()
        dist.barrier(group=self.group)

    def reset_bytes_sent(self) -> None:
        self.bytes_sent.update(forward=0, backward=0)

    def step(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """One forward and backward over the global batch; gradients accumulate in `parameters()`' `.grad`.

        Args:
            input_ids: `(micro_batch_size * num_micro_batches, seq_len)` int64, the same on every rank.
            labels: same shape, `-100` ignored, shifted inside the loss as in `AttnResForCausalLM`; default
                `input_ids`.

        Returns:
            The global batch's mean next-token loss, a 0-dim fp32 tensor, on every rank.

        Raises:
            ValueError: wrong shapes or dtype (before anything runs).
        """
        shape = (self.micro_batch_size * self.num_micro_batches, self.seq_len)
        labels = input_ids if labels is None else labels
        for tensor, name in ((input_ids, "input_ids"), (labels, "labels")):
            if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != shape or tensor.dtype != torch.long:
                got = (tuple(tensor.shape), tensor.dtype) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
                raise ValueError(f"{name} must be an int64 tensor of shape {shape} (micro_batch_size * "
                                 f"num_micro_batches, seq_len), got {got}")
        device = self.stages[0].device
        input_ids, labels = input_ids.to(device), labels.to(device)
        num_items = (labels[:, 1:] != -100).sum()
        losses: list[torch.Tensor] = []
        try:
            self.schedule.step(input_ids, target=labels, losses=losses, return_outputs=False,
                               loss_kwargs={"num_items_in_batch": num_items})
        finally:
            leftover = len(self.cache)
            self.cache.clear()
        if leftover:
            raise RuntimeError(f"{leftover} kept source entries were never consumed by a backward")
        if self._tied is not None:  # both ranks of the tied pair take part, with a zero gradient if need be
            if self._tied.grad is None:
                self._tied.grad = torch.zeros_like(self._tied)
            dist.all_reduce(self._tied.grad, group=self._tied_group)
        loss = torch.stack(losses).sum().detach().float() if losses else torch.zeros((), device=device)
        dist.broadcast(loss, src=dist.get_global_rank(self.group, self.last_rank) if self.group else self.last_rank,
                       group=self.group)
        return loss


__all__ = ["AttnResPipeline", "AttnResStageModule", "CrossStageCache"]
