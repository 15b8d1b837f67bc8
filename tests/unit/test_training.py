"""The demo-model trainer: a tiny end-to-end run, the folder it writes, and the pieces
whose off-by-one errors would silently spoil the demo model (split, label alignment,
acceptance counting, tensor names)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from chainspec.models.config import ModelConfig
from chainspec.models.target import TargetModel
from chainspec.training import evaluate, objective
from chainspec.training.bpe import EOT
from chainspec.training.corpus import is_held_out, list_files, load_split, stdlib_root
from chainspec.training.export import load_model, mtp_tensor_name
from chainspec.training.recipe import TINY
from chainspec.training.trainer import main
from tests import tools

K = 3
BLOCK = ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
         "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
         "mlp.down_proj.weight", "input_layernorm.weight", "post_attention_layernorm.weight"]
GLUE = ["enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight"]


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("demo")
    assert main(["--preset", "tiny", "--out", str(out), "--threads", "1"]) == 0
    return out


def test_training_is_deterministic(demo_dir: Path, tmp_path: Path) -> None:
    assert main(["--preset", "tiny", "--out", str(tmp_path), "--threads", "1"]) == 0
    for name in ("model.safetensors", "mtp.safetensors", "tokenizer.json"):
        assert (tmp_path / name).read_bytes() == (demo_dir / name).read_bytes(), name


def test_cli_train_demo_writes_the_same_folder(demo_dir: Path, tmp_path: Path) -> None:
    """`chainspec train-demo` parses the trainer's own options and trains identically."""
    from chainspec.cli import main as cli_main
    assert cli_main(["train-demo", "--preset", "tiny", "--out", str(tmp_path),
                     "--threads", "1"]) == 0
    for name in ("model.safetensors", "mtp.safetensors", "tokenizer.json"):
        assert (tmp_path / name).read_bytes() == (demo_dir / name).read_bytes(), name


def test_folder_has_every_file(demo_dir: Path) -> None:
    names = {p.name for p in demo_dir.iterdir()}
    assert names == {"config.json", "model.safetensors", "mtp.safetensors", "tokenizer.json",
                     "tokenizer_config.json", "generation_config.json", "README.md"}
    card = (demo_dir / "README.md").read_text()
    assert "mean acceptance length" in card and "--preset tiny" in card


def test_config_and_target_load_strict(demo_dir: Path) -> None:
    cfg = ModelConfig.from_dir(demo_dir)
    assert (cfg.architecture, cfg.num_mtp_layers, cfg.tie_word_embeddings) == (
        "LlamaForCausalLM", K, True)
    assert cfg.bos_token_id == 0 and cfg.eos_token_ids == (0,)
    state = load_file(str(demo_dir / "model.safetensors"))
    assert "lm_head.weight" not in state  # tied
    state["lm_head.weight"] = state["model.embed_tokens.weight"]
    TargetModel(cfg).load_state_dict(state, strict=True)


def test_mtp_tensors_use_deepseek_names(demo_dir: Path) -> None:
    n = TINY.shape.num_layers
    expected = {f"model.layers.{n + i}.{name}" for i in range(K) for name in BLOCK + GLUE}
    assert set(load_file(str(demo_dir / "mtp.safetensors"))) == expected


def test_mtp_name_mapping() -> None:
    up = "model.layers.12.mlp.up_proj.weight"
    assert mtp_tensor_name(12, 0, "block.mlp.up_proj.weight") == up
    assert mtp_tensor_name(12, 2, "final_norm.weight") == "model.layers.14.shared_head.norm.weight"
    assert mtp_tensor_name(12, 1, "eh_proj.weight") == "model.layers.13.eh_proj.weight"


def test_split_is_file_level_disjoint_and_deterministic() -> None:
    split = load_split(max_files=40, held_out_percent=30)
    train = {f.rel_path for f in split.train}
    held = {f.rel_path for f in split.held_out}
    assert train and held and not train & held
    assert held == {f.rel_path for f in load_split(max_files=40, held_out_percent=30).held_out}
    assert all(is_held_out(p, 30) for p in held) and not any(is_held_out(p, 30) for p in train)
    root = stdlib_root()
    rels = [p.relative_to(root).as_posix() for p in list_files(root, 200_000)]
    assert not any("/test/" in f"/{r}" or "/tests/" in f"/{r}" for r in rels)
    share = sum(is_held_out(r, 5) for r in rels) / len(rels)
    assert 0.02 < share < 0.09


def test_tokenizer_round_trips(demo_dir: Path) -> None:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(demo_dir / "tokenizer.json"))
    text = "def f(x):\n    return x  # é ✓\n"
    assert tok.decode(tok.encode(text).ids) == text
    assert tok.token_to_id(EOT) == 0


def _one_hot_forward(ids: torch.Tensor, vocab: int, wrong_step: int | None = None
                     ) -> objective.Forward:
    """Logits that put all mass on the correct label of every row (corpus alignment)."""
    def labels(shift: int) -> torch.Tensor:
        return objective.shift_left(ids, shift)

    def logits(y: torch.Tensor) -> torch.Tensor:
        return F.one_hot(y, vocab).float() * 50.0

    mtp = tuple(logits((labels(k + 1) + (1 if k == wrong_step else 0)) % vocab)
                for k in range(1, K + 1))
    return objective.Forward(logits(labels(1)), mtp)


def test_objective_label_alignment() -> None:
    ids = torch.randint(1, 20, (2, 16))
    fwd = _one_hot_forward(ids, 20)
    assert objective.target_ce(fwd, ids) < 1e-6
    assert max(objective.mtp_ce(fwd, ids)) < 1e-6
    assert max(objective.mtp_distill(fwd)) < 1e-6  # module k row p == target row p+k
    wrong = _one_hot_forward(ids, 20, wrong_step=2)
    assert objective.mtp_ce(wrong, ids)[1] > 10


def test_teacher_forced_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    ids = torch.randint(1, 20, (2, 16))
    fake = SimpleNamespace(num_mtp=K)
    monkeypatch.setattr(evaluate, "run_model", lambda m, x: _one_hot_forward(x, 20))
    assert evaluate.teacher_forced(fake, ids).rates == (1.0, 1.0, 1.0)
    monkeypatch.setattr(evaluate, "run_model", lambda m, x: _one_hot_forward(x, 20, 2))
    acc = evaluate.teacher_forced(fake, ids)
    assert acc.rates == (1.0, 0.0, 0.0) and acc.rounds == 2 * (16 - K)


def test_acceptance_arithmetic() -> None:
    acc = evaluate.Acceptance(rounds=10, accepted=(8, 6, 3))
    assert acc.rates == (0.8, 0.6, 0.3)
    assert acc.conditional == (0.8, 0.75, 0.5)
    assert acc.mean_length == pytest.approx(2.7)


def test_self_speculation_is_lossless(demo_dir: Path) -> None:
    model = load_model(demo_dir)
    prompt = [0, 5, 17, 42, 9, 100]
    spec, acc = evaluate.self_speculate(model, prompt, max_new=10, eos=0)
    assert spec == evaluate.greedy_generate(model, prompt, max_new=10, eos=0)
    assert acc.rounds >= 1 and len(spec) <= 10


def test_transformers_loads_target_unchanged(demo_dir: Path) -> None:
    transformers = tools.transformers()
    from chainspec.models.attention import DenseCausal

    hf, info = transformers.AutoModelForCausalLM.from_pretrained(
        demo_dir, dtype=torch.float32, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    ours = load_model(demo_dir)
    ids = torch.randint(0, TINY.shape.vocab_size, (20,))
    with torch.no_grad():
        ref = hf.eval()(ids[None]).logits[0]
        hidden = ours.target(ids, torch.arange(20), DenseCausal(1, 20, ours.target.attention_scale))
        torch.testing.assert_close(ours.target.logits(hidden), ref, atol=1e-4, rtol=1e-4)


ASSET = Path(__file__).resolve().parents[2] / "services" / "chainspec" / "assets" / "demo"


def test_committed_demo_folder() -> None:
    """The shipped model: small, DeepSeek-named MTP tensors, and a target that
    transformers reads from model.safetensors alone with chainspec's logits."""
    assert sum(p.stat().st_size for p in ASSET.iterdir()) < 40e6
    cfg = ModelConfig.from_dir(ASSET)
    n = cfg.num_layers
    expected = {f"model.layers.{n + i}.{name}" for i in range(K) for name in BLOCK + GLUE}
    assert cfg.num_mtp_layers == K
    assert set(load_file(str(ASSET / "mtp.safetensors"))) == expected
    transformers = tools.transformers()
    from chainspec.models.attention import DenseCausal

    hf, info = transformers.AutoModelForCausalLM.from_pretrained(
        ASSET, dtype=torch.float32, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    target = load_model(ASSET).target
    ids = torch.randint(0, cfg.vocab_size, (64,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf.eval()(ids[None]).logits[0]
        hidden = target(ids, torch.arange(64), DenseCausal(1, 64, target.attention_scale))
        torch.testing.assert_close(target.logits(hidden), ref, atol=1e-4, rtol=1e-4)
