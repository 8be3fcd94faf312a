"""Train a small character-level transformer on a Shakespeare excerpt with deepx, then sample text from a prompt.

    python examples/train_transformer.py [--steps 600] [--prompt "MENENIUS:"] [--bf16] [--address unix:///path/deepxd.sock]

With no address the SDK starts an embedded deepxd inside this process. The model is a GPT-style decoder: token and
position embeddings, pre-norm blocks of causal multi-head self-attention and a GELU MLP with residuals, a final
layer norm and a linear head; it is written exactly as in PyTorch, with `dx` in place of `torch`.

The text, examples/data/coriolanus.txt, is the opening of William Shakespeare's *Coriolanus* (public domain), the
first 32 KB of the "tinyshakespeare" collection of Karpathy's char-rnn (github.com/karpathy/char-rnn).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
from bars import progress_bar  # examples/bars.py

import deepx_sdk as dx
import deepx_sdk.nn as nn
import deepx_sdk.nn.functional as F
from deepx_sdk.optim import AdamW, CosineAnnealingLR

DATA = Path(__file__).resolve().parent / "data" / "coriolanus.txt"


class CharTokenizer:
    """One token per distinct character of the training text."""

    def __init__(self, text: str) -> None:
        self.chars = sorted(set(text))
        self.index = {c: i for i, c in enumerate(self.chars)}

    def __len__(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> np.ndarray:
        unknown = sorted(set(text) - set(self.index))
        if unknown:
            raise ValueError(f"characters {unknown!r} are not in the training text's vocabulary")
        return np.array([self.index[c] for c in text], dtype=np.int64)

    def decode(self, ids: np.ndarray) -> str:
        return "".join(self.chars[int(i)] for i in ids)


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model {d_model} must be a multiple of n_heads {n_heads}")
        self.n_heads = n_heads
        self.query = nn.Linear(d_model, d_model)
        self.key = nn.Linear(d_model, d_model)
        self.value = nn.Linear(d_model, d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: dx.Tensor) -> dx.Tensor:
        B, T, C = x.shape
        H = self.n_heads
        q = self.query(x).view(B, T, H, C // H).transpose(1, 2)  # (B, H, T, head size)
        k = self.key(x).view(B, T, H, C // H).transpose(1, 2)
        v = self.value(x).view(B, T, H, C // H).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class Block(nn.Module):
    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(approximate="tanh"),
                                 nn.Linear(4 * d_model, d_model))

    def forward(self, x: dx.Tensor) -> dx.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class CharTransformer(nn.Module):
    def __init__(self, vocab: int, context: int, d_model: int, n_heads: int, n_layers: int) -> None:
        super().__init__()
        self.context = context
        self.tok_emb = nn.Embedding(vocab, d_model)
        self.pos_emb = nn.Embedding(context, d_model)
        self.blocks = nn.ModuleList([Block(d_model, n_heads) for _ in range(n_layers)])
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab)

    def forward(self, idx: dx.Tensor) -> dx.Tensor:
        T = idx.shape[1]
        if T > self.context:
            raise ValueError(f"sequence of {T} tokens is longer than the context ({self.context})")
        x = self.tok_emb(idx) + self.pos_emb(dx.arange(T))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))  # (B, T, vocab) logits


@dx.no_grad()
def generate(model: CharTransformer, prompt: dx.Tensor, new_tokens: int, temperature: float = 1.0) -> dx.Tensor:
    """Extend (1, T) token ids by new_tokens, one at a time: greedy when temperature is 0, else sampled from the
    softmax of logits / temperature. Nothing is read back until the caller asks for the result."""
    idx = prompt
    for _ in range(new_tokens):
        logits = model(idx[:, -model.context:])[:, -1, :]  # the last position's prediction
        if temperature == 0:
            nxt = logits.argmax(-1, keepdim=True)
        else:
            nxt = F.softmax(logits / temperature, dim=-1).multinomial(1)
        idx = dx.cat([idx, nxt], dim=1)
    return idx


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--context", type=int, default=32)
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--lr", type=float, default=4e-3)
    ap.add_argument("--chars", type=int, default=None, help="train on only the first CHARS characters of the text")
    ap.add_argument("--prompt", default="MENENIUS:\n")
    ap.add_argument("--sample", type=int, default=200, help="characters to generate after training")
    ap.add_argument("--temperature", type=float, default=0.8, help="0 for greedy decoding")
    ap.add_argument("--bf16", action="store_true",
                    help="mixed precision: matmuls in bfloat16 (tensor cores on a GPU), the rest in float32")
    ap.add_argument("--address", default=None, help="a running deepxd (unix:///...); default: embedded")
    opts = ap.parse_args()

    dx.connect(opts.address)
    dx.manual_seed(0)
    text = DATA.read_text(encoding="utf-8")
    tok = CharTokenizer(text)  # the whole text's vocabulary, so any prompt from it encodes
    data = tok.encode(text[:opts.chars] if opts.chars else text)
    try:
        prompt_ids = tok.encode(opts.prompt)
    except ValueError as e:
        raise SystemExit(f"--prompt: {e}") from None
    if len(data) <= opts.context + 1:
        raise SystemExit(f"--chars {opts.chars} leaves too little text for a context of {opts.context}")
    model = CharTransformer(len(tok), opts.context, opts.d_model, opts.heads, opts.layers)
    params = sum(p.numel() for p in model.parameters())
    print(f"{params} parameters, vocabulary {len(tok)}, {len(data)} characters of text")
    opt = AdamW(model.parameters(), lr=opts.lr, betas=(0.9, 0.99), weight_decay=0.01)
    schedule = CosineAnnealingLR(opt, T_max=opts.steps, eta_min=opts.lr / 10)
    rng = np.random.default_rng(0)
    losses: list[float] = []
    started = time.perf_counter()
    with progress_bar() as progress:
        task = progress.add_task("training", total=opts.steps)
        for step in range(opts.steps):
            starts = rng.integers(0, len(data) - opts.context - 1, opts.batch)
            window = np.stack([data[s:s + opts.context + 1] for s in starts])
            x, y = dx.tensor(window[:, :-1]), dx.tensor(window[:, 1:])
            opt.zero_grad()
            with dx.autocast(dtype="bfloat16", enabled=opts.bf16):
                logits = model(x)
                loss = F.cross_entropy(logits.view(-1, len(tok)), y.view(-1))
            loss.backward()
            opt.step()
            schedule.step()
            losses.append(loss.item())
            progress.update(task, advance=1, description=f"step {step + 1} loss {losses[-1]:.4f}")
    tail = losses[-min(10, len(losses)):]  # one batch's loss is noisy: the last steps' mean
    print(f"loss {losses[0]:.4f} -> {sum(tail) / len(tail):.4f} (first step -> mean of the last {len(tail)}) "
          f"after {opts.steps} steps in {time.perf_counter() - started:.1f} s")

    model.eval()
    out = generate(model, dx.tensor(prompt_ids[None, :]), opts.sample, opts.temperature).numpy()[0]
    sample = tok.decode(out[len(opts.prompt):])
    print(f"sample ({len(sample)} characters, temperature {opts.temperature}):")
    print(opts.prompt + sample)


if __name__ == "__main__":
    main()
