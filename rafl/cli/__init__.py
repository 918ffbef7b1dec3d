"""Command-line interface: ``rafl <command>``.

Thin by design: each command parses its options, loads/validates config and calls one function of
the library. Commands are loaded lazily (importing torch-heavy modules only for the command that
runs). Every :class:`rafl.errors.UserInputError` becomes one line on stderr and exit status 2.
"""

from __future__ import annotations

import importlib
import signal
import sys
import threading

import click

from rafl import __version__
from rafl.errors import UserInputError, reset_warnings

# command name -> "module:attribute" of a click.Command. One line per command.
COMMANDS: dict[str, str] = {
    "data": "rafl.cli.data:data",
    "supernet": "rafl.cli.supernet:supernet",
    "search": "rafl.cli.search:search",
    "compare": "rafl.cli.compare:compare",
    "profile": "rafl.cli.profile:profile",
    "federate": "rafl.cli.federate:federate",
    "flower-app": "rafl.cli.flower:flower_app",
    "flower-superexec": "rafl.cli.flower:flower_superexec",
    "flower-supernode": "rafl.cli.flower:flower_supernode",
}


class LazyGroup(click.Group):
    """A click group that imports a command's module only when that command is used."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        target = COMMANDS.get(name)
        if target is None:
            return None
        module, attr = target.split(":")
        return getattr(importlib.import_module(module), attr)

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        """As click's, but a usage error (unknown option, missing option, bad value) is one line,
        ``error: <message> (see 'rafl <command> --help')``, exit status 2 (click prints three)."""
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        try:
            rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except click.exceptions.NoArgsIsHelpError as err:  # `rafl` / `rafl supernet` alone: the help
            click.echo(err.format_message(), err=True)
            sys.exit(2)
        except click.UsageError as err:
            hint = _set_hint(err, sys.argv[1:] if args is None else list(args))
            if hint is not None:
                err = click.UsageError(hint, err.ctx)
            path = err.ctx.command_path if err.ctx is not None else (prog_name or "rafl")
            if err.ctx is None or err.ctx.parent is None:  # e.g. a missing option value: no subcommand context
                words = sys.argv[1:] if args is None else args
                sub = next((w for w in words if w in COMMANDS), None)
                path = f"{prog_name or 'rafl'} {sub}" if sub else path
            click.echo(f"error: {err.format_message()} (see '{path} --help')", err=True)
            sys.exit(2)
        except click.ClickException as err:
            err.show()
            sys.exit(err.exit_code)
        except RuntimeError as err:  # torchvision built for another torch: one line, not 30 of traceback
            line = torch_pair_error(err)
            if line is None:
                raise
            click.echo(line, err=True)
            sys.exit(2)
        except click.exceptions.Abort:  # Ctrl-C: the shell's convention, 128 + SIGINT
            # (a command that had written something says so itself; this is Ctrl-C before it could:
            # while its module loads or its options are read)
            click.echo("interrupted", err=True)
            sys.exit(128 + signal.SIGINT)
        sys.exit(rv if isinstance(rv, int) else 0)

    def invoke(self, ctx: click.Context):
        # SIGTERM (a batch scheduler's timeout, `kill`) unwinds like Ctrl-C, so the commands' cleanup
        # runs: no half-made run dir, and completed rounds stay in the checkpoint (exit 143 = 128 + 15).
        # SIGINT gets Python's own handler (KeyboardInterrupt) even when rafl started with it ignored,
        # as a shell starts a background job (`rafl federate ... &`): `kill -INT` stops it like Ctrl-C
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, _exit_on_sigterm)
            signal.signal(signal.SIGINT, signal.default_int_handler)
        reset_warnings()
        try:
            return super().invoke(ctx)
        except UserInputError as err:
            click.echo(f"error: {err}", err=True)
            ctx.exit(2)


def _set_hint(err: click.UsageError, words: list[str]) -> str | None:
    """For an unknown option of a command that takes ``--set`` (``federate``, ``compare``) whose name
    is a run-config key (``--rounds 3``, ``--local-epochs=1``): the message with the ``--set`` to
    use (``--set engine.rounds=3``) instead of click's nearest option name; None otherwise."""
    if not isinstance(err, click.NoSuchOption) or err.ctx is None:
        return None
    if not any("--set" in p.opts for p in err.ctx.command.params):
        return None
    from rafl.config import config_keys

    name = err.option_name.lstrip("-")
    key = name.replace("-", "_")
    keys = [*config_keys(), *(f"algorithm.{k}" for k in _hyperparameter_names())]
    matches = [k for k in keys if k.split(".")[-1] == key or k == name or k.replace(".", "-").replace("_", "-") == name]
    if not matches:
        return None
    value = "VALUE"
    for i, w in enumerate(words):
        if w == err.option_name and i + 1 < len(words) and not words[i + 1].startswith("--"):
            value = words[i + 1]
        elif w.startswith(err.option_name + "="):
            value = w.split("=", 1)[1]
    return (f"no such option: {err.option_name}; run-config keys are set with --set, e.g. "
            + " or ".join(f"--set {k}={value}" for k in matches[:3]))


def _hyperparameter_names() -> list[str]:
    """Every registered method's hyperparameter names (``local_epochs``, ``lr``, ``tau``, ...),
    from the methods' source without importing torch (:mod:`rafl.federation.catalog`)."""
    from rafl.federation.catalog import hyperparameter_names

    return hyperparameter_names()


def installed_version(dist: str) -> str:
    """The installed version of distribution ``dist`` (its metadata: nothing is imported)."""
    from importlib.metadata import version

    return version(dist)


def torch_pair_error(err: BaseException) -> str | None:
    """For torchvision failing to load on a torch it was not built for (``operator
    torchvision::nms does not exist``: what pip installs when the CPU torch comes from one index
    and torchvision from another), one ``error:`` line naming both installed versions and the pip
    command that installs the matching pair: torchvision 0.(N+15).P goes with torch 2.N.P (as
    since torch 2.0 / torchvision 0.15), from the index of torch's local build (``+cpu``,
    ``+cu126``) if it has one. None for any other error (``err`` and its causes)."""
    seen, e = [], err
    while e is not None and e not in seen:
        seen.append(e)
        e = e.__cause__ or e.__context__
    if not any("torchvision::" in str(x) and "does not exist" in str(x) for x in seen):
        return None
    try:
        torch_v, vision_v = installed_version("torch"), installed_version("torchvision")
    except ImportError:  # importlib.metadata.PackageNotFoundError: no metadata, say what is known
        torch_v, vision_v = "?", "?"
    base, _, local = torch_v.partition("+")
    parts = base.split(".")
    if len(parts) >= 2 and parts[0] == "2" and parts[1].isdigit():
        patch = parts[2] if len(parts) > 2 and parts[2].isdigit() else "0"
        cmd = f"pip install torch=={base} torchvision==0.{int(parts[1]) + 15}.{patch}"
    else:
        cmd = "pip install torch torchvision (the torchvision release made for the installed torch)"
    if local:
        cmd += f" --index-url https://download.pytorch.org/whl/{local}"
    return (f"error: torchvision {vision_v} was not built for the installed torch {torch_v} (operator "
            f"torchvision::nms does not exist); install the matching pair: {cmd}")


def _exit_on_sigterm(signum, frame):  # noqa: ARG001 (signal handler signature)
    raise SystemExit(128 + signal.SIGTERM)


def exit_interrupted(err: BaseException) -> BaseException:
    """The exception to raise once a command has told the user how to continue after Ctrl-C or
    SIGTERM: SIGTERM's ``SystemExit`` (143) as it is; Ctrl-C as exit status 130 (128 + SIGINT)
    without click's blank line and "Aborted!", which would follow the command's own line."""
    if isinstance(err, SystemExit):
        return err
    return click.exceptions.Exit(128 + signal.SIGINT)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="rafl")
def cli() -> None:
    """rafl: resource-aware heterogeneous federated learning.

    Train a once-for-all supernet, search a subnet per device profile, federate the specialized
    models (RaFL, FedGH, FedTGP, ...), and read cost/latency reports.
    """


def main(argv: list[str] | None = None) -> None:
    """Console entry point (``rafl``).

    Once the command has returned or said why it stops, the objects it made are frozen out of
    Python's cyclic garbage collector (``gc.freeze``): the collection the interpreter runs at exit
    over a run's models, datasets and tables took 10-15 s on a loaded 2-core machine, between the
    "interrupted: ..." line of a SIGTERM / Ctrl-C and the exit. Nothing is left half-written by
    it: every file is written atomically before, and ``atexit`` handlers still run."""
    import gc

    try:
        cli.main(args=argv, prog_name="rafl", standalone_mode=True)
    finally:
        gc.freeze()


if __name__ == "__main__":  # pragma: no cover
    main(sys.argv[1:])
