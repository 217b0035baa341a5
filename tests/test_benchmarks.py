"""The ablation benchmark's own logic: paired variants start from one backbone, and its statistics."""

import importlib.util
import math
from pathlib import Path

import pytest
import torch

ABLATION = Path(__file__).parents[1] / "benchmarks" / "ablation.py"


@pytest.fixture(scope="module")
def ablation():
    spec = importlib.util.spec_from_file_location("ablation_benchmark", ABLATION)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("variant", ["Full AttnRes", "mHC (n=4)", "MUDDFormer", "AttnRes input-dependent query"])
def test_every_variant_of_a_seed_starts_from_the_baselines_backbone(ablation, variant):
    preset = ablation.PRESETS["smoke"]
    baseline = ablation.build_model(preset, ablation.VARIANTS["baseline"].overrides, seed=3).state_dict()
    model = ablation.build_model(preset, ablation.VARIANTS[variant].overrides, seed=3).state_dict()
    other_seed = ablation.build_model(preset, ablation.VARIANTS["baseline"].overrides, seed=4).state_dict()
    assert set(baseline) <= set(model)
    for name, tensor in baseline.items():
        torch.testing.assert_close(model[name], tensor, rtol=0, atol=0, msg=name)
    assert not torch.equal(other_seed["model.layers.0.self_attn.q_proj.weight"],
                           baseline["model.layers.0.self_attn.q_proj.weight"])


def test_paired_difference_and_its_interval(ablation):
    mean, low, high = ablation.paired_difference([1.0, 2.0, 3.5], [0.5, 1.5, 2.5])
    assert mean == pytest.approx(2 / 3)
    # differences 0.5, 0.5, 1.0: sd 0.288675, t(0.975, 2) = 4.302653
    half = 4.302653 * 0.288675 / math.sqrt(3)
    assert (low, high) == (pytest.approx(mean - half, abs=1e-5), pytest.approx(mean + half, abs=1e-5))
    assert all(math.isnan(x) for x in ablation.paired_difference([1.0], [0.5])[1:])


def test_paper_column_is_table_4_and_its_ordering(ablation):
    assert ablation.VARIANTS["baseline"].paper == 1.766
    assert ablation.VARIANTS["AttnRes input-dependent query"].paper == 1.731
    assert ablation.VARIANTS["MUDDFormer"].paper is None
    assert ablation.paper_ordering(["baseline", "Full AttnRes", "MUDDFormer", "AttnRes input-dependent query"]) == (
        "AttnRes input-dependent query < Full AttnRes < baseline")
