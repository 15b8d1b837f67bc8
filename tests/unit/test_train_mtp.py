"""`chainspec train-mtp` on tiny targets made on the fly (no MTP weights of their own):
the target's files stay byte-identical and its parameters frozen, the output loads as a
drafter, a resumed run equals an uninterrupted one, and the distill loss falls."""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from chainspec.models.loader import load_draft_model, load_target
from chainspec.training import resume
from chainspec.training.distill import distill_stage
from chainspec.training.mtp_recipe import MTPRecipe, RunSettings
from chainspec.training.recipe import EvalSettings, StageSchedule
from chainspec.training.train_mtp import MTPJob, build_model, prepare_data, train_mtp
from tests.integration.tiny_checkpoint import CORPUS, write_tiny_model, write_tokenizer
from tests.unit.checkpoints import hf_config, random_tensors, target_shapes, write_checkpoint

K = 3
RECIPE = MTPRecipe(num_mtp=K, schedule=StageSchedule(steps=6, lr=3e-3, warmup_steps=1,
                                                     weight_decay=0.0),
                   seq_len=32, batch_size=2, held_out_percent=30, seed=7)
SETTINGS = RunSettings(EvalSettings(windows=2, loss_windows=1, prompts=2, prompt_len=8,
                                    max_new_tokens=6), log_every=3, checkpoint_every=3,
                       threads=1)


def _strip_mtp(model_dir: Path) -> Path:
    (model_dir / "mtp.safetensors").unlink()
    cfg = json.loads((model_dir / "config.json").read_text())
    del cfg["num_nextn_predict_layers"]
    (model_dir / "config.json").write_text(json.dumps(cfg))
    return model_dir


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Llama target whose next token mostly follows the current one (learnable)."""
    return _strip_mtp(write_tiny_model(tmp_path_factory.mktemp("llama"), num_mtp=1))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("corpus")
    for i in range(24):
        (folder / f"doc{i:02d}.txt").write_text(CORPUS[i % 3] * 3)
    return folder


def _job(target: Path, data: Path, out: Path, recipe: MTPRecipe = RECIPE,
         resume_run: bool = False) -> MTPJob:
    return MTPJob(target, str(data), out, recipe, SETTINGS, resume_run)


def _digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.iterdir()}


@pytest.fixture(scope="module")
def trained(llama: Path, corpus: Path, tmp_path_factory: pytest.TempPathFactory):
    before = _digests(llama)
    out = tmp_path_factory.mktemp("out")
    report = train_mtp(_job(llama, corpus, out))
    return before, out, report


def test_target_files_are_untouched(llama: Path, trained) -> None:
    before, out, _ = trained
    assert _digests(llama) == before
    assert (out / "model.safetensors").resolve() == (llama / "model.safetensors").resolve()


def test_output_loads_as_a_drafter_in_the_deepseek_layout(llama: Path, trained) -> None:
    _, out, report = trained
    assert json.loads((out / "config.json").read_text())["num_nextn_predict_layers"] == K
    draft = load_draft_model(out)
    assert draft.num_modules == K
    target = load_target(out)  # the MTP file is the drafter's, not the target's
    assert draft.lm_head.weight.data_ptr() != 0 and target.config.num_mtp_layers == K
    layers = target.config.num_layers
    names = set(load_file(str(out / "mtp.safetensors")))
    assert {n.split(".")[2] for n in names} == {str(layers + i) for i in range(K)}
    assert f"model.layers.{layers}.shared_head.norm.weight" in names
    assert not any("embed_tokens" in n or "lm_head" in n for n in names)
    card = (out / "README.md").read_text()
    assert "mean acceptance length" in card and str(llama) in card
    assert len(report.teacher_forced.rates) == K


def test_the_target_is_frozen(llama: Path, corpus: Path, tmp_path: Path) -> None:
    job = _job(llama, corpus, tmp_path)
    torch.manual_seed(0)
    model = build_model(job)
    data = prepare_data(job, model)
    frozen = {k: v.clone() for k, v in model.target.state_dict().items()}
    modules = {k: v.clone() for k, v in model.draft.mtp.state_dict().items()}
    from chainspec.training.batches import WindowSampler
    sampler = WindowSampler(data.train_stream, RECIPE.seq_len, RECIPE.batch_size, 1)
    distill_stage(model, RECIPE.schedule).run(model, sampler, 0, 10, 0.0)
    assert all(torch.equal(v, frozen[k]) for k, v in model.target.state_dict().items())
    assert not any(p.requires_grad for p in model.target.parameters())
    changed = [k for k, v in model.draft.mtp.state_dict().items() if not torch.equal(
        v, modules[k])]
    assert len(changed) == len(modules)  # every module tensor trained


def test_resumed_run_equals_an_uninterrupted_one(llama: Path, corpus: Path, trained,
                                                 tmp_path: Path, monkeypatch) -> None:
    _, whole, _ = trained
    real_save = resume.save

    def save_then_die(folder, model, recipe, state, keep):
        real_save(folder, model, recipe, state, keep)
        if state.step == 3:
            raise KeyboardInterrupt  # killed right after the step-3 checkpoint

    monkeypatch.setattr(resume, "save", save_then_die)
    with pytest.raises(KeyboardInterrupt):
        train_mtp(_job(llama, corpus, tmp_path))
    monkeypatch.setattr(resume, "save", real_save)
    report = train_mtp(_job(llama, corpus, tmp_path, resume_run=True))
    assert report.resumed_from == 3
    assert [r.step for r in report.log] == [r.step for r in trained[2].log]
    for name in ("step-0000006.pt",):
        a = torch.load(whole / "checkpoints" / name, weights_only=False)["mtp"]
        b = torch.load(tmp_path / "checkpoints" / name, weights_only=False)["mtp"]
        assert all(torch.equal(a[k], b[k]) for k in a)
    assert (tmp_path / "mtp.safetensors").read_bytes() == (whole / "mtp.safetensors"
                                                          ).read_bytes()


def test_resume_refuses_another_recipe(llama: Path, corpus: Path, trained) -> None:
    _, whole, _ = trained
    other = replace(RECIPE, schedule=replace(RECIPE.schedule, lr=1e-3))
    with pytest.raises(ValueError, match="schedule"):
        train_mtp(_job(llama, corpus, whole, other, resume_run=True))


def test_distill_loss_falls_on_a_learnable_corpus(llama: Path, corpus: Path,
                                                  tmp_path: Path) -> None:
    recipe = replace(RECIPE, schedule=StageSchedule(steps=40, lr=1e-2, warmup_steps=2,
                                                    weight_decay=0.0))
    job = replace(_job(llama, corpus, tmp_path, recipe),
                  settings=replace(SETTINGS, log_every=5, checkpoint_every=0))
    log = train_mtp(job).log

    def soft(row) -> float:
        return sum(row.metrics[f"distill{k}"] for k in range(1, K + 1)) / K
    # NOTE: the random target's distributions are broad (entropy ~5.3 nats of 5.7), so
    # the loss can fall only ~0.4 nats; agreement with its argmax shows the learning.
    first, last = log[0], log[-2]  # train rows: steps 1-5 and 36-40
    assert soft(last) < soft(first) - 0.25, (soft(first), soft(last))
    assert last.metrics["acc1"] > first.metrics["acc1"] + 0.2
    assert log[-1].split == "held-out" and soft(log[-1]) < soft(first) - 0.25


def test_qwen2_target_with_qkv_bias(corpus: Path, tmp_path: Path) -> None:
    target = tmp_path / "qwen2"
    eot = write_tokenizer(target, 300)
    from tokenizers import Tokenizer
    vocab = Tokenizer.from_file(str(target / "tokenizer.json")).get_vocab_size()
    cfg = hf_config("Qwen2ForCausalLM", vocab_size=vocab, max_position_embeddings=128,
                    eos_token_id=eot, bos_token_id=eot, tie_word_embeddings=True)
    write_checkpoint(target, cfg, {"model.safetensors": random_tensors(
        target_shapes(cfg, qkv_bias=True))})
    before = _digests(target)
    recipe = replace(RECIPE, num_mtp=2)
    job = replace(_job(target, corpus, tmp_path / "out", recipe),
                  settings=replace(SETTINGS, checkpoint_every=0))
    train_mtp(job)
    assert _digests(target) == before
    names = set(load_file(str(tmp_path / "out" / "mtp.safetensors")))
    assert "model.layers.3.self_attn.q_proj.bias" in names
    assert load_draft_model(tmp_path / "out").num_modules == 2


def test_cli_refuses_a_target_with_mtp_and_out_equal_to_target(llama: Path, tmp_path: Path,
                                                                corpus: Path, capsys) -> None:
    from chainspec.cli import main
    assert main(["train-mtp", "--target", str(llama), "--data", str(corpus), "--out",
                 str(llama)]) == 2
    assert "--out must differ" in capsys.readouterr().err
    with_mtp = write_tiny_model(tmp_path / "with-mtp", num_mtp=1)
    assert main(["train-mtp", "--target", str(with_mtp), "--data", str(corpus), "--out",
                 str(tmp_path / "o")]) == 2
    assert "already ships MTP modules" in capsys.readouterr().err


def test_a_release_that_dropped_its_mtp_layers_gets_modules_trained(corpus: Path,
                                                                     tmp_path: Path) -> None:
    """Quantized releases often keep `num_nextn_predict_layers` but drop the tensors:
    train-mtp trains modules for them in the family's layout (was: refused)."""
    target = write_tiny_model(tmp_path / "dropped", num_mtp=1)
    (target / "mtp.safetensors").unlink()
    job = replace(_job(target, corpus, tmp_path / "out", replace(RECIPE, num_mtp=2)),
                  settings=replace(SETTINGS, checkpoint_every=0))
    train_mtp(job)
    names = set(load_file(str(tmp_path / "out" / "mtp.safetensors")))
    assert "model.layers.3.eh_proj.weight" in names  # DeepSeek layout after 2 layers
    assert load_draft_model(tmp_path / "out").num_modules == 2


def test_jsonl_prompts_are_continued_by_the_target(llama: Path, tmp_path: Path) -> None:
    data = tmp_path / "data.jsonl"
    lines = [{"prompt": CORPUS[i % 3][:12]} for i in range(12)] + [
        {"text": CORPUS[i % 3] * 2} for i in range(12)]
    data.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    recipe = replace(RECIPE, continue_tokens=10)
    job = _job(llama, data, tmp_path / "out", recipe)
    model = build_model(job)
    stats = prepare_data(job, model).stats
    assert stats["prompts_continued"] == 12
    assert stats["train_docs"] + stats["held_out_docs"] == 24


def test_progress_line_shows_loss_and_acceptance_per_position() -> None:
    import io

    from chainspec.training.progress import ProgressBar

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    stream = Tty()
    bar = ProgressBar(10, stream=stream)
    bar.update(5, {"distill1": 2.0, "distill2": 4.0, "acc1": 0.5, "acc2": 0.25})
    line = stream.getvalue()
    assert line.startswith("\r[") and "5/10" in line and "loss 3.000" in line
    assert "accept/pos 0.50 0.25 (len 1.75)" in line
