"""Reading the depth routing: maps equal the model's own weights; compare detects shifts; dynamics record."""

import json

import numpy as np
import pytest
import torch

from attnres_hf import AttnResConfig, AttnResForCausalLM
from attnres_hf.analysis import (aligned_suffix, compare_pairs, layer_magnitudes, record_routing, routing_maps,
                                 source_columns, source_names, summarize)
from attnres_hf.analysis.plots import plot_average_routing, plot_token_routing
from attnres_hf.cli import main
from attnres_hf.modeling.depth_mixing import DEPTH_MIXING
from utils import VARIANTS, tiny_model, variant_model, word_tokenizer


def sublayer_outputs(model, input_ids) -> list[torch.Tensor]:
    """The raw output of every sub-layer (attention, MLP, ...) in depth order, read with hooks: the Eq. 6 values."""
    outputs = []
    hooks = [m.register_forward_hook(lambda mod, a, o: outputs.append(o[0] if isinstance(o, tuple) else o))
             for layer in model.model.layers for m in (layer.self_attn, layer.mlp)]
    with torch.no_grad():
        model(input_ids)
    for hook in hooks:
        hook.remove()
    return outputs


@pytest.mark.parametrize("block_size, layers", [(1, 3), (2, 3), (4, 5)], ids=["full-3", "block2-3", "block4-5"])
def test_recorded_weights_and_contributions_equal_the_models_own(block_size, layers, input_ids, tmp_path):
    model = tiny_model(attnres_block_size=block_size, num_hidden_layers=layers)  # hand-set (random) queries
    record = record_routing(model, input_ids[0])
    with torch.no_grad():
        out = model(input_ids[:1], output_depth_weights=True)
    assert len(record.routers) == len(out.depth_weights) == 2 * layers + 1
    for r, alpha in enumerate(out.depth_weights):
        columns = source_columns(model.config, r)
        assert np.array_equal(record.weights[r][:, columns], alpha[0].double().numpy())
        others = [c for c in range(len(record.sources)) if c not in columns]
        assert np.isnan(record.weights[r][:, others]).all()

    # the contribution map, by hand: alpha_i * ||v_i|| with v_i from hooks on the sub-layers (Eq. 6 sources)
    outputs = sublayer_outputs(model, input_ids[:1])
    embedding = model.model.embed_tokens(input_ids[:1]).detach()
    for r in range(len(record.routers)):
        done = r // block_size
        sources = [embedding] + [sum(outputs[b * block_size:(b + 1) * block_size]) for b in range(done)]
        if r % block_size:
            sources.append(sum(outputs[done * block_size:r]))
        norms = torch.stack([s[0].norm(dim=-1) for s in sources], -1).double().numpy()
        expected = out.depth_weights[r][0].double().numpy() * norms
        np.testing.assert_allclose(record.contributions[r][:, source_columns(model.config, r)], expected, rtol=1e-5)

    plot_average_routing(record, tmp_path / "avg.png")
    plot_token_routing(record, tmp_path / "tok.png", 2, 5)
    assert (tmp_path / "avg.png").stat().st_size > 10_000 and (tmp_path / "tok.png").stat().st_size > 10_000


def test_source_names_label_blocks_with_their_sublayer_ranges():
    config = tiny_model(attnres_block_size=4, num_hidden_layers=5, routers=False).config
    assert source_names(config) == ["embedding", "block 1 [0.attn-1.mlp]", "block 2 [2.attn-3.mlp]", "block 3 [4.attn-4.mlp]"]
    full = tiny_model(attnres_block_size=1, num_hidden_layers=2, routers=False).config
    assert source_names(full) == ["embedding", "0.attn", "0.mlp", "1.attn", "1.mlp"]


def test_summary_of_uniform_routing(input_ids):
    summary = summarize(record_routing(tiny_model(attnres_block_size=2, routers=False), input_ids[0]))
    rows = {row["router"]: row for row in summary["routers"]}
    assert summary["mean_entropy_ratio"] == pytest.approx(1.0)
    final = rows["final"]  # embedding and blocks 1-3 (6 sub-layers, all blocks complete): uniform over 4
    assert final["n_sources"] == 4 and final["embedding_mass"] == pytest.approx(0.25)
    assert final["recent_mass"] == pytest.approx(0.25) and final["long_jump_mass"] == pytest.approx(0.5)
    mlp = rows["L2 mlp"]  # embedding, blocks 1-2, partial block 3: long jumps = block 1 only
    assert mlp["n_sources"] == 4 and mlp["long_jump_mass"] == pytest.approx(0.25)
    assert rows["L2 attn"]["long_jump_mass"] == pytest.approx(1 / 3)  # embedding, block 1, block 2
    assert all(not row["sinks"] for row in summary["routers"])


def test_compare_reports_zero_for_identical_inputs_and_detects_a_change():
    model = tiny_model(attnres_block_size=2)
    tokenizer = word_tokenizer()
    text = " ".join(f"w{i}" for i in range(10, 30))
    same = compare_pairs(model, tokenizer, [{"a": text, "b": text}] * 3, bootstrap=200)
    assert same["max_abs_shift"] == 0.0
    changed = [{"a": f"w{k} " + text, "b": f"w{k + 40} " + text} for k in range(5, 11)]
    result = compare_pairs(model, tokenizer, changed, bootstrap=500)
    assert result["aligned_tokens"] == [20] * 6  # everything after the first token aligns
    assert result["max_abs_shift"] > 1e-3
    # the reported shift is exactly b - a of the model's own weights over the aligned positions
    ids_a = tokenizer(changed[0]["a"], return_tensors="pt").input_ids
    ids_b = tokenizer(changed[0]["b"], return_tensors="pt").input_ids
    with torch.no_grad():
        wa = model(ids_a, output_depth_weights=True).depth_weights[-1][0, -20:].mean(0)
        wb = model(ids_b, output_depth_weights=True).depth_weights[-1][0, -20:].mean(0)
    single = compare_pairs(model, tokenizer, changed[:1], bootstrap=10)
    np.testing.assert_allclose(single["shift"][-1], (wb - wa).double().numpy(), atol=1e-7)
    significant = (result["low"] > 0) | (result["high"] < 0)
    assert significant.any()
    # values="contributions": the same shift of alpha * ||v||, RoutingRecord.contributions over the aligned positions
    record_a, record_b = (record_routing(model, ids[0], tokenizer) for ids in (ids_a, ids_b))
    expected = record_b.contributions[:, -20:].mean(1) - record_a.contributions[:, -20:].mean(1)
    contributions = compare_pairs(model, tokenizer, changed[:1], bootstrap=10, values="contributions")
    np.testing.assert_allclose(contributions["shift"], expected, atol=1e-9)
    assert not np.allclose(np.nan_to_num(contributions["shift"]), np.nan_to_num(single["shift"]))
    with pytest.raises(ValueError, match="values must be one of"):
        compare_pairs(model, tokenizer, changed, values="norms")


def test_aligned_suffix():
    assert aligned_suffix([1, 2, 3, 4], [1, 9, 3, 4]) == 2
    assert aligned_suffix([1, 2, 3], [1, 2, 3]) == 2
    assert aligned_suffix([1, 2, 3], [1, 2, 3, 5]) == 0
    assert aligned_suffix([5, 6, 7], [8, 6, 7]) == 2


def test_layer_magnitudes_shapes_and_baseline_stream_growth(input_ids):
    hidden, output = layer_magnitudes(tiny_model(depth_mixing="residual"), input_ids)
    assert len(hidden) == len(output) == 3 and all(v > 0 for v in hidden + output)
    with torch.no_grad():  # the baseline stream before the final norm is the residual sum, growing with depth here
        states = tiny_model(depth_mixing="residual").model(input_ids, output_hidden_states=True).hidden_states
    assert hidden[:2] == pytest.approx([float(h.pow(2).mean().sqrt()) for h in states[1:3]])


def test_routing_cli_writes_figures_arrays_and_summary(tmp_path, capsys):
    model = tiny_model(attnres_block_size=2)
    model.save_pretrained(tmp_path / "m")
    word_tokenizer().save_pretrained(tmp_path / "m")
    text = " ".join(f"w{i}" for i in range(10, 40))
    assert main(["routing", str(tmp_path / "m"), "--text", text, "--span", "3:6", "--output-dir", str(tmp_path / "o")]) == 0
    names = {p.name for p in (tmp_path / "o").iterdir()}
    assert names == {"routing_average.png", "routing_tokens.png", "routing.npz", "summary.json"}
    saved = np.load(tmp_path / "o" / "routing.npz")
    with torch.no_grad():
        ids = word_tokenizer()(text, return_tensors="pt").input_ids
        first = model(ids, output_depth_weights=True).depth_weights[1][0].double().numpy()
    assert np.array_equal(saved["weights"][1][:, :2], first)
    assert "final" in capsys.readouterr().out
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps({"a": "w5 " + text, "b": "w50 " + text}) + "\n")
    assert main(["routing", "compare", str(tmp_path / "m"), "--pairs", str(pairs), "--output-dir", str(tmp_path / "c")]) == 0
    assert (tmp_path / "c" / "shift.png").exists() and (tmp_path / "c" / "compare.json").exists()
    assert main(["routing", str(tmp_path / "m"), "--data", str(tmp_path / "missing.txt")]) == 2


def test_dynamics_trains_baseline_and_attnres_and_records_every_layer(tmp_path):
    from attnres_hf.analysis import run_dynamics
    from utils import counting_text

    (tmp_path / "text.txt").write_text(counting_text(lines=200))
    histories = run_dynamics([tmp_path / "text.txt"], word_tokenizer(), tmp_path / "out", steps=12, num_hidden_layers=4,
                             hidden_size=32, seq_len=32, batch_size=4, every=4)
    assert set(histories) == {"baseline (residual)", "Block AttnRes"}
    for history in histories.values():
        assert history["steps"] == [1, 4, 8, 12]
        for key in ("hidden_rms", "output_rms", "grad_norm"):
            assert len(history[key]) == 4 and all(len(row) == 4 and all(v > 0 for v in row) for row in history[key])
    assert (tmp_path / "out" / "dynamics.png").stat().st_size > 10_000
    assert json.loads((tmp_path / "out" / "dynamics.json").read_text()).keys() == histories.keys()


def test_dynamics_cli(tmp_path, capsys):
    from utils import counting_text

    word_tokenizer().save_pretrained(tmp_path / "tok")
    (tmp_path / "text.txt").write_text(counting_text(lines=100))
    assert main(["routing", "dynamics", "--data", str(tmp_path / "text.txt"), "--tokenizer", str(tmp_path / "tok"),
                 "--steps", "4", "--layers", "2", "--hidden-size", "32", "--seq-len", "32", "--every", "2",
                 "--output-dir", str(tmp_path / "dyn")]) == 0
    out = capsys.readouterr().out
    assert "baseline (residual): last logged train loss" in out and "Block AttnRes: last logged train loss" in out
    assert (tmp_path / "dyn" / "dynamics.png").exists()


ROUTED = {name: overrides for name, overrides in VARIANTS.items() if DEPTH_MIXING[overrides.get("depth_mixing", "attnres")].routing_maps}


@pytest.mark.parametrize("overrides", [{}, {"attnres_window": 2}, {"attnres_num_heads": 2}], ids=["plain", "window2", "heads2"])
def test_the_issue_snippet_records_routing(overrides):
    config = AttnResConfig(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=4,
                           num_attention_heads=2, attnres_block_size=2, **overrides)
    record = record_routing(AttnResForCausalLM(config).eval(), torch.arange(6))
    assert record.weights.shape == (9 * config.attnres_num_heads, 6, 5)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(ROUTED))
def test_routing_maps_hold_every_depth_weight_of_every_method_and_knob(name, input_ids, tmp_path):
    """Each row of the record is one row of one depth-weight tensor the model returned, at the source columns the
    record names (never averaged over heads or streams), with the value norms of exactly those sources."""
    model = variant_model(VARIANTS[name], num_hidden_layers=4)
    record = record_routing(model, input_ids[0])
    with torch.no_grad():
        out = model(input_ids[:1], output_depth_weights=True)
    maps = routing_maps(model.config)
    assert len(maps) == len(out.depth_weights) and record.sources == source_names(model.config)
    row = 0
    for routing_map, weights in zip(maps, out.depth_weights):
        if weights.dim() == 5:  # DCA: (B, T, C, n, D) per feature; the map shows the mean over features
            weights = weights.mean(-1)
        rows = weights[0] if weights.dim() == 4 else weights[0].unsqueeze(-2)  # (T, rows, n)
        assert rows.shape[1:] == (len(routing_map.rows), len(routing_map.columns))
        for k in range(len(routing_map.rows)):
            assert np.array_equal(record.weights[row][:, routing_map.columns], rows[:, k].detach().double().numpy())
            assert np.isnan(np.delete(record.weights[row], routing_map.columns, axis=1)).all()
            row += 1
    assert row == len(record.routers) == record.weights.shape[0] == len(set(record.routers))
    summary = summarize(record)
    assert len(summary["routers"]) == row
    plot_average_routing(record, tmp_path / "avg.png")
    plot_token_routing(record, tmp_path / "tok.png", 1, 4)
    assert (tmp_path / "avg.png").stat().st_size > 10_000


def test_windowed_and_per_head_maps_show_what_the_router_computes(input_ids):
    """Full AttnRes, window 1, two heads: each router reads the embedding and the latest sub-layer output only; each
    head has its own row; the value norms are those of the sources the router really mixes."""
    model = variant_model({"attnres_block_size": 1, "attnres_window": 1, "attnres_num_heads": 2})
    record = record_routing(model, input_ids[0])
    values = [model.model.embed_tokens(input_ids[:1]).detach()] + sublayer_outputs(model, input_ids[:1])  # column c = source c (Full AttnRes)
    for r in range(len(record.routers)):
        sublayer = r // 2
        expected_columns = [0] if sublayer == 0 else [0, sublayer]
        assert np.flatnonzero(~np.isnan(record.weights[r][0])).tolist() == expected_columns
        norms = torch.stack([values[c][0].norm(dim=-1) for c in expected_columns], -1).double().numpy()
        np.testing.assert_allclose(record.value_norms[r][:, expected_columns], norms, rtol=1e-5)
    assert record.routers[:2] == ["L0 attn h0", "L0 attn h1"]
    heads = record.weights[2::2], record.weights[3::2]  # rows of head 0 and head 1 from sub-layer 1 on
    assert np.nanmax(np.abs(heads[0] - heads[1])) > 1e-3  # not one averaged map


def test_routing_refuses_a_method_without_depth_weights(input_ids):
    with pytest.raises(ValueError, match="depth_mixing='residual'"):
        record_routing(tiny_model(depth_mixing="residual"), input_ids[0])


@pytest.mark.parametrize("model_is_none, ids, message", [
    (False, torch.tensor([5, 99]), r"token ids in \[0, 98\]"),
    (False, torch.tensor([-1, 5]), r"token ids in \[0, 98\]"),
    (False, torch.tensor([1.0, 2.0]), "integer token ids, got dtype torch.float32"),
    (True, torch.tensor([1, 2]), "takes an AttnResForCausalLM model, got NoneType"),
])
def test_record_routing_names_a_bad_model_or_bad_ids(model_is_none, ids, message):
    """Not an IndexError/RuntimeError from inside the embedding, nor an AttributeError on `None.config`."""
    from attnres_hf.analysis import record_routing

    with pytest.raises(ValueError, match=message):
        record_routing(None if model_is_none else tiny_model().eval(), ids)
