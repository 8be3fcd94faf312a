"""examples/train_transformer.py: a character-level transformer trained through the embedded daemon halves its loss,
then samples text of the requested length from the training text's vocabulary."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

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
