"""AttnRes: a decoder of a transformers backbone family whose residual stream is replaced by Attention Residuals.

Kimi Team, "Attention Residuals", arXiv:2603.15031 (2026). A pre-norm transformer computes
`h_{l+1} = h_l + f_l(Norm(h_l))`. AttnRes instead feeds sub-layer `l` a softmax mix over depth of earlier
*sources* (Eq. 1-4): `h_l = sum_i alpha_{i->l} v_i`, `alpha_{i->l} = softmax_i(w_l . RMSNorm(v_i))`, where `w_l`
is a learned pseudo-query. Block AttnRes (Eq. 6) uses as sources the embedding, the sums of completed blocks of
`S` sub-layers and the running sum of the current block.

The sub-layers, norms, rotary embedding, embedding and cache are the backbone family's own transformers classes,
through its adapter in the sibling `backbones.py` (one record per family: Llama, Mistral, Qwen2/3, SmolLM3, Granite,
Phi-3, Gemma2/3, ...); this file writes only what differs: the depth state between the sub-layers. The depth-mixing
family (`depth_mixing`: residual, AttnRes, DenseFormer, MUDDFormer, DCA, mHC) is in `depth_mixing.py` (one record per
method) and its `mixing_*.py` siblings. The classes follow `modeling_llama.py` in data-flow order; departures carry
an `# AttnRes:` comment. This file travels with checkpoints as remote code: it imports only torch, transformers and
those siblings.
"""

import contextlib
import functools
import inspect
from collections.abc import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from transformers import initialization as init
from transformers.cache_utils import Cache
from transformers.generation import GenerationMixin
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_utils import PreTrainedModel, slice_logits_to_keep
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs, can_return_tuple, logging
from transformers.utils.deprecation import deprecate_kwarg
from transformers.utils.generic import merge_with_config_defaults
from transformers.utils.output_capturing import capture_outputs

from .attnres_reference import naive_attnres
from .backbones import KEY_VALUE_METHODS, backbone_adapter, init_backbone_weights, recorded_outputs
from .backbones_base import KeyValueRouting
from .configuration_attnres import AttnResConfig
from .depth_mixing import DEPTH_MIXING, MIXING_MODULES, modules_to_not_convert, num_depth_mixing_parameters
from .mixing_attnres import AttnResRouter, AttnResState  # (re-exported)
from .mixing_base import AttnResRMSNorm, register_modules, registered_modules
from .torch_internals import recompile_limit_at_least
from .outputs_attnres import (DEPTH_WEIGHTS_OUTPUTS, AttnResCausalLMOutputWithPast, AttnResModelOutputWithPast,
                              AttnResMoeCausalLMOutputWithPast, AttnResMoeModelOutputWithPast)

logger = logging.get_logger(__name__)


class AttnResDecoderLayer(GradientCheckpointingLayer):
    """One attention and one MLP sub-layer (sub-layers `2 i` and `2 i + 1`) of the backbone family, reading their
    inputs from, and writing their outputs to, the depth state of `config.depth_mixing` instead of the residual sum.

    The family's own decoder layer (`adapter.decoder_layer`) is built and its children are adopted under their own
    names (`self_attn`, `mlp`, `input_layernorm`, ...; its `forward`, which holds the residual adds, is not used). The
    method's record builds its mixing modules (`record.layer_modules`), registered under their names (`attn_res`/
    `mlp_res`, `dwa`, ...)."""

    def __init__(self, config: AttnResConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.config = config
        adapter = backbone_adapter(config)
        family_layer = adapter.decoder_layer(config.backbone, layer_idx)
        for name, child in family_layer.named_children():
            self.add_module(name, child)
        for name, param in family_layer.named_parameters(recurse=False):
            self.register_parameter(name, param)
        self._attention, self._mlp = adapter.attention, adapter.mlp
        self._attention_module = adapter.attention.module_name(self)
        self._mlp_module = adapter.mlp.module_name(self)
        # AttnRes: MUDDFormer and DCA feed the attention's key/value projections their own routed inputs.
        self._key_value_routing = None
        if config.depth_mixing in KEY_VALUE_METHODS and adapter.key_value_inputs is not None:
            self._key_value_routing = KeyValueRouting(
                adapter.key_value_inputs, self._modules[self._attention_module], config.backbone
            )
        # AttnRes: the depth-mixing modules of this layer (paper Eq. 1-4, 6 for AttnRes).
        self._mixing_type = DEPTH_MIXING[config.depth_mixing].layer_modules
        register_modules(self, self._mixing_type.build(config, layer_idx))

    recompile_limit: int | None = None  # dynamo's, while this layer runs (`compile_repeated_blocks`); None: its own

    def _dynamo_limits(self):
        """Dynamo's recompile limit at `recompile_limit` for this layer's call (and checkpointed recomputation)."""
        if self.recompile_limit is None or torch.compiler.is_compiling():  # (traced: dynamo skips config.patch)
            return contextlib.nullcontext()
        return recompile_limit_at_least(self.recompile_limit)

    def _finish(self, sublayer, output) -> torch.Tensor:
        """The family's post-processing of a sub-layer output before it joins the stream (post-norms, dropout,
        residual multiplier); a `(hidden, extras...)` tuple (MoE router logits) keeps its hidden states."""
        output = output[0] if isinstance(output, tuple) else output
        for name in sublayer.post:
            output = self._modules[name](output)
        if sublayer.output_multiplier is not None:
            output = output * getattr(self.config, sublayer.output_multiplier)
        return output

    def forward(
        self,
        state,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        use_cache: bool | None = False,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> tuple:
        """Returns the new depth state, this layer's attention (query) input `(batch, seq_len, hidden_size)` (its
        entry in `hidden_states`) and the tuple of depth weights its mixing computed (empty for the residual)."""
        with self._dynamo_limits():
            mixing = registered_modules(self, self._mixing_type)
            # AttnRes: the attention input(s) come from the depth state, not the residual sum.
            attn_read = state.read_attn(mixing)
            norm, attention = self._modules[self._attention.norm], self._modules[self._attention_module]
            if attn_read.key_value is not None:  # MUDDFormer, DCA: one pre-norm per sub-layer, on each routed stream
                key_input, value_input = (norm(x) for x in attn_read.key_value)
                self._key_value_routing.route(attention, key_input, value_input)
            hidden_states = attention(
                hidden_states=attn_read.normed(norm),
                attention_mask=attention_mask,
                position_ids=position_ids,
                cache=cache,
                use_cache=use_cache,
                position_embeddings=position_embeddings,
                **kwargs,
            )
            if attn_read.key_value is not None:
                self._key_value_routing.clear()
            attn_write = attn_read.state.write_attn(mixing, self._finish(self._attention, hidden_states))

            mlp_read = attn_write.state.read_mlp(mixing)
            hidden_states = self._modules[self._mlp_module](mlp_read.normed(self._modules[self._mlp.norm]))
            mlp_write = mlp_read.state.write_mlp(mixing, self._finish(self._mlp, hidden_states))
            weights = (*attn_read.depth_weights, *attn_write.depth_weights, *mlp_read.depth_weights,
                       *mlp_write.depth_weights)
            return mlp_write.state, attn_read.hidden, weights


def non_reentrant_checkpoint(checkpoint_func: Callable) -> Callable:
    """`checkpoint_func` (`torch.utils.checkpoint.checkpoint`, or transformers' `functools.partial` of it with the
    `activation_checkpointing_kwargs`, or of its offloading wrapper) calling torch's checkpoint with
    `use_reentrant=False`, its other keywords kept.

    A decoder layer passes its depth state as a NamedTuple of tensors, which reentrant checkpointing does not see: it
    cuts the gradient at every layer, so most parameters get none (and Delta AttnRes's backward fails). torch runs the
    reentrant variant when `use_reentrant` is absent, which is what `{}`, `{"preserve_rng_state": True}` and PEFT's
    kbit preparation ask for: those silently become non-reentrant. An explicit `use_reentrant=True` becomes
    `use_reentrant=False` with a one-line warning. A function that takes no `use_reentrant` keyword (neither by
    name nor through `**kwargs`) is not torch's checkpoint and is returned unchanged.
    """
    func, args, keywords = checkpoint_func, (), {}
    if isinstance(checkpoint_func, functools.partial):
        func, args, keywords = checkpoint_func.func, checkpoint_func.args, checkpoint_func.keywords
    if keywords.get("use_reentrant") is False or not _takes_keyword(func, "use_reentrant"):
        return checkpoint_func
    if keywords.get("use_reentrant"):
        logger.warning_once(
            "AttnRes needs non-reentrant activation checkpointing (use_reentrant=True cannot follow the depth state "
            "between layers); using use_reentrant=False."
        )
    return functools.partial(func, *args, **{**keywords, "use_reentrant": False})


def _takes_keyword(func: Callable, name: str) -> bool:
    try:
        parameters = inspect.signature(func).parameters.values()
    except (TypeError, ValueError):  # no signature to read (a builtin): assume it forwards keywords to torch
        return True
    return any(p.name == name or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


class AttnResPreTrainedModel(PreTrainedModel):
    config: AttnResConfig
    config_class = AttnResConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["AttnResDecoderLayer"]
    _supports_flash_attn = True
    _supports_sdpa = True
    _supports_flex_attn = True
    _supports_attention_backend = True
    # AttnRes: every depth_mixing traces as one graph (tests/test_compile.py); `__init__` narrows this to what the
    # backbone family's own model declares.
    _can_compile_fullgraph = True
    # AttnRes: transformers keys this table by model class, and one class serves every backbone family: each entry
    # lists every family's recorder (attention weights; MoE router logits).
    _can_record_outputs = recorded_outputs()

    def __init__(self, config: AttnResConfig, *args, **kwargs):
        config.validate_architecture()  # also after `from_pretrained(..., attnres_block_size=...)` or a setattr
        # AttnRes: the attention implementations the backbone family supports (Gemma2: no sdpa, which cannot
        # soft-cap), checked by transformers on the instance when it picks the implementation.
        family = backbone_adapter(config).pretrained_model
        for flag in ("_supports_sdpa", "_supports_flash_attn", "_supports_flex_attn", "_supports_attention_backend",
                     "_can_compile_fullgraph"):
            if not getattr(family, flag, False):
                setattr(self, flag, False)
        super().__init__(config, *args, **kwargs)
        # AttnRes: the backbone's modules read their attention / experts implementation from the backbone config,
        # which no sub-model checks (transformers sets the checked value on the top-level config only here).
        config.backbone._attn_implementation_internal = config._attn_implementation_internal
        config.backbone._experts_implementation_internal = config._experts_implementation_internal
        # AttnRes: a family with recurrent state (Kimi Linear's KDA) cannot rewind its cache (no assisted decoding).
        self._is_stateful = backbone_adapter(config).pretrained_model._is_stateful
        if self.can_generate():
            self.generation_config = self._generation_config_from_model_config()

    def compile_repeated_blocks(self, **compile_kwargs) -> None:
        """Regional compilation (torch's recipe, "Reducing torch.compile cold start compilation time with regional
        compilation"; diffusers' `compile_repeated_blocks`): compile, in place (`nn.Module.compile`), each decoder
        layer's backbone modules (its attention and MLP sub-layers and their norms, whatever the family names them),
        and leave the depth mixing eager.

        The backbone's modules run the same code on the same shapes in every layer, so torch compiles each kind once
        and reuses it for the others, while the depth mixing's routers see another number of sources in every layer
        (Eq. 6), which a whole-model graph unrolls into one long graph (the compile times of
        `benchmarks/overhead.py`). Eager, the depth mixing keeps its in-place source-gradient sums and uses the
        fused kernels of `attnres_implementation`. Embeddings, the final norm and the LM head stay eager.

        For training and prefill. With a KV cache the attention compiles once per layer (its cache index,
        `layer_idx`, is a constant to torch): train with `use_cache=False` (gradient checkpointing turns the cache
        off too), and for decoding compile the whole model with a static cache. So that a cached forward still
        runs compiled, each decoder layer raises dynamo's recompile limit to 8 x layers while it runs (a cached
        configuration compiles the attention per layer; `AttnResDecoderLayer.recompile_limit`), nowhere else.

        Args:
            **compile_kwargs: `torch.compile`'s (`backend`, `mode`, `dynamic`, `fullgraph`, `options`).
        """
        layers = self.base_model.layers
        for layer in layers:
            layer.recompile_limit = 8 * len(layers)
            mixing = set(layer._mixing_type._fields)
            for name, child in layer.named_children():
                if name not in mixing:
                    child.compile(**compile_kwargs)

    def _generation_config_from_model_config(self):
        """The generation config transformers derives from the model config (`GenerationConfig.from_model_config`),
        with what the backbone config says: its special token ids (`eos_token_id`, `bos_token_id`, `pad_token_id`)
        and any other generation value it holds, as the equal backbone-family model (`LlamaForCausalLM`) gets them."""
        # AttnRes: those ids live in `config.backbone` only, and `from_model_config` reads a composite config's decoder
        # from its `text_config` entry (`get_text_config` knows no `backbone`): without it, `generate`, `pipeline`,
        # `Trainer`'s token alignment and `transformers serve` saw no EOS and generated past it.
        model_config = {**self.config.to_dict(), "text_config": self.config.backbone.to_dict()}
        return self.generation_config_class.from_model_config(model_config)

    @classmethod
    def _can_set_experts_implementation(cls) -> bool:
        # AttnRes: a mixture-of-experts backbone's experts are the family's own `@use_experts_implementation` modules,
        # so they take transformers' experts implementations (`grouped_mm` by default, as in the source model);
        # transformers looks for that decorator in the model class's file, which here is not the family's.
        return True

    def _set_gradient_checkpointing(
        self, enable: bool = True, gradient_checkpointing_func: Callable = checkpoint, every_n_layers: int = 1
    ):
        # AttnRes: every way to turn checkpointing on (`activation_checkpointing_enable`, its deprecated alias
        # `gradient_checkpointing_enable`, with any kwargs; `TrainingArguments(gradient_checkpointing=True)`; PEFT's
        # `prepare_model_for_kbit_training`) lands here with its checkpoint function: made non-reentrant here.
        if enable:
            gradient_checkpointing_func = non_reentrant_checkpoint(gradient_checkpointing_func)
        super()._set_gradient_checkpointing(enable, gradient_checkpointing_func, every_n_layers)

    def save_pretrained(self, save_directory, *args, **kwargs):
        if self._auto_class is not None:
            # AttnRes: name both heads in `auto_map`, so `AutoModel` and `AutoModelForCausalLM` both load the folder
            # with `trust_remote_code=True` (transformers only writes the saved class's own entry).
            self.config.auto_map = {
                **(getattr(self.config, "auto_map", None) or {}),
                "AutoModel": "modeling_attnres.AttnResModel",
                "AutoModelForCausalLM": "modeling_attnres.AttnResForCausalLM",
            }
        return super().save_pretrained(save_directory, *args, **kwargs)

    def num_depth_mixing_parameters(self) -> int:
        """Number of depth-mixing parameters this model holds (AttnRes: router queries, key norms, `query_proj` or
        scalar logits; the family: DWAs, MUDD connections, GRN-v3s, hyper-connections), counted on the modules."""
        return num_depth_mixing_parameters(self)

    @torch.no_grad()
    def _init_weights(self, module):
        # AttnRes: every mixing module starts as the residual model (AttnRes: zero pseudo-queries, uniform depth
        # weights at step 0, which the paper requires; see each module's `reset_parameters`); its norms are its own.
        if isinstance(module, MIXING_MODULES):
            # AttnRes: in fp32 however the tensor was made. transformers' `dtype_plan` (`_keep_in_fp32_modules_strict`)
            # casts loaded tensors only; one missing from the checkpoint (a Llama folder loaded into this class) or
            # built under `dtype=bfloat16` (`from_config`, a bf16 default dtype) is created in that dtype and lands
            # here. `float()` keeps each Parameter object (and its `_is_hf_initialized` flag) and copies loaded values.
            module.float()
            module.reset_parameters(self.config.initializer_range)
        elif isinstance(module, AttnResRMSNorm):
            # AttnRes: a router's key norm, fp32 too; transformers inits it on its own when only its weight is missing
            # (the router holding a loaded query counts as initialised), which left uninitialised memory.
            init.ones_(module.float().weight)
        else:  # the backbone's modules: as the family initialises them
            init_backbone_weights(backbone_adapter(self.config), self.config.backbone, module)


class AttnResModel(AttnResPreTrainedModel):
    def __init__(self, config: AttnResConfig):
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        adapter = backbone_adapter(config)
        self.embed_tokens = adapter.embedding(config.backbone)
        self.layers = nn.ModuleList(
            [AttnResDecoderLayer(config, layer_idx) for layer_idx in range(config.num_hidden_layers)]
        )
        # AttnRes: the method's final mixing (AttnRes: `final_res`, DCA: `final_dca`) builds the last norm's input.
        self._mixing_type = DEPTH_MIXING[config.depth_mixing].final_modules
        register_modules(self, self._mixing_type.build(config))
        self.norm = adapter.norm(config.hidden_size, eps=config.rms_norm_eps)
        if adapter.rotary is not None:
            self.rotary_emb = adapter.rotary(config=config.backbone)
        self.gradient_checkpointing = False
        # AttnRes: every depth-mixing module keeps fp32 under any `dtype` and is never quantized (bitsandbytes and
        # torchao skip what `_keep_in_fp32_modules` names), so routing is computed at full precision.
        mixing = set(modules_to_not_convert(config))  # the method record's module names
        self._keep_in_fp32_modules = self._keep_in_fp32_modules_strict = mixing
        self.post_init()

    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    @merge_with_config_defaults
    @capture_outputs
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        output_hidden_states: bool | None = None,
        output_depth_weights: bool | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> AttnResModelOutputWithPast | AttnResMoeModelOutputWithPast:
        r"""
        Returns the family's output (`adapter.model_output`: `BaseModelOutputWithPast`, or `MoeModelOutputWithPast`
        with `router_logits`) plus `depth_weights`; its tuple form is the family's, then `depth_weights`.

        Args:
            input_ids (`torch.LongTensor` of shape `(batch, seq_len)`): the tokens; exactly one of `input_ids` and
                `inputs_embeds`.
            inputs_embeds (`torch.FloatTensor` of shape `(batch, seq_len, hidden_size)`): embeddings instead of tokens.
            cache (`Cache`): the KV cache (`past_key_values` is accepted as its former name). AttnRes needs no
                cache of its own: depth routing is per token.
            output_hidden_states (`bool`): return the embeddings, each layer's routed input and the final normed
                state (`num_hidden_layers + 1` tensors; for `depth_mixing="residual"` this is the backbone family's tuple).
            output_depth_weights (`bool`): return `depth_weights` (see `outputs_attnres.py`; AttnRes:
                one `(batch, seq_len, n_sources)` fp32 tensor per router, rows summing to 1 with softmax).

        Raises:
            ValueError: if both or neither of `input_ids` and `inputs_embeds` are given.
        """
        if (input_ids is None) ^ (inputs_embeds is not None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        output_hidden_states = output_hidden_states if output_hidden_states is not None else self.config.output_hidden_states
        adapter = backbone_adapter(self.config)
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        if adapter.embedding_multiplier is not None:  # Granite: part of the embedding source
            inputs_embeds = inputs_embeds * getattr(self.config, adapter.embedding_multiplier)
        if use_cache and cache is None:
            cache = adapter.make_cache(self.config)
        if position_ids is None:
            past_seen_tokens = cache.get_seq_length() if cache is not None else 0
            position_ids = torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + past_seen_tokens
            position_ids = position_ids.unsqueeze(0)

        layer_types = adapter.layer_types(self.config)
        if not isinstance(mask_mapping := attention_mask, dict):
            mask_mapping = adapter.attention_masks(
                self.config, layer_types, inputs_embeds=inputs_embeds, attention_mask=attention_mask, cache=cache,
                position_ids=position_ids,
            )
        position_embeddings = adapter.position_embeddings(
            getattr(self, "rotary_emb", None), inputs_embeds, position_ids, layer_types
        )
        state = DEPTH_MIXING[self.config.depth_mixing].state.start(
            inputs_embeds, self.config, bool(output_depth_weights), model=self
        )
        hidden_states, depth_weights = [], []
        for decoder_layer in self.layers[: self.config.num_hidden_layers]:
            layer_type = layer_types[decoder_layer.layer_idx]
            state, layer_input, layer_depth_weights = decoder_layer(
                state,
                attention_mask=mask_mapping[layer_type],
                position_embeddings=position_embeddings[layer_type],
                position_ids=position_ids,
                cache=cache,
                use_cache=use_cache,
                **kwargs,
            )
            hidden_states.append(layer_input.contiguous() if output_hidden_states else layer_input)  # (a read: a view)
            depth_weights += layer_depth_weights

        final = state.read_final(registered_modules(self, self._mixing_type))
        last_hidden_state = final.normed(self.norm)
        depth_weights += final.depth_weights
        # AttnRes: the family's output class (MoE: `MoeModelOutputWithPast`) plus `depth_weights`, tuple order included
        return DEPTH_WEIGHTS_OUTPUTS[adapter.model_output](
            last_hidden_state=last_hidden_state,
            cache=cache,
            hidden_states=(*hidden_states, last_hidden_state) if output_hidden_states else None,
            depth_weights=tuple(depth_weights) if output_depth_weights and depth_weights else None,
        )


class AttnResForCausalLM(AttnResPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    _tp_plan = {"lm_head": "colwise_gather_output"}
    _pp_plan = {"lm_head": (["hidden_states"], ["logits"])}

    def __init__(self, config: AttnResConfig):
        super().__init__(config)
        self.model = AttnResModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def adjust_generation_fn(self, *args, **kwargs):
        super().adjust_generation_fn(*args, **kwargs)
        # AttnRes: a generation config transformers derived from a folder's config (no generation_config.json: it
        # reads config.json's top level, without the backbone), or one saved so before the backbone's ids were read,
        # gets the values it lacks from the model config, as `__init__` derives them. One a person wrote is kept.
        if self.generation_config is not None and self.generation_config._from_model_config:
            derived = self._generation_config_from_model_config().to_diff_dict()
            derived.pop("transformers_version", None)
            self.generation_config.update(**derived, defaults_only=True)

    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs: Unpack[TransformersKwargs],
    ) -> AttnResCausalLMOutputWithPast | AttnResMoeCausalLMOutputWithPast:
        r"""
        Causal LM forward: arguments as `AttnResModel.forward`, plus `labels` (`(batch, seq_len)`, -100 ignored;
        shifted inside the loss) and `logits_to_keep` (keep the logits of the last N positions, or of the given
        indices). Returns `logits` of shape `(batch, seq_len, vocab_size)` in the model dtype, in the family's output
        class (`CausalLMOutputWithPast`, or `MoeCausalLMOutputWithPast` with `aux_loss` and `router_logits`) plus
        `depth_weights`; its tuple form is the family's, position by position, then `depth_weights`.
        """
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            **kwargs,
        )
        hidden_states = outputs.last_hidden_state
        logits = self.lm_head(slice_logits_to_keep(hidden_states, logits_to_keep))
        adapter = backbone_adapter(self.config)
        if adapter.logits is not None:  # the family's head: Gemma's soft-capping, Granite's logits_scaling
            logits = adapter.logits(self.config.backbone, logits)
        loss = aux_loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        router_logits = outputs.get("router_logits")  # a MoE family's, with `output_router_logits`
        if adapter.aux_loss is not None and router_logits is not None:  # MoE load balancing, as the family
            aux_loss = adapter.aux_loss(self.config.backbone, router_logits, attention_mask)
            if loss is not None:
                loss = loss + self.config.router_aux_loss_coef * aux_loss.to(loss.device)
        # AttnRes: the family's output class (MoE: `MoeCausalLMOutputWithPast`) plus `depth_weights`
        output_class = DEPTH_WEIGHTS_OUTPUTS[adapter.causal_lm_output]
        moe = ({"aux_loss": aux_loss, "router_logits": router_logits}
               if "router_logits" in output_class.__dataclass_fields__ else {})
        return output_class(
            loss=loss,
            logits=logits,
            cache=outputs.cache,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
            depth_weights=outputs.depth_weights,
            **moe,
        )


__all__ = [
    "AttnResForCausalLM",
    "AttnResModel",
    "AttnResPreTrainedModel",
    "AttnResRouter",
    "AttnResState",
    "naive_attnres",
]
