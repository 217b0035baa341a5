"""Training recipes: router-only, LoRA (+ routers) with gradient checkpointing, resume, DDP and FSDP."""

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, TrainerCallback, TrainingArguments

from attnres_hf.cli import main
from attnres_hf.training import AttnResArguments, AttnResTrainer, packed_lm_dataset, prepare_model, train
from attnres_hf.training.recipes import is_router_parameter, merge_lora
from utils import TINY, counting_text, tiny_model, word_tokenizer, write_tiny_model_dir

COMMON = ["--seq-len", "64", "--per_device_train_batch_size", "8", "--disable_tqdm", "true", "--seed", "0",
          "--train_sampling_strategy", "sequential", "--logging_steps", "1"]


def run_train(folder, out, *extra):
    return main(["train", str(folder / "model"), "--data", str(folder / "train.txt"), "--output-dir", str(out),
                 *COMMON, *map(str, extra)])


def test_router_only_training_changes_only_routers_and_lowers_held_out_loss(tiny_model_dir):
    before = load_file(tiny_model_dir / "model" / "model.safetensors")
    assert run_train(tiny_model_dir, tiny_model_dir / "out", "--method", "routers", "--max-steps", "60", "--lr", "1e-2",
                     "--eval_strategy", "steps", "--eval_steps", "60", "--save_steps", "60") == 0
    after = load_file(tiny_model_dir / "out" / "model.safetensors")
    assert set(before) == set(after)
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all(is_router_parameter(k) for k in changed)
    assert {k for k in before if k.endswith(".query") and ".0.attn_res" not in k} <= changed
    summary = json.loads((tiny_model_dir / "out" / "train_summary.json").read_text())
    assert summary["trainable_parameters"] == summary["router_parameters"] == 7 * 2 * TINY["hidden_size"]
    assert summary["eval_loss_after"] < summary["eval_loss_before"]
    assert summary["depth_entropy_ratio_after"] < 1.0  # the routing moved away from uniform


def test_lora_with_gradient_checkpointing_trains_adapters_and_routers_and_merges(tiny_model_dir):
    out = tiny_model_dir / "lora"
    assert run_train(tiny_model_dir, out, "--method", "lora", "--max-steps", "2", "--gradient_checkpointing", "true",
                     "--eval_steps", "2", "--save_steps", "2", "--lora_r", "4") == 0
    adapter = load_file(out / "adapter_model.safetensors")
    lora_b = [v for k, v in adapter.items() if "lora_B" in k]
    assert len(lora_b) == 3 * 7 and all(torch.count_nonzero(b) > 0 for b in lora_b)
    assert any(k.endswith("mlp_res.query") for k in adapter)  # routers travel with the adapter
    summary = json.loads((out / "train_summary.json").read_text())
    assert summary["router_parameters"] == 7 * 2 * TINY["hidden_size"]  # the trained copies, not PEFT's originals

    from peft import PeftModel

    ids = torch.randint(3, TINY["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(0))
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir / "model")
    with torch.no_grad():
        base_logits = base(ids).logits
        adapted = PeftModel.from_pretrained(base, out).eval()
        adapted_logits = adapted(ids).logits
        assert not torch.allclose(adapted_logits, base_logits)
        merged = merge_lora(tiny_model_dir / "model", out, tiny_model_dir / "merged")
        torch.testing.assert_close(merged(ids).logits, adapted_logits, atol=1e-5, rtol=1e-5)
        reloaded = AutoModelForCausalLM.from_pretrained(tiny_model_dir / "merged").eval()
        torch.testing.assert_close(reloaded(ids).logits, adapted_logits, atol=1e-5, rtol=1e-5)
    assert not any("lora" in k for k in load_file(tiny_model_dir / "merged" / "model.safetensors"))
    for name in ("tokenizer.json", "generation_config.json", "modeling_attnres.py"):  # a complete folder
        assert (tiny_model_dir / "merged" / name).is_file(), name
    assert json.loads((out / "base_quantization.json").read_text())["quantization_config"] is None  # full precision


class StopAt(TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True


def test_resume_continues_the_uninterrupted_loss_trajectory(tiny_model_dir):
    def arguments(out, resume=False):
        ours = AttnResArguments(model=str(tiny_model_dir / "model"), data=[str(tiny_model_dir / "train.txt")],
                                method="full", seq_len=64, resume=resume, entropy_batches=0)
        args = TrainingArguments(output_dir=str(out), max_steps=8, per_device_train_batch_size=4, learning_rate=1e-3,
                                 logging_steps=1, save_steps=4, eval_strategy="no", seed=0, disable_tqdm=True,
                                 report_to="none")
        return ours, args

    def losses(out):
        state = json.loads(sorted(out.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))[-1]
                           .joinpath("trainer_state.json").read_text())
        return {e["step"]: e["loss"] for e in state["log_history"] if "loss" in e}

    train(*arguments(tiny_model_dir / "full"))
    train(*arguments(tiny_model_dir / "cut"), callbacks=[StopAt(4)])
    checkpoint = tiny_model_dir / "cut" / "checkpoint-4"
    assert (checkpoint / "modeling_attnres.py").is_file()  # checkpoints load with remote code too
    assert "auto_map" in json.loads((checkpoint / "config.json").read_text())
    train(*arguments(tiny_model_dir / "cut", resume=True))
    uninterrupted, resumed = losses(tiny_model_dir / "full"), losses(tiny_model_dir / "cut")
    assert sorted(resumed) == list(range(1, 9))
    for step in (5, 8):
        assert resumed[step] == pytest.approx(uninterrupted[step], rel=1e-6, abs=1e-7)


def test_resume_without_a_checkpoint_is_an_error(tiny_model_dir, capsys):
    assert run_train(tiny_model_dir, tiny_model_dir / "none", "--method", "routers", "--resume") == 2
    assert "no checkpoint-* folder" in capsys.readouterr().err


def test_an_earlier_runs_checkpoints_are_not_silently_mixed_with_a_new_run(tiny_model_dir, capsys):
    (tiny_model_dir / "runs" / "checkpoint-6").mkdir(parents=True)
    assert run_train(tiny_model_dir, tiny_model_dir / "runs", "--method", "routers", "--max-steps", "2") == 2
    assert "holds checkpoints of an earlier run (checkpoint-6); pass --resume" in capsys.readouterr().err


LAUNCH = {
    "ddp": ["--multi_gpu"],
    "fsdp": ["--use_fsdp", "--fsdp_version", "2", "--fsdp_auto_wrap_policy", "TRANSFORMER_BASED_WRAP",
             "--fsdp_transformer_layer_cls_to_wrap", "AttnResDecoderLayer", "--fsdp_state_dict_type", "FULL_STATE_DICT"],
    # DeepSpeed's CPU accelerator over gloo (it builds its shared-memory op with the C++ compiler on first use, cached
    # in ~/.cache/torch_extensions); ZeRO-3 saves the gathered full weights only with zero3_save_16bit_model.
    "deepspeed-zero2": ["--use_deepspeed", "--zero_stage", "2", "--gradient_clipping", "1.0"],
    "deepspeed-zero3": ["--use_deepspeed", "--zero_stage", "3", "--zero3_save_16bit_model", "true",
                        "--zero3_init_flag", "false", "--gradient_clipping", "1.0"],
}


TWO_PROCESS_STEPS = ["--method", "full", "--max-steps", "3", "--eval_steps", "3", "--save_steps", "3", "--lr", "1e-3"]


@pytest.fixture(scope="module")
def one_process_run(tmp_path_factory):
    """The tiny model's folder (`write_tiny_model_dir`) with the one-process run every two-process strategy is
    compared with, in `single` (the same for all: run once)."""
    folder = write_tiny_model_dir(tmp_path_factory.mktemp("two-process"))
    assert run_train(folder, folder / "single", *TWO_PROCESS_STEPS) == 0
    return folder


@pytest.mark.slow
@pytest.mark.parametrize("strategy", list(LAUNCH))
def test_two_process_training_matches_one_process_on_the_same_global_batch(strategy, one_process_run):
    """DDP, FSDP2 and DeepSpeed ZeRO-2/3 (`attnres train` under `accelerate launch`, 2 gloo processes): the same
    tokens, training loss and saved weights as one process on the same global batch; the saved folder loads."""
    if strategy.startswith("deepspeed"):
        pytest.importorskip("deepspeed")
    tiny_model_dir, steps = one_process_run, TWO_PROCESS_STEPS
    command = [sys.executable, "-m", "accelerate.commands.launch", *LAUNCH[strategy], "--num_processes", "2",
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "-m", "attnres_hf.cli",
               "train", str(tiny_model_dir / "model"), "--data", str(tiny_model_dir / "train.txt"),
               "--output-dir", str(tiny_model_dir / strategy), *COMMON, *steps, "--use_cpu", "true"]
    command[command.index("8")] = "4"  # per-device batch 4 on 2 processes = the single run's global batch of 8
    environment = os.environ | {"DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False, env=environment)
    assert result.returncode == 0, result.stderr[-4000:]
    single = json.loads((tiny_model_dir / "single" / "train_summary.json").read_text())
    multi = json.loads((tiny_model_dir / strategy / "train_summary.json").read_text())
    assert multi["tokens_seen"] == single["tokens_seen"]
    assert multi["train_loss"] == pytest.approx(single["train_loss"], rel=1e-5)
    a, b = load_file(tiny_model_dir / "single" / "model.safetensors"), load_file(tiny_model_dir / strategy / "model.safetensors")
    assert set(a) == set(b)
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-5
    ids = torch.arange(3, 19).unsqueeze(0)
    with torch.no_grad():
        logits = [AutoModelForCausalLM.from_pretrained(tiny_model_dir / run)(ids).logits for run in ("single", strategy)]
    torch.testing.assert_close(logits[1], logits[0], atol=1e-5, rtol=1e-5)


def test_router_queries_norms_and_biases_get_no_weight_decay(tmp_path):
    model = prepare_model(tiny_model(attention_bias=True), "full")
    trainer = AttnResTrainer(model=model, args=TrainingArguments(output_dir=str(tmp_path), report_to="none"))
    decayed = set(trainer.get_decay_parameter_names(model))
    assert "model.layers.1.self_attn.q_proj.weight" in decayed
    assert not [n for n in decayed if n.endswith((".query", ".bias")) or "norm" in n]


@pytest.mark.parametrize("depth_mixing", ["attnres", "delta_attnres", "mhc"])
def test_the_depth_mixing_parameters_train_at_their_own_learning_rate(depth_mixing, tmp_path):
    """`router_learning_rate`: every depth-mixing parameter, and nothing else, in groups at that rate (decay kept as
    the record says); the scheduler scales both from their own peak; a bad value is refused before training."""
    model = prepare_model(tiny_model(depth_mixing=depth_mixing), "full")
    args = TrainingArguments(output_dir=str(tmp_path), report_to="none", learning_rate=1e-4, weight_decay=0.1,
                             lr_scheduler_type="linear", max_steps=10)
    trainer = AttnResTrainer(model=model, args=args, router_learning_rate=5e-3)
    trainer.create_optimizer_and_scheduler(num_training_steps=10)
    names = {id(p): n for n, p in model.named_parameters()}
    groups = trainer.optimizer.param_groups
    routers = [g for g in groups if g.get("depth_mixing")]
    assert {names[id(p)] for g in routers for p in g["params"]} == {n for n in names.values() if is_router_parameter(n)}
    assert all(g["lr"] == 5e-3 for g in routers) and all(g["lr"] == 1e-4 for g in groups if g not in routers)
    assert sum(len(g["params"]) for g in groups) == len(names)  # each parameter once
    decayed = set(trainer.get_decay_parameter_names(model))
    assert all((g["weight_decay"] > 0) == all(names[id(p)] in decayed for p in g["params"]) for g in groups if g["params"])
    trainer.optimizer.step()  # (no gradients: nothing moves)
    trainer.lr_scheduler.step()
    assert [g["lr"] for g in groups] == pytest.approx([g["initial_lr"] * 0.9 for g in groups])
    trainer.create_optimizer()  # (called again: not split twice)
    assert len(trainer.optimizer.param_groups) == len(groups)
    for bad, error in ((0.0, ValueError), (-1e-3, ValueError), (float("nan"), ValueError), ("5e-3", TypeError)):
        with pytest.raises(error, match="router_learning_rate"):
            AttnResTrainer(model=model, args=args, router_learning_rate=bad)
    # routers alone: no group left empty, so the logged rate (the first group's) is the routers'
    routers_only = prepare_model(tiny_model(depth_mixing=depth_mixing), "routers")
    trainer = AttnResTrainer(model=routers_only, args=args, router_learning_rate=5e-3)
    assert [g["lr"] for g in trainer.create_optimizer().param_groups if g["params"]] == [5e-3] * len(
        trainer.optimizer.param_groups)


@pytest.mark.parametrize("method", ["full", "routers"])
def test_a_router_learning_rate_without_trainable_depth_mixing_parameters_is_an_error(method, tmp_path):
    model = tiny_model(depth_mixing="residual") if method == "full" else tiny_model().requires_grad_(False)
    if method == "routers":
        model.lm_head.weight.requires_grad_(True)  # (something trains, but no router)
    args = TrainingArguments(output_dir=str(tmp_path), report_to="none", max_steps=1)
    with pytest.raises(ValueError, match="router_learning_rate is set, but the model has no (trainable )?depth-mixing"):
        AttnResTrainer(model=model, args=args, router_learning_rate=5e-3).create_optimizer()


def test_data_files_jsonl_and_dataset_folders(tmp_path):
    from datasets import Dataset

    tokenizer = word_tokenizer()
    lines = [{"text": " ".join(f"w{3 + (i + k) % 90}" for k in range(40))} for i in range(20)]
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps(line) for line in lines))
    Dataset.from_list(lines).save_to_disk(str(tmp_path / "folder"))
    data = packed_lm_dataset([tmp_path / "a.jsonl", tmp_path / "folder"], tokenizer, seq_len=32, eval_fraction=0.1)
    total = 2 * 20 * 41 // 32  # words + EOS per document, packed
    assert len(data["train"]) + len(data["eval"]) == total and len(data["eval"]) == round(total * 0.1)
    assert data["train"][0]["input_ids"] == data["train"][0]["labels"] and len(data["eval"][0]["input_ids"]) == 32
    with pytest.raises(FileNotFoundError):
        packed_lm_dataset([tmp_path / "missing.txt"], tokenizer)
    with pytest.raises(ValueError, match="unsupported data file"):
        (tmp_path / "x.csv").write_text("a,b")
        packed_lm_dataset([tmp_path / "x.csv"], tokenizer)
    with pytest.raises(ValueError, match="at least 2 blocks"):
        packed_lm_dataset([tmp_path / "a.jsonl"], tokenizer, seq_len=4096)


class LossRecorder(TrainerCallback):
    def __init__(self):
        self.losses = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses.append(logs["loss"])


@pytest.mark.slow
@pytest.mark.parametrize("method", ["routers", "lora", "full"])
def test_two_runs_with_the_same_seed_are_bit_identical(method, tmp_path):
    """Adapter init, data order and dropout (LoRA and attention dropout) all come after seeding."""
    model_dir = tmp_path / "model"
    tiny_model(routers=False, attnres_block_size=2, attention_dropout=0.2).save_pretrained(model_dir)
    word_tokenizer().save_pretrained(model_dir)
    (tmp_path / "train.txt").write_text(counting_text())

    def run(out):
        ours = AttnResArguments(model=str(model_dir), data=[str(tmp_path / "train.txt")], method=method, seq_len=32,
                                lora_r=4, lora_dropout=0.2, entropy_batches=0)
        args = TrainingArguments(output_dir=str(tmp_path / out), max_steps=3, per_device_train_batch_size=4,
                                 learning_rate=1e-2, logging_steps=1, eval_strategy="no", save_strategy="no", seed=0,
                                 disable_tqdm=True, report_to="none")
        recorder = LossRecorder()
        train(ours, args, callbacks=[recorder])
        assert len(recorder.losses) == 3
        return recorder.losses, load_file(next((tmp_path / out).glob("*model.safetensors")))

    torch.manual_seed(123)  # whatever the global random state before each run
    losses_a, weights_a = run("a")
    torch.rand(7)
    losses_b, weights_b = run("b")
    assert losses_a == losses_b
    assert set(weights_a) == set(weights_b) and all(torch.equal(weights_a[k], weights_b[k]) for k in weights_a)


@pytest.mark.parametrize("targets, message", [
    (["q_proj", "gate_prj"], "lora_target_modules not found in this model: gate_prj;"),
    (["qproj", "v_proj"], "lora_target_modules not found in this model: qproj;"),
    (["input_layernorm"], "lora_target_modules not found in this model: input_layernorm;"),  # LoRA wraps no norm
    # routers train in full (modules_to_save), never through LoRA
    (["mlp_res", "q_proj"], "lora_target_modules names depth-mixing modules (mlp_res): they hold no layer LoRA adapts"),
], ids=["typo", "typo-first", "norm", "router"])
def test_a_lora_target_that_matches_nothing_stops_before_training(targets, message, tiny_model_dir, capsys,
                                                                  monkeypatch):
    import transformers

    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_loading)
    out = tiny_model_dir / "lora"
    assert run_train(tiny_model_dir, out, "--method", "lora", "--max-steps", "1", "--lora_target_modules", *targets) == 2
    err = capsys.readouterr().err
    assert message in err
    assert "valid names: down_proj, embed_tokens, gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj" in err
    assert not out.exists()


def test_lora_targets_default_to_the_models_linear_layers_and_match_as_peft_does():
    from peft import PeftModel
    from transformers import LlamaConfig, LlamaForCausalLM

    from attnres_hf.training import check_lora_targets, default_lora_targets

    projections = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    assert default_lora_targets(tiny_model()) == projections
    assert default_lora_targets(LlamaForCausalLM(LlamaConfig(**TINY))) == projections
    model = tiny_model()
    assert check_lora_targets(model, ["self_attn.q_proj", "lm_head"]) == ["self_attn.q_proj", "lm_head"]
    assert check_lora_targets(model, r".*\.1\.mlp\.up_proj") == r".*\.1\.mlp\.up_proj"
    with pytest.raises(ValueError, match="'.*nothing' matches no module"):
        check_lora_targets(model, r".*nothing")
    with pytest.raises(ValueError, match="at least one module"):
        check_lora_targets(model, [])
    for bad in (5, ["q_proj", 3], {"q_proj": 1}):
        with pytest.raises(TypeError, match="list of module names or one regular expression"):
            check_lora_targets(model, bad)
    wrapped = prepare_model(tiny_model(), "lora", lora_r=2, lora_target_modules=["self_attn.q_proj"])
    assert isinstance(wrapped, PeftModel)
    adapted = {name.split(".lora_A")[0].rsplit(".", 1)[-1] for name, _ in wrapped.named_parameters() if "lora_A" in name}
    assert adapted == {"q_proj"}
    with pytest.warns(FutureWarning, match="default_lora_targets"):
        from attnres_hf.training import DEFAULT_LORA_TARGETS
    assert list(DEFAULT_LORA_TARGETS) == projections


@pytest.mark.parametrize(("given", "taken"), [
    (["all-linear"], "all-linear"), ([r".*\.1\.mlp\.up_proj"], r".*\.1\.mlp\.up_proj"), (["q_proj"], ["q_proj"]),
    (["self_attn.q_proj"], ["self_attn.q_proj"]), (["q_proj", "v_proj"], ["q_proj", "v_proj"]),
])
def test_lora_targets_on_the_command_line_take_pefts_string_forms(given, taken, tmp_path):
    """The command line gives a list; one value that is no module name is PEFT's `target_modules` string
    ("all-linear", or a regular expression over whole paths), which it could not be given before."""
    from attnres_hf.cli.train import train_parser
    from attnres_hf.training import check_lora_targets

    (tmp_path / "t.txt").write_text("some text")
    ours, *_ = train_parser().parse_args_into_dataclasses(
        ["--model", str(tmp_path), "--data", str(tmp_path / "t.txt"), "--method", "lora", "--output_dir",
         str(tmp_path / "out"), "--lora_target_modules", *given], return_remaining_strings=True)
    assert ours.lora_target_modules == taken
    assert check_lora_targets(tiny_model(), ours.lora_target_modules) == taken
    if taken == "all-linear":  # PEFT's meaning: every linear layer but the output head
        wrapped = prepare_model(tiny_model(), "lora", lora_r=2, lora_target_modules=taken)
        adapted = {name.split(".lora_A")[0].rsplit(".", 1)[-1] for name, _ in wrapped.named_parameters()
                   if "lora_A" in name}
        assert adapted == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A tiny router run of 4 steps with checkpoints at steps 2 (midway) and 4 (the end of its schedule)."""
    folder = tmp_path_factory.mktemp("resume")
    tiny_model(routers=False, attnres_block_size=2).save_pretrained(folder / "model")
    word_tokenizer().save_pretrained(folder / "model")
    (folder / "train.txt").write_text(counting_text())
    assert run_train(folder, folder / "run", "--method", "routers", "--max-steps", "4", "--save_steps", "2",
                     "--eval_strategy", "no", "--entropy_batches", "0") == 0
    assert sorted(p.name for p in (folder / "run").glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
    return folder


def _midway(folder, out, record=True):
    """A copy of the run's output folder interrupted after its checkpoint at step 2 (of 4)."""
    import shutil

    shutil.copytree(folder / "run" / "checkpoint-2", out / "checkpoint-2")
    state_file = out / "checkpoint-2" / "trainer_state.json"
    state = json.loads(state_file.read_text())
    if record is False:  # as written by a plain Trainer run, or by attnres before the schedule was recorded
        del state["stateful_callbacks"]["LearningRateSchedule"]
    elif record is not True:  # a number: as a run with --router_learning_rate record writes it
        state["stateful_callbacks"]["LearningRateSchedule"]["args"]["router_learning_rate"] = record
    state_file.write_text(json.dumps(state))
    return out


def _no_loading(monkeypatch):
    import transformers

    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_loading)


@pytest.mark.parametrize("extra", [["--max-steps", "4"], ["--max-steps", "8"], ["--max-steps", "8", "--lr", "1e-3"]],
                         ids=["same-max-steps", "more-steps", "more-steps-new-lr"])
def test_resuming_a_finished_schedule_is_refused_before_loading(extra, finished_run, capsys, monkeypatch):
    _no_loading(monkeypatch)
    before = sorted(p.name for p in (finished_run / "run").iterdir())
    assert run_train(finished_run, finished_run / "run", "--method", "routers", "--resume", *extra) == 2
    err = capsys.readouterr().err
    assert "checkpoint-4 (step 4 of max_steps 4) is the end of its run's learning-rate schedule" in err
    assert "start a new run (another --output-dir) from its weights" in err
    assert sorted(p.name for p in (finished_run / "run").iterdir()) == before


@pytest.mark.parametrize("extra, change, record", [
    (["--max-steps", "8"], "--max-steps 8 (the checkpoint's run: 4)", True),
    (["--max-steps", "3"], "--max-steps 3 (the checkpoint's run: 4)", True),
    (["--max-steps", "4", "--lr", "1e-2"], "--lr 0.01 (the checkpoint's run: 0.0002)", True),
    (["--max-steps", "4", "--lr_scheduler_type", "cosine"], "--lr_scheduler_type cosine (the checkpoint's run: linear)",
     True),
    (["--max-steps", "4", "--warmup_steps", "2"], "--warmup_steps 2.0 (the checkpoint's run: 0)", True),
    (["--max-steps", "4", "--warmup_steps", "0.5"], "--warmup_steps 0.5 (the checkpoint's run: 0)", True),
    ([], "--max-steps unset (the run sized by --num_train_epochs) (the checkpoint's run: 4)", True),
    # Without the record: the length from trainer_state.json, the learning rate from scheduler.pt's base_lrs
    (["--max-steps", "8"], "--max-steps 8 (the checkpoint's run: 4)", False),
    (["--max-steps", "4", "--lr", "1e-2"], "--lr 0.01 (the checkpoint's run: 0.0002)", False),
    # The depth-mixing parameters' own rate: added, dropped or changed (the optimizer's groups differ, or the rate)
    (["--max-steps", "4", "--router_learning_rate", "5e-3"], "--router_learning_rate 0.005 (the checkpoint's run: "
     "unset)", True),
    (["--max-steps", "4"], "--router_learning_rate unset (the checkpoint's run: 0.005)", 5e-3),
    (["--max-steps", "4", "--router_learning_rate", "1e-1"], "--router_learning_rate 0.1 (the checkpoint's run: "
     "0.005)", 5e-3),
], ids=["longer", "shorter", "lr", "scheduler", "warmup", "warmup-ratio", "max-steps-unset", "plain-longer",
        "plain-lr", "router-lr-added", "router-lr-dropped", "router-lr-changed"])
def test_resuming_with_settings_that_change_the_schedule_is_refused_before_loading(extra, change, record, finished_run,
                                                                                  tmp_path, capsys, monkeypatch):
    out = _midway(finished_run, tmp_path / "cut", record)
    _no_loading(monkeypatch)
    assert run_train(finished_run, out, "--method", "routers", "--resume", *extra) == 2
    err = capsys.readouterr().err
    assert f"checkpoint-2 (step 2 of max_steps 4) cannot continue its learning-rate schedule with {change}" in err
    assert "Resume with the run's settings (" in err and "or start a new run" in err
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-2"]


def test_resuming_a_checkpoint_without_the_schedule_record_with_the_same_settings_finishes_the_run(finished_run,
                                                                                                   tmp_path):
    out = _midway(finished_run, tmp_path / "cut", record=False)
    assert run_train(finished_run, out, "--method", "routers", "--resume", "--max-steps", "4",
                     "--save_steps", "2", "--eval_strategy", "no", "--entropy_batches", "0") == 0
    state = json.loads((out / "checkpoint-4" / "trainer_state.json").read_text())
    assert state["global_step"] == 4 and state["stateful_callbacks"]["LearningRateSchedule"]["args"]["max_steps"] == 4
    original = json.loads((finished_run / "run" / "checkpoint-4" / "trainer_state.json").read_text())
    assert [e["learning_rate"] for e in state["log_history"] if "loss" in e] == \
        [e["learning_rate"] for e in original["log_history"] if "loss" in e]


def test_a_run_sized_by_epochs_whose_step_count_changed_stops_before_its_first_step():
    from transformers import TrainerControl, TrainerState

    from attnres_hf.training.resume import SameScheduleLength

    check = SameScheduleLength("out/checkpoint-30", 60)
    args = TrainingArguments(output_dir="unused", num_train_epochs=3, report_to="none")
    check.on_train_begin(args, TrainerState(max_steps=60), TrainerControl())
    with pytest.raises(ValueError, match="out/checkpoint-30 belongs to a run of 60 steps, but these settings make 90 "
                                         r"\(num_train_epochs 3"):
        check.on_train_begin(args, TrainerState(max_steps=90), TrainerControl())


@pytest.mark.parametrize("damage, says", [
    ("no-state", "checkpoint-2 has no trainer_state.json (an incomplete checkpoint?); remove it"),
    ("bad-state", "checkpoint-2/trainer_state.json is not valid JSON"),
    ("bad-scheduler", "checkpoint-2/scheduler.pt is unreadable"),
])
def test_an_incomplete_checkpoint_is_refused_before_loading(damage, says, finished_run, tmp_path, capsys, monkeypatch):
    out = _midway(finished_run, tmp_path / "cut")
    if damage == "no-state":
        (out / "checkpoint-2" / "trainer_state.json").unlink()
    elif damage == "bad-state":
        (out / "checkpoint-2" / "trainer_state.json").write_text('{"global_step": 2,')
    else:
        data = (out / "checkpoint-2" / "scheduler.pt").read_bytes()
        (out / "checkpoint-2" / "scheduler.pt").write_bytes(data[: len(data) // 2])
    _no_loading(monkeypatch)
    assert run_train(finished_run, out, "--method", "routers", "--resume", "--max-steps", "4") == 2
    assert says in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--model", "M"], ["--model=M"], ["M", "--model", "M"]],
                         ids=["option", "option=", "both"])
def test_the_model_goes_first_the_one_way_the_help_spells_it(argv, tiny_model_dir, capsys, monkeypatch):
    """`attnres train MODEL ...` is the one form (the pages' and the help's); `--model` is refused in one line,
    before anything loads, saying how to write it."""
    folder = str(tiny_model_dir / "model")
    _no_loading(monkeypatch)
    argv = [folder if arg == "M" else arg.replace("=M", f"={folder}") for arg in argv]
    assert main(["train", *argv, "--data", str(tiny_model_dir / "train.txt"), "--output-dir",
                 str(tiny_model_dir / "out"), *COMMON, "--max-steps", "1"]) == 2
    err = capsys.readouterr().err
    assert err == ("attnres train: error: the model folder comes first, as MODEL: attnres train MODEL --data FILE ... "
                   "(attnres train --help lists every option)\n")
    assert not (tiny_model_dir / "out").exists()


def test_train_help_lists_model_once_and_says_evaluation_is_opt_in(capsys):
    assert main(["train", "--help"]) == 0
    out = capsys.readouterr().out
    assert "--model " not in out and "--model MODEL" not in out
    assert out.startswith("usage: attnres train MODEL --data FILE")
    assert "Evaluation is opt-in: --eval-strategy steps evaluates" in " ".join(out.split())


@pytest.mark.parametrize("flag, says", [
    ("--max-step", "--max-step: did you mean --max-steps?"),
    ("--learning-rat", "--learning-rat: did you mean --learning-rate?"),
    ("--eval_strategie", "--eval_strategie: did you mean --eval_strategy?"),
])
def test_a_misspelt_train_option_names_the_nearest_one_before_loading(flag, says, tiny_model_dir, capsys,
                                                                      monkeypatch):
    _no_loading(monkeypatch)
    assert run_train(tiny_model_dir, tiny_model_dir / "out", flag, "5") == 2
    err = capsys.readouterr().err
    assert err.startswith(f"attnres train: error: unrecognized arguments: {flag} 5 ({says}; attnres train --help")
    assert len(err.strip().splitlines()) == 1 and not (tiny_model_dir / "out").exists()


class CountEvaluations(TrainerCallback):
    def __init__(self):
        self.steps = []

    def on_evaluate(self, args, state, control, **kwargs):
        self.steps.append(state.global_step)


@pytest.mark.parametrize("strategy, eval_steps, evaluated_at", [
    ("no", None, []),  # TrainingArguments' default: no pass over the held-out blocks at all
    ("steps", 2, [0, 2, 4]),  # before, every 2 steps; the Trainer's own pass at the last step is the "after"
    ("steps", 3, [0, 3, 4]),  # 3 does not divide 4: one more pass after the last step
], ids=["off", "dividing", "not-dividing"])
def test_evaluation_is_opt_in_and_the_last_pass_is_not_repeated(strategy, eval_steps, evaluated_at, tiny_model_dir,
                                                                 capsys):
    counter = CountEvaluations()
    ours = AttnResArguments(model=str(tiny_model_dir / "model"), data=[str(tiny_model_dir / "train.txt")],
                            method="routers", seq_len=64, entropy_batches=1)
    args = TrainingArguments(output_dir=str(tiny_model_dir / "out"), max_steps=4, per_device_train_batch_size=4,
                             eval_strategy=strategy, eval_steps=eval_steps, save_strategy="no", seed=0,
                             disable_tqdm=True, report_to="none")
    summary = train(ours, args, callbacks=[counter])
    assert counter.steps == evaluated_at
    out = capsys.readouterr().out
    if strategy == "no":
        assert summary["eval_loss_before"] is summary["eval_loss_after"] is summary["depth_entropy_ratio_after"] is None
        assert "eval                  not evaluated (--eval-strategy steps" in out
    else:
        assert summary["eval_loss_before"] > 0 and summary["eval_loss_after"] > 0
        assert 0 < summary["depth_entropy_ratio_after"] <= 1 and "eval perplexity" in out
