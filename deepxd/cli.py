"""`deepxd`: start a daemon with chosen roles, show its effective configuration, print the version."""

from __future__ import annotations

import sys

import click

from deepx_core import __version__


def _setup_logging(level: str) -> None:
    import logging

    if sys.stderr.isatty():
        from rich.logging import RichHandler

        handler: logging.Handler = RichHandler(show_path=False, rich_tracebacks=True)
        fmt = "%(message)s"
    else:
        handler = logging.StreamHandler()
        fmt = "%(asctime)s %(levelname)s %(name)s: %(message)s"
    logging.basicConfig(level=level.upper(), format=fmt, handlers=[handler], force=True)


def _config(config_path, **flags):
    from deepxd.config import default_config_file, load_config

    return load_config(config_path or default_config_file(), **flags).resolved()


_options = [
    click.option("--role", "roles", help="Comma list of roles: registry,heapmem,scheduler,op-cpu,op-cuda "
                 "(default: every role this machine can run)."),
    click.option("--kv", help="Storage plane: memory, memory:///path/file (persisted) or redis://host:port/db."),
    click.option("--kv-password-file", help="A file (mode 0600) whose first line is the Redis password; also "
                 "DEEPX_KV_PASSWORD. Never put a password in --kv: every local user can read a command line."),
    click.option("--listen", multiple=True,
                 help="Native listener (repeatable): unix:///path (default: under the user's runtime directory; "
                 "always one) and tcp://HOST:PORT (a token is needed off loopback)."),
    click.option("--token-file", help="A file (mode 0600) whose first line is the token TCP clients prove they hold; "
                 "also DEEPX_TOKEN. Never a flag's value: every local user can read a command line."),
    click.option("--tls-cert", help="A PEM certificate (chain): the TCP listener speaks TLS (with --tls-key)."),
    click.option("--tls-key", help="The TLS certificate's private key (PEM)."),
    click.option("--udp", help="deepxIR text over UDP: HOST:PORT (default 127.0.0.1:9090) or off."),
    click.option("--udp-remote", type=int, default=None, metavar="0|1",
                 help="1: allow --udp on an address that is not loopback; deepxIR over UDP is unauthenticated."),
    click.option("--config", "config_path", type=click.Path(dir_okay=False),
                 help="TOML config file (default: $DEEPX_CONFIG, else ./config/deepxd.toml if present)."),
    click.option("--node-id", help="This node's id in the storage plane (default: the host name)."),
    click.option("--peer-timeout", "peer_timeout_s", type=float, default=None, metavar="SECONDS",
                 help="Another node silent this long (no heartbeat in the plane, none over its peer link) is dead: "
                 "its heap tensors unreachable, its holds released (default 10)."),
    click.option("--peer-idle", "peer_idle_s", type=float, default=None, metavar="SECONDS",
                 help="A peer link no request used this long is closed; links open when something needs them "
                 "(default 60)."),
    click.option("--placement", "placement", type=click.Choice(["cost", "local"]), default=None,
                 help="cost: a program's instructions may run on other nodes' workers where the cost model says it "
                 "pays (docs/cluster.md); local: all on this node's worker (default cost)."),
    click.option("--io-root", "io_roots", multiple=True,
                 help="A directory save/load may touch (repeatable; default: the working and temp directories)."),
    click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default=None),
]


def _with_options(f):
    for opt in reversed(_options):
        f = opt(f)
    return f


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="deepxd")
def main() -> None:
    """deepxd: the deepx daemon. One process, one asyncio loop, an actor per role.

    Settings come from defaults < the config file < DEEPX_* environment variables < flags."""


@main.command()
@_with_options
def start(config_path, **flags) -> None:
    """Start a daemon and serve until SIGINT/SIGTERM (a second signal forces the exit)."""
    from deepx_core.errors import DeepxError

    try:
        config = _config(config_path, **flags)
    except DeepxError as e:
        click.echo(f"deepxd: {e}", err=True)
        sys.exit(2)
    _setup_logging(config.log_level)
    import asyncio

    from deepxd.node import Node

    async def run() -> None:
        await Node(config, freeze_gc=True).serve()

    try:
        try:
            import uvloop
        except ImportError:
            asyncio.run(run())
        else:
            uvloop.run(run())
    except DeepxError as e:
        click.echo(f"deepxd: cannot start: {e}", err=True)
        sys.exit(1)
    except KeyboardInterrupt:
        sys.exit(130)
    if "pycuda.driver" in sys.modules:
        # stopped cleanly: leave without the interpreter's finalisation, during which a kernel compilation still
        # running in the background (op-cuda warms its cache) aborts in NVRTC (free() of an invalid pointer)
        import logging
        import os

        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


@main.command("config")
@_with_options
def show_config(config_path, **flags) -> None:
    """Print the effective configuration (after file, environment and flags) as TOML; passwords and the token as
    ***."""
    from deepx_core.errors import DeepxError

    try:
        config = _config(config_path, **flags)
    except DeepxError as e:
        click.echo(f"deepxd: {e}", err=True)
        sys.exit(2)
    click.echo("[deepxd]")
    for k, v in config.shown().items():
        if isinstance(v, str):
            click.echo(f'{k} = "{v}"')
        elif isinstance(v, list):
            click.echo(f"{k} = [{', '.join(repr(x).replace(chr(39), chr(34)) for x in v)}]")
        else:
            click.echo(f"{k} = {v}")


@main.command()
def version() -> None:
    """Print the version."""
    click.echo(f"deepxd {__version__}")


if __name__ == "__main__":
    main()
