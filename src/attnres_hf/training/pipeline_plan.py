"""The depth state of Block AttnRes as the tensors a pipeline stage sends (`StateCodec`), and the plan of the stages:
which decoder layers each runs and which completed sources each hand-off sends (`PipelinePlan`, `plan_pipeline`).

Part of the pipeline-parallel training in `pipeline_parallel.py`, whose docstring states the design (the split, what
crosses a stage boundary, the paper's cross-stage caching and the bytes it saves).
"""

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .._checks import check_int
from ..modeling.depth_mixing import DEPTH_MIXING
from ..modeling.ops_torch import key_norm_statistics

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
                "keep_weights", "handles", "grads", "constants", "implementation", "merged")
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
        # (`implementation`: the direct reads' kernel; a rebuilt state takes the stacked path, where it plays no part)
        self.constants = {"eps": template.eps, "block_size": template.block_size,
                          "implementation": template.implementation}

    def start(self, embeddings: torch.Tensor):
        return self.state_type.start(embeddings, self.config)

    def split(self, state) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """`({source field: tensor}, {running field: tensor})` of `state`."""
        if state.partial is None:
            raise RuntimeError("the depth state's 'partial' is None at a stage boundary (a stage ran no sub-layer)")
        stacked = state.stacked if state.stacked is not None else torch.stack(state.sources, dim=-2)
        # (Full AttnRes's torch training keeps the statistics in its buffer's accumulator, not in `inv_rms`)
        inv_rms = state.inv_rms if state.inv_rms is not None else key_norm_statistics(state.source_buffer(), state.eps)
        return {"sources": stacked, "inv_rms": inv_rms}, {"partial": state.partial}

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
        """Bytes the hand-offs of one micro-batch send in one direction (see `pipeline_parallel`'s docstring): source
        tensors in the activation dtype (`element_size` bytes), their fp32 key-norm statistics, one partial sum per
        hand-off."""
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



__all__ = ["POSITION_FIELD", "RUNNING_FIELDS", "SOURCE_FIELDS", "STATE_FIELDS", "PipelinePlan", "StateCodec",
           "plan_pipeline"]
