"""What a failed command prints and the exit code it returns, decided in one place (`memfit_gpu.cli.main`).

    0    done
    1    the command ran but did not finish its work (e.g. `memfit sweep`: a point failed; `memfit run`:
         a server gave no answer to some questions), one line `memfit COMMAND: MESSAGE` where the
         command names such failures (`set_defaults(unfinished=callable)`)
    2    something the user must change: a setting, a file, weights to download, a command-line value,
         a full or read-only disk, a damaged cache (one line `memfit COMMAND: error: MESSAGE` on stderr,
         no traceback; an I/O failure names the file and what to do)
    130  stopped by Ctrl-C where the command says what is left (`Interrupted`)

Anything else is a bug and keeps its traceback. Subcommands raise; they never print an error line
themselves. The package's exception classes are imported when an exception is already on its way, so
`memfit --help` imports none of them.
"""

from __future__ import annotations

import argparse

EXIT_UNFINISHED = 1
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
    MissingBackendError, StorageError (a file the file system refused, or a damaged cache). A subcommand
    adds its own with `set_defaults(user_errors=callable)` (e.g. `memfit run`: RunError), called only
    after that command raised, so its modules are already imported.
    """
    from memfit_gpu.config import ConfigError
    from memfit_gpu.data.schema import DataError
    from memfit_gpu.files import StorageError
    from memfit_gpu.models import MissingWeightsError
    from memfit_gpu.readers.types import MissingBackendError

    common = (UsageError, ConfigError, DataError, FileNotFoundError, MissingWeightsError, MissingBackendError,
              StorageError)
    extra = getattr(args, "user_errors", None)
    return common + (tuple(extra()) if extra is not None else ())


def unfinished_errors(args: argparse.Namespace) -> tuple[type[BaseException], ...]:
    """The exceptions that mean "the command ran, saved its work, and left some of it undone" (exit code
    1, one line): a subcommand names them with `set_defaults(unfinished=callable)`."""
    extra = getattr(args, "unfinished", None)
    return tuple(extra()) if extra is not None else ()


def storage_line(exc: BaseException) -> str | None:
    """The one line for an OSError that is the machine's state (full disk, permission, read-only, I/O
    error) or a path of the wrong kind (a folder given for a file, or the reverse), raised where no file was
    named yet; None for any other exception (memfit_gpu.files.STORAGE_ADVICE lists them and what to do)."""
    from memfit_gpu.files import STORAGE_ADVICE, StorageError, storage_error

    if isinstance(exc, StorageError) or not isinstance(exc, OSError) or exc.errno not in STORAGE_ADVICE:
        return None  # a StorageError names its file already (a user error)
    error = storage_error(exc.filename or "a file of this command", exc, "writing or reading")
    return None if error is None else str(error)


def where(args: argparse.Namespace, exc: BaseException) -> str:
    """`memfit COMMAND` (`memfit COMMAND ACTION` for a UsageError of a command with actions)."""
    action = getattr(args, "action", None)
    if isinstance(exc, UsageError) and action:
        return f"memfit {args.command} {action}"
    return f"memfit {args.command}"


def one_line(exc: BaseException) -> str:
    """The message of `exc` on one line (a multi-line message, e.g. where weights were looked for, joined)."""
    return " ".join(line.strip() for line in str(exc).splitlines() if line.strip()) or type(exc).__name__
