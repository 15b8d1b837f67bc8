"""A tiny model directory the loader accepts, with a byte-level tokenizer and drafts that
the target mostly accepts, so service tests can see speculation work.

Target and MTP blocks have small residual branches (`mix`) and unit norms, and each MTP
module's `eh_proj` passes the token embedding through: the target's next token is then
mostly a function of the current token, and module k predicts it from the same
embedding. Outputs still depend on context (the branches are not zero), so a drafter
that reads the wrong hidden state or position loses acceptance, never output.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from chainspec.training.bpe import CHAT_TEMPLATE
from tests.unit.checkpoints import (
    hf_config,
    mtp_prefix,
    mtp_shapes,
    random_tensors,
    target_shapes,
    write_checkpoint,
)

EOT = "<|endoftext|>"
CORPUS = ["def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n",
          "The quick brown fox jumps over the lazy dog. Ünïcödé: €, 你好, 🙂.\n",
          "for i in range(10):\n    print(i * i)\n"] * 4
# The tiny model's chat template is the demo model's (CHAT_TEMPLATE: a `<|role|>` line
# and the message per turn, then `<|assistant|>` and a newline); `chat_prompt` its text.


def chat_prompt(turns, add_generation_prompt: bool = True) -> str:
    """What CHAT_TEMPLATE renders for `turns` (Turn or (role, content))."""
    pairs = [(t.role, t.content) if hasattr(t, "role") else tuple(t) for t in turns]
    return "".join(f"<|{role}|>\n{content}\n" for role, content in pairs) + \
        ("<|assistant|>\n" if add_generation_prompt else "")


def write_tokenizer(model_dir: Path, vocab_size: int) -> int:
    """Byte-level BPE (any text round-trips; multi-byte characters span tokens).
    Returns the EOT id."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS, trainer=trainer)
    model_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(model_dir / "tokenizer.json"))
    return tok.token_to_id(EOT)


def write_tiny_model(model_dir: Path, num_mtp: int = 1, hidden: int = 32, layers: int = 2,
                     mix: float = 0.3, seed: int = 0) -> Path:
    """Config, tokenizer, `model.safetensors` (Llama target) and `mtp.safetensors`
    (DeepSeek-named modules after the target's layers)."""
    eot = write_tokenizer(model_dir, 300)
    (model_dir / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    vocab = Tokenizer.from_file(str(model_dir / "tokenizer.json")).get_vocab_size()
    cfg = hf_config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                    num_hidden_layers=layers, head_dim=hidden // 4,
                    max_position_embeddings=512, num_nextn_predict_layers=num_mtp,
                    eos_token_id=eot, bos_token_id=eot)
    target = _shape_weights(random_tensors(target_shapes(cfg), seed), mix)
    modules = _shape_weights(random_tensors(mtp_shapes("deepseek", cfg, num_mtp), seed + 1),
                             mix)
    for i in range(num_mtp):  # u = [enorm(emb), hnorm(g)] -> mostly the embedding
        name = f"{mtp_prefix('deepseek', i, cfg)}eh_proj.weight"
        eye = torch.cat([torch.eye(hidden), torch.zeros(hidden, hidden)], dim=1)
        modules[name] = (eye + mix * 0.1 * modules[name]).contiguous()
    return write_checkpoint(model_dir, cfg, {"model.safetensors": target,
                                             "mtp.safetensors": modules})


def _shape_weights(tensors: dict[str, torch.Tensor], mix: float) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in tensors.items():
        if name.endswith("norm.weight"):
            t = torch.ones_like(t)
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            t = t * mix
        out[name] = t.contiguous()
    return out


def write_hf_model(model_dir: Path, architecture: str = "LlamaForCausalLM", hidden: int = 32,
                   layers: int = 2, seed: int = 0) -> Path:
    """A plain target (no MTP modules) as a new user has one: random weights written by
    `transformers`' own `save_pretrained` (its config and tensor names, not ours), with
    the byte-level tokenizer above."""
    import transformers

    eot = write_tokenizer(model_dir, 300)
    vocab = Tokenizer.from_file(str(model_dir / "tokenizer.json")).get_vocab_size()
    family = {"LlamaForCausalLM": "Llama", "Qwen2ForCausalLM": "Qwen2"}[architecture]
    config = getattr(transformers, f"{family}Config")(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=512, eos_token_id=eot, bos_token_id=eot,
        initializer_range=0.1)  # logits far enough apart that greedy has no near-ties
    torch.manual_seed(seed)
    getattr(transformers, architecture)(config).save_pretrained(model_dir)
    return model_dir
