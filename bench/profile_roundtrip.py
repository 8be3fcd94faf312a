"""Where a deepxd's CPU goes per round trip: a daemon started under cProfile (its event loop's thread), sent a
one-instruction program again and again over the native socket, then one deepxIR line again and again over UDP (as
bench/dispatch.py does); the functions that cost most printed for each. Not a benchmark (no peer): the map for
making a round trip cheaper.

    python bench/profile_roundtrip.py [--n 3000] [--top 40]

Writes the text to $OUT/profile_roundtrip.txt when OUT is set.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))

from dispatch import UDP_LINE, free_udp_port, program, udp_round_trip, udp_setup  # noqa: E402  (beside this file)


def daemon(profile: str, sock: str, udp_port: int) -> None:
    """The daemon, profiled from its start to its stop (the requests of each phase are told apart by the
    SIGUSR1 that dumps and resets the profile between them)."""
    from deepxd.cli import main

    prof = [cProfile.Profile()]
    phase = [0]

    def dump(*_: object) -> None:
        prof[0].disable()
        prof[0].dump_stats(f"{profile}.{phase[0]}")
        phase[0] += 1
        prof[0] = cProfile.Profile()
        prof[0].enable()

    signal.signal(signal.SIGUSR1, dump)
    sys.argv = ["deepxd", "start", "--listen", f"unix://{sock}", "--udp", f"127.0.0.1:{udp_port}", "--kv", "memory",
                "--node-id", "profile", "--log-level", "warning"]
    prof[0].enable()
    try:
        main()
    except SystemExit:
        pass
    finally:
        dump()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=3000)
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--daemon", nargs=3, help=argparse.SUPPRESS)
    opts = ap.parse_args()
    if opts.daemon:
        daemon(opts.daemon[0], opts.daemon[1], int(opts.daemon[2]))
        return
    import numpy as np

    from deepx_sdk.client import NativeClient

    tmp = tempfile.mkdtemp(prefix="deepx-profile-")
    sock, profile, udp_port = f"{tmp}/deepxd.sock", f"{tmp}/prof", free_udp_port()
    env = {**os.environ, "DEEPX_NATIVE_BACKGROUND": "0"}
    proc = subprocess.Popen([sys.executable, __file__, "--daemon", profile, sock, str(udp_port)], env=env)
    out = io.StringIO()
    try:
        for _ in range(400):
            try:
                NativeClient(f"unix://{sock}").close()
                break
            except Exception:
                time.sleep(0.05)
        with NativeClient(f"unix://{sock}") as cl:
            cl.put("a", np.ones(1024, np.float32))
            cl.put("b", np.ones(1024, np.float32))
            one = program(1)
            for _ in range(300):
                cl.run(one).raise_for_error()
            udp_setup(udp_port)
            udp_round_trip(udp_port, 300, (UDP_LINE,), check=True)
            phases = []
            for name, fn in (("native run, one instruction", lambda: [cl.run(one) for _ in range(opts.n)]),
                             ("deepxIR line over UDP", lambda: udp_round_trip(udp_port, opts.n, (UDP_LINE,)))):
                proc.send_signal(signal.SIGUSR1)  # what came before is phase k, this one k + 1
                time.sleep(0.3)
                t0 = time.perf_counter()
                fn()
                phases.append((name, (time.perf_counter() - t0) / opts.n))
            proc.send_signal(signal.SIGUSR1)
            time.sleep(0.3)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    for k, (name, t) in enumerate(phases, start=1):
        st = pstats.Stats(f"{profile}.{k}", stream=out)
        out.write(f"\n== {name}: {opts.n} requests, {t * 1e6:.1f} us each under the profiler; "
                  f"{st.total_tt / opts.n * 1e6:.1f} us profiled per request\n")
        st.sort_stats("tottime").print_stats(opts.top)
        st.sort_stats("cumulative").print_stats(opts.top)
    text = out.getvalue()
    print(text)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "profile_roundtrip.txt").write_text(text)


if __name__ == "__main__":
    main()
