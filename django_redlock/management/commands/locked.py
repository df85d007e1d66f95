"""``manage.py locked NAME [options] -- COMMAND ARGS...``: run a command under a lock.

Cron overlap protection: the inner management command runs only while this
process holds lock ``NAME``; a second copy started while the first still runs
waits (``--timeout``) or, with ``--skip-if-busy``, exits at once with status
:data:`SKIPPED` (3) and runs nothing.

Exit status: the inner command's own (0 when it returned normally);
:data:`SKIPPED` when skipped because the lock was busy; 1 when the lock could
not be taken for another reason (busy past ``--timeout`` without
``--skip-if-busy``, no Redis quorum) or was lost while the command ran;
``128 + signal`` when stopped by SIGTERM, SIGINT or SIGHUP. The lock is
released on every way out, a signal included, so the next run does not wait
for the lease to end.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.core.management import get_commands, load_command_class
from django.core.management.base import BaseCommand, CommandError, CommandParser

from ...core.keys import InvalidLockName, validate_name
from ...exceptions import LockLost, LockNotAcquired, QuorumUnavailable

#: Exit status when ``--skip-if-busy`` found the lock held by someone else.
SKIPPED = 3

#: Signals that stop the inner command and release the lock.
STOP_SIGNALS = tuple(getattr(signal, s) for s in ("SIGTERM", "SIGINT", "SIGHUP")
                     if hasattr(signal, s))


class Stopped(BaseException):
    """Raised in the main thread by a stop signal (a BaseException, like KeyboardInterrupt)."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by signal {signum}")
        self.signum = signum


@contextmanager
def _stop_on_signals() -> Iterator[None]:
    """While inside, SIGTERM/SIGINT/SIGHUP raise :class:`Stopped` in the main thread."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers can only be set from the main thread
        return

    def handler(signum: int, frame: Any) -> None:
        raise Stopped(signum)

    previous = {}
    for signum in STOP_SIGNALS:
        previous[signum] = signal.signal(signum, handler)
    try:
        yield
    finally:
        for signum, old in previous.items():
            signal.signal(signum, old)


class Command(BaseCommand):
    help = ("Run a management command under a lock (cron overlap protection): "
            "locked NAME [--timeout S] [--skip-if-busy] -- COMMAND ARGS... "
            f"Exit status {SKIPPED} when skipped because the lock is busy.")
    requires_system_checks: list[str] = []  # the inner command runs its own checks

    def create_parser(self, prog_name: str, subcommand: str, **kwargs: Any) -> CommandParser:
        parser = super().create_parser(prog_name, subcommand, **kwargs)
        parse_args = parser.parse_args

        def split_parse(args: Any = None, namespace: Any = None) -> Any:
            # Everything after the first "--" is the inner command, untouched:
            # its own options must not be read as ours.
            argv = list(sys.argv[1:] if args is None else args)
            inner: list[str] = []
            if "--" in argv:
                at = argv.index("--")
                argv, inner = argv[:at], argv[at + 1:]
            ns = parse_args(argv, namespace)
            ns.command_argv = inner
            return ns

        parser.parse_args = split_parse  # type: ignore[method-assign]
        return parser

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("name", metavar="NAME", help="The lock name.")
        parser.add_argument("--timeout", type=float, default=None, metavar="S",
                            help="Seconds to wait for the lock (default: REDLOCK['TIMEOUT']; "
                                 "0 with --skip-if-busy).")
        parser.add_argument("--skip-if-busy", action="store_true",
                            help=f"When the lock is held elsewhere, run nothing and exit with "
                                 f"status {SKIPPED}.")
        parser.add_argument("--ttl", type=float, default=None, metavar="S",
                            help="Lease in seconds (default: REDLOCK['TTL']); renewed while the "
                                 "command runs.")
        parser.add_argument("--label", default=None,
                            help="Owner label shown by 'manage.py locks' (default: "
                                 "'command:COMMAND').")

    def handle(self, *args: Any, **options: Any) -> None:
        inner = list(options.get("command_argv") or [])
        if not inner:
            raise CommandError("no command to run: locked NAME [options] -- COMMAND ARGS...")
        try:
            name = validate_name(options["name"])
        except InvalidLockName as e:
            raise CommandError(f"bad lock name: {e}") from e
        command_name = inner[0]
        commands = get_commands()
        if command_name not in commands:
            raise CommandError(f"unknown command {command_name!r}")
        if command_name == "locked":
            raise CommandError("'locked' cannot run itself")
        command = load_command_class(commands[command_name], command_name)

        from ...conf import get_manager

        timeout = options["timeout"]
        skip = bool(options["skip_if_busy"])
        lock_options: dict[str, Any] = {"auto_renew": True,
                                        "label": options["label"] or f"command:{command_name}"}
        if timeout is not None:
            lock_options["timeout"] = timeout
        elif skip:
            lock_options["timeout"] = 0
        if options["ttl"] is not None:
            lock_options["ttl"] = options["ttl"]
        try:
            lock = get_manager().lock(name, **lock_options)
        except (ValueError, ImproperlyConfigured) as e:
            raise CommandError(" ".join(str(e).split())) from e

        status: Any = 0
        with _stop_on_signals():
            try:
                try:
                    lock.__enter__()
                except LockNotAcquired as e:
                    if skip:
                        raise CommandError(f"skipped {command_name!r}: lock {name!r} is busy "
                                           f"({e})", returncode=SKIPPED) from e
                    raise CommandError(f"lock {name!r} is busy: {e}") from e
                except QuorumUnavailable as e:
                    raise CommandError(f"lock {name!r}: {e}") from e
                try:
                    try:
                        command.run_from_argv([sys.argv[0] or "manage.py", *inner])
                    except SystemExit as e:
                        status = e.code
                    lock.__exit__(None, None, None)
                except BaseException as e:
                    if not isinstance(e, LockLost):
                        lock.__exit__(type(e), e, e.__traceback__)
                    raise
            except Stopped as e:
                raise CommandError(f"{command_name!r} stopped by signal {e.signum}; lock "
                                   f"{name!r} released", returncode=128 + e.signum) from None
            except LockLost as e:
                raise CommandError(f"lock {name!r} was lost while {command_name!r} ran: {e}",
                                   returncode=1) from e
        if status not in (None, 0):
            sys.exit(status)
