"""Pipeline-parallel training of Block AttnRes with the paper's cross-stage caching (Kimi Team, "Attention
Residuals", arXiv:2603.15031, §4 and Figure 3), on `torch.distributed.pipelining`.

**Split.** The decoder layers are cut at layer boundaries into `S = P * V` virtual stages: `P` ranks, `V >= 2` stages
per rank, stage `s` on rank `s % P`. `ScheduleInterleaved1F1B` runs them, so every micro-batch passes each rank `V`
times. Stage 0 also holds the embedding; stage `S - 1` the final router, `model.norm` and `lm_head`.

**What crosses a stage boundary.** Block AttnRes routes each sub-layer over all completed block sources (Eq. 6), so a
hand-off carries the micro-batch's depth state: the `n_s` completed sources `b_0 .. b_{n_s - 1}` (embedding and block
sums, `(b, T, n_s, d)` in the model dtype, plus their fp32 key-norm statistics `(b, T, n_s)`) and the current block's
partial sum `(b, T, d)`. After stage `s` (decoder layers `0 .. e_s - 1` done, `2 e_s` sub-layers, block size `S_b`),
`n_s = 1 + floor((2 e_s - 1) / S_b)`: a block closes when the next sub-layer reads it.

**Cross-stage caching (paper §4).** Completed sources never change. When a micro-batch reaches stage `s`, its rank
already holds every source that stage `s - P` (the rank's previous visit) produced for it: the rank keeps them, and
stage `s - 1` sends only the sources completed since (`b_{n_{s-P}} .. b_{n_{s-1} - 1}`) and the partial sum. Bytes
sent per micro-batch in each direction (activations forward; their gradients backward, the same shapes), with `E`
the activation element size (4 fp32, 2 bf16) and `n_s = 0` for `s < 0`:

    without caching:  b T [ sum_{s=0}^{S-2} n_s (d E + 4)               + (S - 1) d E ]
    with caching:     b T [ sum_{s=0}^{S-2} (n_s - n_{s+1-P}) (d E + 4) + (S - 1) d E ]
                    = b T [ sum_{s=S-P}^{S-2} n_s (d E + 4)             + (S - 1) d E ]   (the sum telescopes)

With `N` blocks the source term is about `N S / 2` source copies per token without caching and at most
`(P - 1) (N + 1)` with it (the embedding counts as a source): each source reaches each other rank once.
`PipelinePlan.bytes_per_micro_batch` evaluates both; `benchmarks/pipeline_bytes.py` compares them with the bytes the
stages actually send.

**Backward.** Stage `s + P` reads the kept sources as detached leaves, so its backward (run by the schedule like any
other) leaves their gradient in the leaves' `.grad`. Stage `s`'s outputs went through an identity autograd function
(`_ReturnKeptGradients`) whose backward hands that gradient to the sources in stage `s`'s own graph, next to the
gradients received for what it sent. In any schedule stage `s + P`'s backward of a micro-batch precedes stage `s`'s
(stage `s` needs the input gradients of `s + 1`, which needs those of `s + 2`, ...), so the gradient is there in time;
a missing one is an error, not a silent zero. This needs schedules whose backward is one autograd pass per stage and
micro-batch (`ScheduleInterleaved1F1B`, used here); zero-bubble schedules that split off the weight gradients compute
input gradients with `torch.autograd.grad`, which leaves no `.grad` on the kept sources.

Loss: each micro-batch's token-summed cross-entropy divided by the global batch's number of predicted tokens
(transformers' `num_items_in_batch`), so the summed micro-batch losses and gradients equal one step on the whole
batch, also with `-100` labels. Tied embeddings (`tie_word_embeddings`, e.g. SmolLM2): stage 0 and stage `S - 1` sit
on different ranks, and their gradients of the shared matrix are summed after each step (as Megatron-LM does).

Use (every rank, after `torch.distributed.init_process_group`; full example in the README, "Pipeline parallelism")::

    pipeline = AttnResPipeline(model, micro_batch_size=2, seq_len=128, num_micro_batches=4, virtual_stages=2)
    optimizer = torch.optim.AdamW(pipeline.parameters(), lr=1e-4)
    loss = pipeline.step(input_ids)          # (8, 128) on every rank; the global mean loss on every rank
    optimizer.step(); optimizer.zero_grad()
"""

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, ScheduleInterleaved1F1B

from .._checks import check_int
from ..modeling.backbones import backbone_adapter
from ..modeling.depth_mixing import DEPTH_MIXING
from ..modeling.mixing_base import register_modules, registered_modules

# ---------------------------------------------------------------------------------------------------------------
# The depth state as tensors: the one place that knows the fields of `AttnResState` (mixing_attnres.py)
# ---------------------------------------------------------------------------------------------------------------

SOURCE_FIELDS = {"sources": 2, "inv_rms": 2}
"""What a hand-off carries with one entry per completed source, and their source axis: the sources stacked
`(b, T, n, d)` and their key-norm statistics `(b, T, n)` fp32; kept across stages and sent only once per rank."""
RUNNING_FIELDS = ("partial",)
"""Fields that change inside a block (the partial sum `(b, T, d)`): sent whole at every hand-off."""
POSITION_FIELD = "sublayer"
"""The field holding the index of the next sub-layer: set from the stage's first decoder layer."""
STATE_FIELDS = ("sources", "inv_rms", "partial", "eps", "block_size", "sublayer", "buffer", "stacked", "phase1",
                "keep_weights", "handles", "grads", "constants")
"""The fields of `AttnResState` this module knows how to send and rebuild (see `StateCodec`)."""


class StateCodec:
    """Turns the AttnRes depth state into the tensors a stage sends and back.

    A state leaves a stage as `SOURCE_FIELDS` (its completed sources stacked, and their statistics) and
    `RUNNING_FIELDS`; a stage rebuilds it on the stacked (direct) path of `AttnResState` (`buffer=None`): no
    per-forward source buffer and no two-phase block inference across a hand-off, the same numbers
    (tests/test_two_phase.py). The first stage starts the state as the model does. A change of the state's fields
    is a `TypeError` here, at construction, naming them: update `STATE_FIELDS` and this class.
    """

    def __init__(self, config, state_type: type | None = None):
        self.state_type = state_type or DEPTH_MIXING[config.depth_mixing].state
        self.config = config
        template = self.state_type.start(torch.zeros(1, 1, config.hidden_size), config)
        if tuple(template._fields) != STATE_FIELDS:
            raise TypeError(
                f"{self.state_type.__name__} has fields {template._fields}, the pipeline knows {STATE_FIELDS}: update "
                f"STATE_FIELDS and StateCodec in {__name__}"
            )
        self.constants = {"eps": template.eps, "block_size": template.block_size}

    def start(self, embeddings: torch.Tensor):
        return self.state_type.start(embeddings, self.config)

    def split(self, state) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """`({source field: tensor}, {running field: tensor})` of `state`."""
        if state.partial is None:
            raise RuntimeError("the depth state's 'partial' is None at a stage boundary (a stage ran no sub-layer)")
        stacked = state.stacked if state.stacked is not None else torch.stack(state.sources, dim=-2)
        return {"sources": stacked, "inv_rms": state.inv_rms}, {"partial": state.partial}

    def join(self, sources: dict[str, torch.Tensor], running: dict[str, torch.Tensor], sublayer: int):
        stacked = sources["sources"]
        return self.state_type(sources=tuple(stacked.unbind(-2)), inv_rms=sources["inv_rms"],
                               partial=running["partial"], sublayer=sublayer, buffer=None, stacked=stacked,
                               phase1=None, keep_weights=False, **self.constants)

    def num_sources(self, sources: dict[str, torch.Tensor]) -> int:
        name, axis = next(iter(SOURCE_FIELDS.items()))
        return sources[name].shape[axis]

    def examples(self, batch: int, seq_len: int, num_sources: int, dtype: torch.dtype) -> list[torch.Tensor]:
        """Meta tensors with the shapes and dtypes of a hand-off carrying `num_sources` sources (none: no source
        tensors), in the order the stages send them: source fields, then running fields."""
        hidden = self.config.hidden_size
        tensors = []
        if num_sources:
            tensors += [torch.empty(batch, seq_len, num_sources, hidden, dtype=dtype, device="meta"),
                        torch.empty(batch, seq_len, num_sources, dtype=torch.float32, device="meta")]
        tensors += [torch.empty(batch, seq_len, hidden, dtype=dtype, device="meta") for _ in RUNNING_FIELDS]
        return [t.requires_grad_() for t in tensors]


# ---------------------------------------------------------------------------------------------------------------
# The plan: stages, their layers, the sources each hand-off sends, the bytes
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PipelinePlan:
    """Where each decoder layer runs and what each hand-off sends.

    Attributes:
        num_ranks: `P`, ranks in the pipeline group.
        virtual_stages: `V`, stages per rank (stage `s` runs on rank `s % P`).
        layer_ranges: `(first, end)` decoder layers of each of the `S = P V` stages.
        sources_after: `n_s`, completed sources in the depth state after stage `s` (embedding included).
        cache: whether ranks keep the sources they received (paper §4); False sends the whole state each time.
    """

    num_ranks: int
    virtual_stages: int
    layer_ranges: tuple[tuple[int, int], ...]
    sources_after: tuple[int, ...]
    cache: bool

    @property
    def num_stages(self) -> int:
        return len(self.layer_ranges)

    def kept_sources(self, stage: int) -> int:
        """Sources the rank of `stage` already holds when a micro-batch arrives there: those its previous stage
        `stage - P` produced (0 without caching or on the rank's first visit)."""
        previous = stage - self.num_ranks
        return self.sources_after[previous] if self.cache and previous >= 0 else 0

    def sent_sources(self, stage: int) -> tuple[int, int]:
        """`(first, end)`: the sources stage `stage` sends to stage `stage + 1` (end exclusive)."""
        return self.kept_sources(stage + 1), self.sources_after[stage]

    def bytes_per_micro_batch(self, batch: int, seq_len: int, hidden_size: int, element_size: int) -> int:
        """Bytes the hand-offs of one micro-batch send in one direction (see the module docstring): source tensors in
        the activation dtype (`element_size` bytes), their fp32 key-norm statistics, one partial sum per hand-off."""
        sources = sum(end - first for first, end in map(self.sent_sources, range(self.num_stages - 1)))
        per_token = sources * (hidden_size * element_size + 4) + (self.num_stages - 1) * hidden_size * element_size
        return batch * seq_len * per_token


def plan_pipeline(config, num_ranks: int, virtual_stages: int = 2, cache: bool = True,
                  layers_per_stage: Sequence[int] | None = None) -> PipelinePlan:
    """Split `config.num_hidden_layers` decoder layers into `num_ranks * virtual_stages` stages.

    Args:
        config: an `AttnResConfig` with `depth_mixing="attnres"`.
        num_ranks: ranks in the pipeline (>= 2).
        virtual_stages: stages per rank (>= 2: an interleaved schedule, where caching has something to keep).
        cache: keep received sources on each rank (paper §4).
        layers_per_stage: decoder layers of each stage (sums to `num_hidden_layers`); default: as even as possible,
            earlier stages taking the remainder (the last stage also runs `lm_head`).

    Raises:
        ValueError: another `depth_mixing`, fewer than 2 ranks or virtual stages, fewer layers than stages, or a
            `layers_per_stage` of the wrong length, sum or with an empty stage.
    """
    if config.depth_mixing != "attnres":
        raise ValueError(f"pipeline parallelism with cross-stage caching is for depth_mixing='attnres' (Block or Full "
                         f"AttnRes), got {config.depth_mixing!r}")
    check_int("num_ranks", num_ranks, minimum=2)
    check_int("virtual_stages", virtual_stages, minimum=2)
    num_stages, layers = num_ranks * virtual_stages, config.num_hidden_layers
    if layers_per_stage is None:
        if layers < num_stages:
            raise ValueError(f"{layers} decoder layers cannot fill {num_stages} stages ({num_ranks} ranks x "
                             f"{virtual_stages} virtual stages); use fewer stages")
        base, extra = divmod(layers, num_stages)
        layers_per_stage = [base + (stage < extra) for stage in range(num_stages)]
    layers_per_stage = list(layers_per_stage)
    if len(layers_per_stage) != num_stages or sum(layers_per_stage) != layers or min(layers_per_stage) < 1:
        raise ValueError(f"layers_per_stage must give each of the {num_stages} stages at least one decoder layer and "
                         f"sum to num_hidden_layers={layers}, got {layers_per_stage}")
    ranges, end = [], 0
    for count in layers_per_stage:
        ranges.append((end, end + count))
        end += count
    block = config.attnres_block_size
    sources = tuple(1 + (2 * last - 1) // block for _, last in ranges)
    return PipelinePlan(num_ranks, virtual_stages, tuple(ranges), sources, bool(cache))


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
    rank's later stage left on them (see the module docstring, "Backward")."""

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
    """This rank's part of an interleaved pipeline over an `AttnResForCausalLM` (see the module docstring).

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


# ---------------------------------------------------------------------------------------------------------------
# torchrun entry point: `torchrun --nproc-per-node P -m attnres_hf.training.pipeline_parallel MODEL --data FILE ...`
# ---------------------------------------------------------------------------------------------------------------


def _parser():
    import argparse

    parser = argparse.ArgumentParser(
        prog="torchrun --nproc-per-node P -m attnres_hf.training.pipeline_parallel",
        description="Train an AttnRes checkpoint (all parameters, AdamW) with pipeline parallelism over the torchrun "
                    "processes and the paper's cross-stage caching; rank 0 writes the trained model to --output-dir.")
    parser.add_argument("model", help="AttnRes model folder (with its tokenizer), e.g. the output of `attnres convert`")
    parser.add_argument("--data", nargs="+", required=True,
                        help=".txt/.jsonl/.json/.parquet files (see `attnres train`)")
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--seq-len", type=int, default=512, help="tokens per sequence (packed)")
    parser.add_argument("--micro-batch-size", type=int, default=1)
    parser.add_argument("--micro-batches", type=int, default=4, help="micro-batches per step")
    parser.add_argument("--virtual-stages", type=int, default=2, help="stages per rank (>= 2)")
    parser.add_argument("--no-cache", action="store_true", help="send the full depth state at every hand-off")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--lr", type=float, default=5e-5)
    parser.add_argument("--seed", type=int, default=0)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run under torchrun; returns the exit status. Bad arguments fail before any model loads."""
    import json
    import os
    from pathlib import Path

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .data import packed_lm_dataset

    args = _parser().parse_args(argv)
    for name in ("seq_len", "micro_batch_size", "micro_batches", "steps"):
        check_int(name, getattr(args, name), minimum=2 if name == "seq_len" else 1)
    check_int("virtual_stages", args.virtual_stages, minimum=2)
    if not args.lr > 0:
        raise ValueError(f"--lr must be positive, got {args.lr}")
    if not (Path(args.model) / "config.json").is_file():
        raise FileNotFoundError(f"no model folder (config.json) at {args.model}")
    for path in args.data:
        if not Path(path).is_file():
            raise FileNotFoundError(f"data file not found: {path}")
    if "RANK" not in os.environ:
        raise RuntimeError("run this under torchrun, e.g. torchrun --nproc-per-node 2 -m "
                           "attnres_hf.training.pipeline_parallel MODEL --data FILE --output-dir OUT")

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    try:
        rank, device = dist.get_rank(), torch.device("cpu")
        if cuda:
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
            torch.cuda.set_device(device)
        torch.manual_seed(args.seed)
        tokenizer = AutoTokenizer.from_pretrained(args.model)
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).to(device).train()
        data = packed_lm_dataset(args.data, tokenizer, seq_len=args.seq_len)["train"]
        pipeline = AttnResPipeline(model, micro_batch_size=args.micro_batch_size, seq_len=args.seq_len,
                                   num_micro_batches=args.micro_batches, virtual_stages=args.virtual_stages,
                                   cache=not args.no_cache)
        optimizer = torch.optim.AdamW(pipeline.parameters(), lr=args.lr)
        batch = args.micro_batch_size * args.micro_batches
        order = torch.randperm(len(data), generator=torch.Generator().manual_seed(args.seed)).tolist()
        losses = []
        for step in range(args.steps):
            rows = [order[(step * batch + i) % len(order)] for i in range(batch)]  # the same rows on every rank
            examples = data.select(rows)
            loss = pipeline.step(torch.tensor(examples["input_ids"]), torch.tensor(examples["labels"]))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
            if rank == 0:
                print(json.dumps({"step": step + 1, "loss": round(losses[-1], 6)}), flush=True)

        pipeline.save_pretrained(args.output_dir, tokenizer=tokenizer)
        sent = torch.tensor([pipeline.bytes_sent["forward"], pipeline.bytes_sent["backward"]], dtype=torch.float64,
                            device=device)
        dist.all_reduce(sent)
        if rank == 0:
            (Path(args.output_dir) / "pipeline_summary.json").write_text(json.dumps(
                {"steps": args.steps, "losses": losses, "ranks": dist.get_world_size(),
                 "virtual_stages": args.virtual_stages, "cache": not args.no_cache,
                 "bytes_sent": {"forward": int(sent[0]), "backward": int(sent[1])}}, indent=1))
    finally:
        dist.destroy_process_group()
    return 0


__all__ = ["AttnResPipeline", "AttnResStageModule", "CrossStageCache", "PipelinePlan", "StateCodec", "plan_pipeline"]


if __name__ == "__main__":
    raise SystemExit(main())
