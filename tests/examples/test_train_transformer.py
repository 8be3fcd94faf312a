"""examples/train_transformer.py: a character-level transformer trained through the embedded daemon halves its loss,
then samples text of the requested length from the training text's vocabulary."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
EXAMPLE = EXAMPLES / "train_transformer.py"
TEXT = EXAMPLES / "data" / "coriolanus.txt"


def run_example(tmp_path: Path, *args: str) -> str:
    p = subprocess.run([sys.executable, str(EXAMPLE), *args], capture_output=True, text=True, timeout=300,
                       cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stdout


def test_short_run_halves_the_loss_and_samples(tmp_path):
    # a small model on the first 500 characters: it learns them quickly, so a short run halves the loss
    prompt = "First Citizen:\n"
    out = run_example(tmp_path, "--chars", "500", "--steps", "120", "--batch", "16", "--context", "16",
                      "--d-model", "32", "--heads", "2", "--layers", "1", "--lr", "2e-2", "--prompt", prompt,
                      "--sample", "40", "--temperature", "0.8")
    m = re.search(r"loss (\d+\.\d+) -> (\d+\.\d+)", out)
    assert m, out
    first, last = float(m.group(1)), float(m.group(2))
    assert first > 3.0, out  # an untrained model is about ln(vocabulary) = ln(58)
    assert last < first / 2, out
    m = re.search(r"sample \((\d+) characters, temperature 0\.8\):\n", out)
    assert m, out
    assert int(m.group(1)) == 40
    text = out[m.end():]
    assert text.startswith(prompt)
    sample = text[len(prompt):len(prompt) + 40]
    assert len(sample) == 40
    vocabulary = set(TEXT.read_text(encoding="utf-8"))
    assert set(sample) <= vocabulary, set(sample) - vocabulary


def test_bf16_mixed_precision_trains(tmp_path):
    out = run_example(tmp_path, "--chars", "500", "--steps", "60", "--batch", "16", "--context", "16", "--d-model",
                      "32", "--heads", "2", "--layers", "1", "--lr", "2e-2", "--sample", "5", "--bf16")
    m = re.search(r"loss (\d+\.\d+) -> (\d+\.\d+)", out)
    assert m, out
    assert float(m.group(2)) < float(m.group(1)) * 0.75, out


def test_greedy_sampling_is_deterministic(tmp_path):
    args = ("--chars", "500", "--steps", "3", "--d-model", "16", "--heads", "2", "--layers", "1", "--context", "8",
            "--prompt", "MENENIUS:", "--sample", "25", "--temperature", "0")
    first, second = run_example(tmp_path, *args), run_example(tmp_path, *args)
    m = re.search(r"sample \(25 characters, temperature 0\.0\):\nMENENIUS:(.{25})", first, re.S)
    assert m, first
    assert m.group(0) in second  # manual_seed(0) and argmax decoding: the same text each run


def test_a_prompt_outside_the_vocabulary_is_refused(tmp_path):
    p = subprocess.run([sys.executable, str(EXAMPLE), "--steps", "1", "--chars", "200", "--prompt", "~{~",
                        "--sample", "2"], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert p.returncode != 0
    assert "not in the training text's vocabulary" in p.stderr


def load_example():
    if str(EXAMPLES) not in sys.path:  # as running the script puts its folder first: it imports examples/bars.py
        sys.path.insert(0, str(EXAMPLES))
    spec = importlib.util.spec_from_file_location("train_transformer", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class TorchBlock(torch.nn.Module):
    """The example's Block, in torch, with the same parameter names."""

    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.ln1 = torch.nn.LayerNorm(d_model)
        self.attn = torch.nn.Module()
        for name in ("query", "key", "value", "proj"):
            setattr(self.attn, name, torch.nn.Linear(d_model, d_model))
        self.ln2 = torch.nn.LayerNorm(d_model)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(d_model, 4 * d_model), torch.nn.GELU(approximate="tanh"),
                                       torch.nn.Linear(4 * d_model, d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        h = self.ln1(x)
        q, k, v = (getattr(self.attn, n)(h).view(B, T, self.n_heads, -1).transpose(1, 2)
                   for n in ("query", "key", "value"))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attn.proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.mlp(self.ln2(x))


def test_model_gradients_match_torch():
    """The whole model (embeddings, two blocks, final norm, head) and its cross-entropy: loss and every
    parameter's gradient against torch autograd from the same weights."""
    import deepx_sdk as dx
    import deepx_sdk.nn.functional as F

    ex = load_example()
    vocab, context, d_model, heads, layers = 11, 8, 16, 2, 2
    dx.manual_seed(1)
    model = ex.CharTransformer(vocab, context, d_model, heads, layers)
    ref = torch.nn.Module()
    ref.tok_emb = torch.nn.Embedding(vocab, d_model)
    ref.pos_emb = torch.nn.Embedding(context, d_model)
    ref.blocks = torch.nn.ModuleList([TorchBlock(d_model, heads) for _ in range(layers)])
    ref.ln_f = torch.nn.LayerNorm(d_model)
    ref.head = torch.nn.Linear(d_model, vocab)
    weights = {k: torch.from_numpy(v.numpy()) for k, v in model.state_dict().items()}
    assert set(weights) == set(ref.state_dict())
    ref.load_state_dict(weights)

    rng = np.random.default_rng(0)
    idx = rng.integers(0, vocab, (3, context + 1))
    x, y = idx[:, :-1], idx[:, 1:]
    loss = F.cross_entropy(model(dx.tensor(x)).view(-1, vocab), dx.tensor(y).view(-1))
    loss.backward()
    h = ref.tok_emb(torch.from_numpy(x)) + ref.pos_emb(torch.arange(context))
    for block in ref.blocks:
        h = block(h)
    want = torch.nn.functional.cross_entropy(ref.head(ref.ln_f(h)).reshape(-1, vocab), torch.from_numpy(y).reshape(-1))
    want.backward()
    np.testing.assert_allclose(loss.item(), want.item(), rtol=1e-5)
    grads = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        np.testing.assert_allclose(p.grad.numpy(), grads[name].grad.numpy(), rtol=1e-3, atol=1e-5, err_msg=name)
