"""What a failed command prints and the exit code it returns, decided in one place (`memfit_gpu.cli.main`).

    0    done
    1    the command ran but did not finish its work (e.g. `memfit sweep`: a point failed)
    2    something the user must change: a setting, a file, weights to download, a command-line value
         (one line `memfit COMMAND: error: MESSAGE` on stderr, no traceback)
    130  stopped by Ctrl-C where the command says what is left (`Interrupted`)

Anything else is a bug and keeps its traceback. Subcommands raise; they never print an error line
themselves. The package's exception classes are imported when an exception is already on its way, so
`memfit --help` imports none of them.
"""

from __future__ import annotations

import argparse

EXIT_USER_ERROR = 2
EXIT_INTERRUPTED = 130


class UsageError(Exception):
    """A command-line value the parser cannot check (e.g. `--split` for a benchmark without splits).

    Reported with the action, as argparse reports its own errors: `memfit data fetch: error: ...`."""


class Interrupted(Exception):
    """Ctrl-C, caught by a command that has something to say about what is left (`memfit sweep`).

    Reported as `memfit COMMAND: MESSAGE`, exit code 130."""


def user_errors(args: argparse.Namespace) -> tuple[type[BaseException], ...]:
    """The exceptions that mean "the user must change something" for the command `args` ran.

    Every command: UsageError, ConfigError, DataError, FileNotFoundError, MissingWeightsError,
    MissingBackendError. A subcommand adds its own with `set_defaults(user_errors=callable)` (e.g. `memfit
    run`: RunError), called only after that command raised, so its modules are already imported.
    """
    from memfit_gpu.config import ConfigError
    from memfit_gpu.data.schema import DataError
    from memfit_gpu.models import MissingWeightsError
    from memfit_gpu.readers.types import MissingBackendError

    common = (UsageError, ConfigError, DataError, FileNotFoundError, MissingWeightsError, MissingBackendError)
    extra = getattr(args, "user_errors", None)
    return common + (tuple(extra()) if extra is not None else ())


def where(args: argparse.Namespace, exc: BaseException) -> str:
    """`memfit COMMAND` (`memfit COMMAND ACTION` for a UsageError of a command with actions)."""
    action = getattr(args, "action", None)
    if isinstance(exc, UsageError) and action:
        return f"memfit {args.command} {action}"
    return f"memfit {args.command}"


def one_line(exc: BaseException) -> str:
    """The message of `exc` on one line (a multi-line message, e.g. where weights were looked for, joined)."""
    return " ".join(line.strip() for line in str(exc).splitlines() if line.strip()) or type(exc).__name__
