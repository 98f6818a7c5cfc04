"""The console script's entry: the global options moved before the command, a command that may
run a model put on a fast BLAS (loaded into this process before MLX, or else a re-execution of
this same command line), then the app (any error it ends with told in one line), then a quick
exit. Neither typer nor the app is imported before that: a re-executed command would import
them twice."""

from __future__ import annotations

import gc
import os
import sys
import threading

# the app's own options, each with a value; any command takes them, before or after its name
GLOBAL_OPTIONS = ("--database-url", "--database-password-file")


def _hoist_database_url(argv: list[str]) -> list[str]:
    """The global options may come after the command too (`batchmlx worker --database-url …`):
    move them before the command, where the app's callback takes them."""
    rest, front, i = [], [], 0
    while i < len(argv):
        arg = argv[i]
        if arg in GLOBAL_OPTIONS and i + 1 < len(argv):
            front += argv[i : i + 2]
            i += 2
            continue
        (front if arg.startswith(tuple(f"{o}=" for o in GLOBAL_OPTIONS)) else rest).append(arg)
        i += 1
    return front + rest


# commands that never load a model: no fast BLAS looked for
_NO_MODEL_COMMANDS = frozenset({"status", "list", "results", "cancel", "watch", "purge", "example"})


def runs_model(argv: list[str]) -> bool:
    """Whether this command line (global options hoisted first) may run a model: a worker,
    the server, doctor, `submit --wait`. No command (help): no; an unknown one: yes."""
    i = 0
    while i < len(argv) and argv[i].startswith("-"):
        i += 2 if argv[i] in GLOBAL_OPTIONS else 1
    if i >= len(argv):
        return False
    command, rest = argv[i], argv[i + 1 :]
    if command == "submit":
        flags = [a for a in rest if a in ("--wait", "--no-wait")]
        return bool(flags) and flags[-1] == "--wait"  # the last one given wins, as in click
    return command not in _NO_MODEL_COMMANDS


def main() -> None:  # pragma: no cover - the console script
    """Entry point: on Linux, a command that may run a model first loads a fast BLAS (or
    re-executes once onto it); then the CLI. Not inside `app`, so tests that call the app
    in-process never touch pytest's BLAS (tests/conftest.py loads it once)."""
    # a command imports its libraries once and keeps them: a rarer first-generation collection
    # spares the collector walking that import graph again and again (~60 ms of a submit,
    # ~20 ms of a results command, measured)
    gc.set_threshold(10_000, 10, 10)
    argv = _hoist_database_url(sys.argv[1:])
    try:
        if runs_model(argv):
            from batchmlx.engine.host.fast_blas import ensure_fast_blas

            # where it cannot load here, it reruns this interpreter's own command line
            # (sys.orig_argv): the options, the database URL among them, travel in argv
            ensure_fast_blas()
        code: int | str | None = run(argv)
    except SystemExit as exc:
        code = exc.code
    _exit(code)


def run(argv: list[str]) -> int | str | None:
    """The app on `argv`; its exit status. Every error it ends with, a bad option value among
    them, is one line on stderr, not click's usage box nor a traceback."""
    import typer

    from batchmlx.cli.commands import app
    from batchmlx.cli.common import fail, report_error

    try:
        result = app(args=argv, prog_name="batchmlx", standalone_mode=False)
    except typer.Abort:
        fail("aborted")
        return 1
    except typer.TyperException as exc:  # click's usage errors (typer's copy of click)
        if type(exc).__name__ == "NoArgsIsHelpError":  # no command: its message is the help
            exc.show()  # type: ignore[attr-defined]
        else:
            ctx = getattr(exc, "ctx", None)
            hint = f" (see: {ctx.command_path} --help)" if ctx is not None else ""
            fail(exc.format_message().rstrip(".") + hint)  # type: ignore[attr-defined]
        return getattr(exc, "exit_code", 2)
    except BrokenPipeError:  # the reader went away (`… | head`): nothing more to say
        return 1
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        return report_error(exc)
    return result if isinstance(result, int) else 0


def _exit(code: int | str | None) -> None:  # pragma: no cover - ends the process
    """Exit without the interpreter's teardown, which frees a loaded model and its KV cache
    object by object (about 0.2 s, measured) where the OS reclaims the memory at once. Exit
    handlers (logging's flush among them) still run; with other threads that may be working
    alive, a normal exit."""
    import atexit

    if isinstance(code, str):
        print(code, file=sys.stderr)
        code = 1
    if _working_threads():
        sys.exit(code)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing more can be said on it
            pass
    os._exit(code or 0)


def _working_threads() -> list[threading.Thread]:
    """Threads other than this one that a fast exit could cut short: not daemons (a normal
    exit does not wait for those either) and not the engine's host-kernel pool, which is idle
    between steps (a step waits for its jobs). Measured: that pool kept every `submit --wait`
    on the slow exit, about 0.5 s."""
    host = sys.modules.get("batchmlx.engine.host.backend")
    pool = host.THREAD_NAME if host is not None else None
    return [
        t
        for t in threading.enumerate()
        if t is not threading.current_thread()
        and not t.daemon
        and not (pool and t.name.startswith(pool))
    ]
