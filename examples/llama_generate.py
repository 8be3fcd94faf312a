"""A small LLaMA-style decoder (RMSNorm, rotary embeddings, grouped-query attention, SwiGLU) written once as plain
PyTorch code, run with deepx, generating text with a key/value cache.

    python examples/llama_generate.py [--weights model.safetensors] [--tokens 64] [--temperature 0]

`build(torch, nn, F)` defines the model for whichever framework it is handed: `build(dx, dx.nn, dx.nn.functional)`
for deepx, `build(torch, torch.nn, torch.nn.functional)` for torch; the weights are a safetensors file either one
wrote (without --weights, random weights from a seed: the output is noise, the mechanics are not). Bytes are the
tokens (a vocabulary of 256). Each attention layer keeps its keys and values in buffers (`register_buffer`, not
saved with the weights): in deepx, heap tensors the daemon keeps. The cache is static, as Hugging Face's
StaticCache: each step writes its keys and values at its positions (`index_copy_`, in place) and attends to all
`max_len` cached positions under a mask, so that every decoding step is the same program (deepx's daemon plans it
once and replays the plan). Decoding runs the prompt once, filling each layer's cache, then one token at a time,
each step reading the cache instead of recomputing the prefix; `generate(..., use_cache=False)` recomputes the
whole sequence every step, which gives the same tokens. A greedy step is `next_token`, which deepx runs under
`dx.compile`: captured once, then replayed with the token and its position as inputs.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from typing import Any


@dataclass
class Config:
    vocab: int = 256
    dim: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    hidden: int = 176
    max_len: int = 256
    max_batch: int = 1  # the key/value cache's rows: the largest batch decoded with the cache
    rope_theta: float = 10000.0
    eps: float = 1e-5


def build(torch: Any, nn: Any, F: Any, cfg: Config) -> Any:
    """The model class for one framework (torch, or deepx as `torch`): the same code for both."""

    class RMSNorm(nn.Module):
        def __init__(self, dim: int, eps: float) -> None:
            super().__init__()
            self.eps = eps
            self.weight = nn.Parameter(torch.ones(dim))

        def forward(self, x: Any) -> Any:  # x * rsqrt(mean(x^2) + eps) * weight, one op (deepx's rmsnorm)
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)

    def rotate_half(x: Any) -> Any:
        half = x.shape[-1] // 2
        return torch.cat([-x[..., half:], x[..., :half]], dim=-1)

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.head_dim = cfg.dim // cfg.heads
            self.wq = nn.Linear(cfg.dim, cfg.heads * self.head_dim, bias=False)
            self.wk = nn.Linear(cfg.dim, cfg.kv_heads * self.head_dim, bias=False)
            self.wv = nn.Linear(cfg.dim, cfg.kv_heads * self.head_dim, bias=False)
            self.wo = nn.Linear(cfg.heads * self.head_dim, cfg.dim, bias=False)
            shape = (cfg.max_batch, cfg.kv_heads, cfg.max_len, self.head_dim)
            self.register_buffer("k_cache", torch.zeros(shape), persistent=False)
            self.register_buffer("v_cache", torch.zeros(shape), persistent=False)

        def forward(self, x: Any, positions: Any, cos: Any, sin: Any, mask: Any) -> Any:
            b, n, _ = x.shape
            q = self.wq(x).view(b, n, cfg.heads, self.head_dim).transpose(1, 2)
            k = self.wk(x).view(b, n, cfg.kv_heads, self.head_dim).transpose(1, 2)
            v = self.wv(x).view(b, n, cfg.kv_heads, self.head_dim).transpose(1, 2)
            q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
            if mask is not None:  # the cache: keys and values written at their positions, every position read
                if b < cfg.max_batch:  # rows past the batch get zeros, never read
                    k, v = (F.pad(t, (0, 0, 0, 0, 0, 0, 0, cfg.max_batch - b)) for t in (k, v))
                self.k_cache.index_copy_(2, positions, k)
                self.v_cache.index_copy_(2, positions, v)
                k, v = self.k_cache[:b], self.v_cache[:b]
            # grouped-query heads: each key/value head serves heads // kv_heads query heads; without the cache the
            # keys are the queries' own positions (causal), with it all max_len of them, masked
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None and n > 1,
                                                 enable_gqa=True)
            return self.wo(out.transpose(1, 2).reshape(b, n, cfg.heads * self.head_dim))

    class FeedForward(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w1 = nn.Linear(cfg.dim, cfg.hidden, bias=False)
            self.w3 = nn.Linear(cfg.dim, cfg.hidden, bias=False)
            self.w2 = nn.Linear(cfg.hidden, cfg.dim, bias=False)

        def forward(self, x: Any) -> Any:
            return self.w2(F.silu(self.w1(x)) * self.w3(x))

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attention_norm = RMSNorm(cfg.dim, cfg.eps)
            self.attention = Attention()
            self.ffn_norm = RMSNorm(cfg.dim, cfg.eps)
            self.feed_forward = FeedForward()

        def forward(self, x: Any, positions: Any, cos: Any, sin: Any, mask: Any) -> Any:
            h = x + self.attention(self.attention_norm(x), positions, cos, sin, mask)
            return h + self.feed_forward(self.ffn_norm(h))

    class Llama(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok_embeddings = nn.Embedding(cfg.vocab, cfg.dim)
            self.layers = nn.ModuleList([Block() for _ in range(cfg.layers)])
            self.norm = RMSNorm(cfg.dim, cfg.eps)
            self.output = nn.Linear(cfg.dim, cfg.vocab, bias=False)
            head_dim = cfg.dim // cfg.heads
            inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, head_dim, 2).float() / head_dim))
            freqs = torch.outer(torch.arange(cfg.max_len).float(), inv)
            self.register_buffer("cos", torch.cat([freqs.cos(), freqs.cos()], dim=-1), persistent=False)
            self.register_buffer("sin", torch.cat([freqs.sin(), freqs.sin()], dim=-1), persistent=False)
            self.register_buffer("key_positions", torch.arange(cfg.max_len), persistent=False)

        def forward(self, tokens: Any, pos: Any = 0, use_cache: bool = False) -> Any:
            # the positions as a tensor, not as constants of slices: every decoding step is then the same program,
            # which deepx's daemon plans once and replays (docs/decisions/0045); `pos`: that tensor, or the first
            positions = torch.tensor(list(range(pos, pos + tokens.shape[1]))) if isinstance(pos, int) else pos
            cos, sin = F.embedding(positions, self.cos), F.embedding(positions, self.sin)  # the tables' rows
            # query i (at positions[i]) sees the cached keys at positions <= its own
            mask = self.key_positions <= positions.unsqueeze(-1) if use_cache else None
            h = self.tok_embeddings(tokens)
            for layer in self.layers:
                h = layer(h, positions, cos, sin, mask)
            return self.output(self.norm(h))

    return Llama


def next_token(model: Any, tokens: Any, positions: Any) -> Any:
    """One greedy decoding step with the cache: each row's most likely token after `tokens` at `positions` (a
    tensor). A function of tensors alone, so that `dx.compile(next_token)` captures it once and replays it for every
    token, the position an input: no Python runs the model again (docs/decisions/0048)."""
    return model(tokens, positions, True)[:, -1].argmax(-1)


def generate(torch: Any, model: Any, prompt: list[int], n: int, temperature: float = 0.0,
             use_cache: bool = True, step: Any = next_token) -> list[int]:
    """`n` tokens after `prompt`: greedy (temperature 0) or sampled from softmax(logits / temperature). `step`:
    the greedy step with the cache, `next_token` or it compiled (`dx.compile(next_token)`)."""
    tokens = list(prompt)
    with torch.no_grad():
        logits = model(torch.tensor([tokens]), 0, use_cache)
        for _ in range(n):
            if logits is not None:
                last = logits[0, -1]
                if temperature > 0:
                    nxt = int(torch.multinomial((last / temperature).softmax(-1), 1).item())
                else:
                    nxt = int(last.argmax().item())
            tokens.append(nxt)
            if use_cache and temperature == 0:  # the token itself comes back, not the logits
                logits, nxt = None, int(step(model, torch.tensor([[nxt]]), torch.tensor([len(tokens) - 1])).item())
            elif use_cache:
                logits = model(torch.tensor([[nxt]]), len(tokens) - 1, True)
            else:
                logits = model(torch.tensor([tokens]), 0, False)
    return tokens[len(prompt):]


def main() -> None:
    import deepx_sdk as dx

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--weights", default=None, help="a safetensors file of this architecture (torch's names)")
    ap.add_argument("--prompt", default="First Citizen:\n")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--address", default=None, help="a running deepxd (unix:///...); default: embedded")
    opts = ap.parse_args()
    dx.connect(opts.address)
    dx.manual_seed(0)
    cfg = Config()
    model = build(dx, dx.nn, dx.nn.functional, cfg)()
    if opts.weights:
        model.load_state_dict(dx.io.load(opts.weights))
    prompt = list(opts.prompt.encode())
    started = time.perf_counter()
    out = generate(dx, model, prompt, opts.tokens, opts.temperature, step=dx.compile(next_token))
    took = time.perf_counter() - started
    print(repr(bytes(out).decode("utf-8", "replace")))
    print(f"{len(out)} tokens in {took:.2f} s ({len(out) / took:.1f} tokens/s; {cfg.layers} layers, dim {cfg.dim}, "
          f"{cfg.heads} query and {cfg.kv_heads} key/value heads)")


if __name__ == "__main__":
    main()
