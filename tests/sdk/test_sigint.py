"""The embedded daemon's fast path (Scheduler.now_run, LoopThread.now) does not depend on SIGINT's disposition: a
training loop takes it with SIGINT ignored (a job started with `&`) or handled by the program itself (issue 27,
item 1). Each case runs in a subprocess, so that the disposition is the one it starts with."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

CHILD = textwrap.dedent("""
    import json, signal, sys
    import numpy as np
    import deepx_sdk as dx
    import deepx_sdk.nn as nn
    import deepx_sdk.nn.functional as F
    from deepx_sdk.optim import SGD
    from deepxd.actors.messages import SchedulerStats

    if sys.argv[1] == "own":
        signal.signal(signal.SIGINT, lambda signum, frame: None)  # a script's own Ctrl-C handler (a checkpoint)
    rng = np.random.default_rng(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    opt = SGD(model.parameters(), lr=0.05)
    x, y = dx.tensor(rng.standard_normal((32, 8)).astype(np.float32)), dx.tensor(rng.integers(0, 3, 32))
    losses = []
    for _ in range(20):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    t = dx.session().transport
    stats = t._call(t.node.ref("scheduler").ask(SchedulerStats()))
    print(json.dumps({"sigint": repr(signal.getsignal(signal.SIGINT)), "now_hits": stats["now_hits"],
                      "plan_hits": stats["plan_hits"], "first": losses[0], "last": losses[-1]}))
""")


@pytest.mark.parametrize("disposition", ["ignored", "own"])
def test_a_training_loop_takes_the_fast_path_whatever_sigint_does(disposition: str) -> None:
    def ignore_sigint() -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # as a shell does for a job started with `&`

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("DEEPX_ADDRESS", None)
    proc = subprocess.run([sys.executable, "-c", CHILD, disposition], capture_output=True, text=True, timeout=300,
                          env=env, cwd=ROOT, preexec_fn=ignore_sigint if disposition == "ignored" else None)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    if disposition == "ignored":
        assert out["sigint"] == repr(signal.SIG_IGN)
    else:
        assert "lambda" in out["sigint"]
    # from the third step on, each repeats the program of the step two before it (the pool hands names out in two
    # orders): from the fifth on (16 of 20) each runs by its plan on this thread; a plan hit by an ask comes only
    # before the loop settles (the second step's backward, sent on its own)
    assert out["now_hits"] >= 14 and out["plan_hits"] - out["now_hits"] <= 2, out
    assert out["last"] < out["first"]
