"""deepxctl: the operator's view of a deepx daemon: tensors, memory, ops, nodes, actors, graphs, caches, a live
top, and deepxIR by hand. One module per command group; every command prints through deepxctl.term.

Importing this module imports click and nothing heavy (no numpy, msgpack, rich, nor deepx_sdk, whose package
imports numpy), so `--help` is instant.
"""

from __future__ import annotations

import sys
from typing import Any, NoReturn

import click

from deepxctl import actors, caches, executors, graphs, ir, memory, nodes, ops, tensors, top
from deepxctl.context import Ctl
from deepxctl.term import CtlError


def _reader_left() -> NoReturn:
    """stdout's reader left (`deepxctl top | head -2`): not an error, so exit 0 with nothing said. stdout becomes
    /dev/null first, so that the interpreter's last flush of what is still buffered cannot fail again."""
    import os

    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # stdout is not a file (click's test runner): nothing is flushed to a pipe
        pass
    raise click.exceptions.Exit(0)


class CliGroup(click.Group):
    """Turns every refusal (DeepxError, a lost connection, a timeout) into one line on stderr and exit code 1, and a
    closed stdout pipe into a quiet exit 0."""

    def make_context(self, *args: Any, **kwargs: Any) -> click.Context:
        try:
            return super().make_context(*args, **kwargs)
        except BrokenPipeError:  # `deepxctl --help | head -1` (click's own handling exits 1)
            _reader_left()

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except click.ClickException:
            raise
        except KeyboardInterrupt:  # click's own handling prints "Aborted!" and exits 1; the docs promise 130
            sys.stderr.write("\n")
            raise SystemExit(130) from None
        except BrokenPipeError:  # a ConnectionError, but the daemon's socket errors come as DeepxError: stdout's
            _reader_left()
        except TimeoutError:  # deepx_core.client.DeepxTimeoutError, a DeepxError too
            ctl: Ctl | None = ctx.find_object(Ctl)
            raise CtlError(f"deepxd at {ctl.address if ctl else '?'} did not answer within "
                           f"{ctl.timeout if ctl else '?'} s (--timeout)") from None
        except ConnectionError as e:
            raise CtlError(f"lost the connection to deepxd: {e}") from None
        except Exception as e:
            errors = sys.modules.get("deepx_core.errors")  # imported already by whatever raised a DeepxError
            if errors is not None and isinstance(e, errors.DeepxError):
                raise CtlError(str(e)) from None
            raise


@click.group(cls=CliGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.option("--address", envvar="DEEPX_ADDRESS", default=None, show_default="$DEEPX_ADDRESS, else the default "
              "socket", help="The daemon: its native socket, unix:///path/deepxd.sock (a bare path is refused), or "
              "its TCP listener, tcp://HOST:PORT.")
@click.option("--token-file", metavar="FILE", envvar="DEEPX_TOKEN_FILE", default=None,
              help="For a tcp:// address: a file (mode 0600) whose first line is the daemon's token; also "
                   "DEEPX_TOKEN.")
@click.option("--tls", is_flag=True, envvar="DEEPX_TLS", default=False,
              help="For a tcp:// address: speak TLS, the daemon's certificate checked against the system's CAs.")
@click.option("--tls-cafile", metavar="FILE", envvar="DEEPX_TLS_CAFILE", default=None,
              help="For a tcp:// address: speak TLS, the daemon's certificate checked against FILE (PEM).")
@click.option("--kv", metavar="URL", envvar="DEEPXCTL_KV", default=None,
              help="Read the storage plane at URL (redis://host:port/db or memory:///abs/path/file) instead of a "
                   "daemon: for a stopped cluster. Serves tensors ls/show, memory, nodes ls, ops ls, graphs.")
@click.option("--kv-password-file", metavar="FILE", envvar="DEEPX_KV_PASSWORD_FILE", default=None,
              help="A file (mode 0600) whose first line is the plane's Redis password; also DEEPX_KV_PASSWORD. "
                   "A password inside --kv is refused: every local user can read a command line.")
@click.option("--kv-prefix", metavar="PREFIX", envvar="DEEPX_KV_PREFIX", default="deepx:", show_default=True,
              help="The storage plane's key prefix (the daemon's kv_prefix).")
@click.option("--timeout", type=click.FloatRange(min=0, min_open=True), envvar="DEEPXCTL_TIMEOUT", default=30.0,
              show_default=True, help="Seconds to wait for the daemon's answer.")
@click.version_option(package_name="deepx", prog_name="deepxctl")
@click.pass_context
def cli(ctx: click.Context, address: str | None, token_file: str | None, tls: bool, tls_cafile: str | None,
        kv: str | None, kv_password_file: str | None, kv_prefix: str, timeout: float) -> None:
    """The operator's view of deepx: what tensors exist and who holds them, which ops are slow, which nodes and
    actors are alive, what a stored graph is.

    \b
      deepxctl tensors ls --filter kind=heap      deepxctl memory
      deepxctl ops ls --limit 10                  deepxctl top
      deepxctl ir "print (tensor:x) -> ()"        deepxctl --kv redis://10.0.0.5:6379/0 nodes ls
    """
    if kv and ctx.get_parameter_source("kv") == click.core.ParameterSource.COMMANDLINE and ("@" in kv or "=" in kv):
        from deepxd.kv.base import url_password

        if url_password(kv):
            raise CtlError("--kv: the URL carries a password, which every local user can read in /proc/<pid>/cmdline; "
                           "give it with --kv-password-file FILE (mode 0600) or DEEPX_KV_PASSWORD, and the URL "
                           "without it", exit_code=2)
    ctx.obj = Ctl(address, kv, kv_prefix, timeout, kv_password_file=kv_password_file, token_file=token_file,
                  tls=tls, tls_cafile=tls_cafile)


for group in (tensors.tensors, memory.memory, ops.ops, nodes.nodes, actors.actors, executors.executors, graphs.graphs,
              caches.caches, top.top, ir.ir):
    cli.add_command(group)


def main() -> None:
    try:
        cli(prog_name="deepxctl")
    except KeyboardInterrupt:
        raise SystemExit(130) from None
    except BrokenPipeError:  # `deepxctl tensors ls | head`, outside a command (CliGroup.invoke has the rest)
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise SystemExit(0) from None
