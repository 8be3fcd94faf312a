"""What importing costs: `import deepx_sdk` and `deepxctl` leave out what they do not need yet (ml_dtypes, yaml,
asyncio, rich, the daemon) and load it on first use, with the same results (issue 27, item 2; bench/startup.py times
it). Each case runs in a fresh interpreter."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def fresh(code: str) -> dict:
    """The JSON that `code` prints last, run in a new interpreter."""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


LOADED = "[m for m in {mods!r} if m in sys.modules]"


def test_import_deepx_sdk_leaves_out_what_no_tensor_needs_yet() -> None:
    mods = ("ml_dtypes", "yaml", "asyncio", "rich", "deepxd", "click", "torch")
    out = fresh(f"import json, sys; import deepx_sdk; print(json.dumps({LOADED.format(mods=mods)}))")
    assert out == []


def test_a_float32_session_never_imports_ml_dtypes_and_bfloat16_loads_it() -> None:
    out = fresh("""if True:
        import json, sys
        import numpy as np
        import deepx_sdk as dx
        x = dx.tensor(np.arange(6, dtype=np.float32)).reshape(2, 3)
        total = float((x * 2).sum().item())
        before = "ml_dtypes" in sys.modules
        h = x.to(dx.bfloat16)
        after = "ml_dtypes" in sys.modules
        print(json.dumps({"total": total, "before": before, "after": after, "dtype": str(h.dtype),
                          "values": h.float().numpy().tolist()}))
    """)
    assert out == {"total": 30.0, "before": False, "after": True, "dtype": "bfloat16",
                   "values": [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]}


def test_an_ml_dtypes_array_made_after_import_is_recognised() -> None:
    """ml_dtypes imported by the program after deepx (not through it): its arrays still map to deepx precisions."""
    out = fresh("""if True:
        import json, sys
        from deepx_core.ir.dtypes import LOW_NUMPY, from_numpy, itemsize
        sizes = [itemsize(p) for p in ("bfloat16", "float8e5m2", "float8e4m3")]
        loaded = "ml_dtypes" in sys.modules
        import ml_dtypes, numpy as np
        names = [from_numpy(np.dtype(t)) for t in (ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn)]
        print(json.dumps({"sizes": sizes, "loaded": loaded, "names": names,
                          "low": np.dtype(ml_dtypes.bfloat16) in LOW_NUMPY}))
    """)
    assert out == {"sizes": [2, 1, 1], "loaded": False, "names": ["bfloat16", "float8e4m3"], "low": True}


def test_deepxctl_talks_to_a_daemon_without_the_sdk() -> None:
    """A listing needs the native client (deepx_core.client), not the SDK and its tensors."""
    out = fresh("""if True:
        import json, sys
        from deepxctl import context, term
        from deepx_core.client import NativeClient
        print(json.dumps([m for m in ("deepx_sdk", "deepxd", "ml_dtypes", "yaml", "asyncio") if m in sys.modules]))
    """)
    assert out == []
