"""examples/llama_generate.py: the LLaMA-style decoder written once runs on torch and on deepx from one safetensors
file written by torch, to the same logits and the same greedy tokens; decoding with the key/value cache equals
recomputing the whole sequence, eager or with the step compiled."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import deepx_sdk as dx

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "llama_generate.py"
spec = importlib.util.spec_from_file_location("llama_generate", EXAMPLE)
assert spec is not None and spec.loader is not None
llama = importlib.util.module_from_spec(spec)
sys.modules["llama_generate"] = llama  # (its dataclass looks its module up)
spec.loader.exec_module(llama)


@pytest.fixture
def pair(tmp_path):
    cfg = llama.Config(max_len=64)
    torch.manual_seed(0)
    theirs = llama.build(torch, torch.nn, torch.nn.functional, cfg)()
    with torch.no_grad():  # RMSNorm weights away from 1, so that they matter
        for name, p in theirs.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    path = tmp_path / "llama.safetensors"
    save_file({k: v.contiguous() for k, v in theirs.state_dict().items()}, str(path))
    ours = llama.build(dx, dx.nn, dx.nn.functional, cfg)()
    ours.load_state_dict(dx.io.load(str(path)))
    return cfg, ours, theirs


def test_the_same_logits_as_torch(pair):
    _, ours, theirs = pair
    tokens = np.random.default_rng(1).integers(0, 256, (2, 12))
    with torch.no_grad():
        want = theirs(torch.tensor(tokens)).numpy()
    with dx.no_grad():
        got = ours(dx.tensor(tokens)).numpy()
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-5)


def test_cached_decoding_equals_recomputation_and_torch(pair):
    _, ours, theirs = pair
    prompt = list(b"Hello, ")
    cached = llama.generate(dx, ours, prompt, 12)
    assert cached == llama.generate(dx, ours, prompt, 12, use_cache=False)
    assert cached == llama.generate(torch, theirs, prompt, 12)
    step = dx.compile(llama.next_token)  # captured once, replayed for every later token and call
    assert cached == llama.generate(dx, ours, prompt, 12, step=step)
    assert cached == llama.generate(dx, ours, prompt, 12, step=step)
    assert len(step.graph_names) == 1
    # the cache's logits, step by step, are the full recomputation's
    seq = prompt + cached
    with dx.no_grad():
        full = ours(dx.tensor([seq])).numpy()[0]
        first = ours(dx.tensor([prompt]), 0, True).numpy()[0]
        steps = [ours(dx.tensor([[t]]), len(prompt) + i, True).numpy()[0, 0] for i, t in enumerate(cached[:-1])]
    np.testing.assert_allclose(np.concatenate([first, np.stack(steps)]), full[:-1], rtol=1e-4, atol=1e-5)


def test_sampling_is_reproducible_with_and_without_the_cache(pair):
    _, ours, _ = pair
    dx.manual_seed(5)
    a = llama.generate(dx, ours, list(b"ab"), 10, temperature=0.8)
    dx.manual_seed(5)
    b = llama.generate(dx, ours, list(b"ab"), 10, temperature=0.8, use_cache=False)
    assert a == b and len(a) == 10 and all(0 <= t < 256 for t in a)


def test_a_batch_smaller_than_the_cache_decodes_as_recomputation(pair):
    """Two rows through a cache of three: the third row is written with zeros and never read."""
    _, ours, theirs = pair
    cfg = llama.Config(max_len=64, max_batch=3)
    seq = np.random.default_rng(2).integers(0, 256, (2, 9))
    for lib, model, state in ((torch, llama.build(torch, torch.nn, torch.nn.functional, cfg)(), theirs.state_dict()),
                              (dx, llama.build(dx, dx.nn, dx.nn.functional, cfg)(), ours.state_dict())):
        model.load_state_dict(state)
        with lib.no_grad():
            full = model(lib.tensor(seq)).numpy()
            first = model(lib.tensor(seq[:, :6]), 0, True).numpy()
            steps = [model(lib.tensor(seq[:, i:i + 1]), i, True).numpy() for i in range(6, 9)]
        np.testing.assert_allclose(np.concatenate([first, *steps], axis=1), full, rtol=1e-4, atol=1e-5,
                                   err_msg=lib.__name__)
