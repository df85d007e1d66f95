"""``manage.py locks``: see, explain and repair the locks of a running site.

Forms (the contract in ``docs/commands.rst``)::

    locks                                  same as ``locks list``
    locks list [--json] [--pattern GLOB]   every held lock, merged across nodes
    locks show NAME [--json]               one lock, node by node
    locks release NAME --force             delete it everywhere, wake its waiters
    locks health [--json]                  the nodes; exit 1 without a quorum
    locks watch [--interval S] [--count N] [--pattern GLOB]   ``list``, refreshed

Reading is done by :mod:`django_redlock.inspection` (SCAN, never KEYS; bounded
by the node timeouts). Bad input is a one-line error and a non-zero exit, never
a traceback, and nothing printed contains a node password.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from typing import Any, ClassVar, NoReturn

from django.core.exceptions import ImproperlyConfigured
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.core.management.color import color_style, no_style

from ...core.keys import InvalidLockName, validate_name
from ...inspection import (
    CLOCK_OFFSET_WARN_MS,
    HealthReport,
    Inventory,
    LockInfo,
    NodeFailure,
    PatternError,
    check_health,
    force_release,
    inspect_lock,
    scan_locks,
    validate_pattern,
)

_UTC = timezone.utc  # noqa: UP017 - datetime.UTC is Python 3.11+

#: ANSI "cursor home, clear screen": how ``watch`` redraws in place on a terminal.
CLEAR = "\x1b[H\x1b[2J"
#: ``watch`` refuses intervals below this (seconds): each frame scans every node.
MIN_INTERVAL = 0.1


class _Parser(CommandParser):
    """Argument errors in one line (``manage.py locks: error: ...``), exit status 2.

    argparse prints the whole usage before the error; for a command with five
    forms that buries the one line that matters. ``--help`` still shows it all.
    """

    def error(self, message: str) -> NoReturn:
        if self.called_from_command_line:
            self.exit(2, f"{self.prog}: error: {message} (see --help)\n")
        raise CommandError(f"Error: {message}")


# ------------------------------------------------------------------ formatting

def format_ms(ms: float | None) -> str:
    """A duration in milliseconds for people: ``850 ms``, ``9.6 s``, ``3m 05s``."""
    if ms is None:
        return "-"
    if ms < 0:
        return "no expiry"
    if ms < 1000:
        return f"{ms:.0f} ms"
    return format_seconds(ms / 1000.0, precise=True)


def format_seconds(s: float | None, *, precise: bool = False) -> str:
    if s is None:
        return "-"
    if s < 60:
        return f"{s:.1f} s" if precise else f"{s:.0f} s"
    minutes, seconds = divmod(int(s), 60)
    if minutes < 60:
        return f"{minutes}m {seconds:02d}s"
    hours, minutes = divmod(minutes, 60)
    if hours < 24:
        return f"{hours}h {minutes:02d}m"
    days, hours = divmod(hours, 24)
    return f"{days}d {hours:02d}h"


def format_owner(owner: dict[str, Any]) -> str:
    """``host:pid thread "label"``: where the holder is, as the lock value says."""
    if not owner:
        return "-"
    host = owner.get("host") or "?"
    pid = owner.get("pid")
    text = f"{host}:{pid}" if pid is not None else str(host)
    if owner.get("thread"):
        text += f" {owner['thread']}"
    if owner.get("label"):
        text += f' "{owner["label"]}"'
    return text


def format_count(n: int | None) -> str:
    """A count for a table cell; ``-`` when it was not read."""
    return "-" if n is None else str(n)


def format_since(since: float | None, age_s: float | None) -> str:
    if since is None:
        return "-"
    when = datetime.fromtimestamp(since, tz=_UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    return f"{when} ({format_seconds(age_s)} ago)" if age_s is not None else when


Cell = tuple[str, Callable[[str], str] | None]


def table(header: Sequence[str], rows: Sequence[Sequence[Cell]],
          heading_style: Callable[[str], str]) -> list[str]:
    """Aligned lines; cells padded *before* styling so colour codes never break columns."""
    widths = [len(h) for h in header]
    for row in rows:
        for i, (text, _) in enumerate(row):
            widths[i] = max(widths[i], len(text))
    last = len(header) - 1

    def line(cells: Sequence[Cell]) -> str:
        parts = []
        for i, (text, style) in enumerate(cells):
            padded = text if i == last else text.ljust(widths[i])
            parts.append(style(padded) if style else padded)
        return "  ".join(parts).rstrip()

    return [line([(h, heading_style) for h in header])] + [line(r) for r in rows]


class Command(BaseCommand):
    help = ("See, explain and repair django-redlock locks: list (default), show, release, "
            "health, watch.")
    requires_system_checks: ClassVar[list[str]] = []  # a bad setting is reported as a CommandError

    def create_parser(self, prog_name: str, subcommand: str, **kwargs: Any) -> CommandParser:
        parser = super().create_parser(prog_name, subcommand, **kwargs)
        parser.error = _Parser.error.__get__(parser)  # type: ignore[method-assign]
        return parser

    def add_arguments(self, parser: CommandParser) -> None:
        subs = parser.add_subparsers(dest="action", metavar="{list,show,release,health,watch}",
                                     parser_class=_Parser)

        def sub(name: str, help_: str) -> CommandParser:
            p = subs.add_parser(name, help=help_, description=help_)
            # Django's colour options also after the subcommand; SUPPRESS keeps the
            # top-level value when they are not repeated here.
            p.add_argument("--no-color", action="store_true", default=argparse.SUPPRESS,
                           help="Don't colorize the output.")
            p.add_argument("--force-color", action="store_true", default=argparse.SUPPRESS,
                           help="Force colorization of the output.")
            return p

        p = sub("list", "Every held lock under KEY_PREFIX (the default action).")
        p.add_argument("--json", action="store_true", help="Print a JSON array.")
        p.add_argument("--pattern", default="*", metavar="GLOB",
                       help="Only lock names matching this Redis glob (default: *).")

        p = sub("show", "One lock, node by node.")
        p.add_argument("name", metavar="NAME")
        p.add_argument("--json", action="store_true", help="Print a JSON object.")

        p = sub("release", "Delete a lock on every node whoever holds it, and wake its waiters.")
        p.add_argument("name", metavar="NAME")
        p.add_argument("--force", action="store_true",
                       help="Required: releasing a lock someone holds lets a second holder in.")

        p = sub("health", "Each node: reachable, round trip, version, role, persistence, clock.")
        p.add_argument("--json", action="store_true", help="Print a JSON array.")

        p = sub("watch", "`list`, refreshed until interrupted.")
        p.add_argument("--interval", type=float, default=2.0, metavar="S",
                       help="Seconds between refreshes (default: 2).")
        p.add_argument("--count", type=int, default=None, metavar="N",
                       help="Stop after N refreshes (default: run until Ctrl-C).")
        p.add_argument("--pattern", default="*", metavar="GLOB",
                       help="Only lock names matching this Redis glob (default: *).")

    # ---------------------------------------------------------------- dispatch
    def handle(self, *args: Any, **options: Any) -> None:
        # Colour follows *our* stdout (Django looks at sys.stdout, which differs
        # under call_command): on a terminal unless --no-color, never when piped.
        if options.get("force_color") or (self.stdout.isatty() and not options.get("no_color")):
            self.style = color_style(force_color=True)
        else:
            self.style = no_style()
        action = options.get("action") or "list"
        try:
            manager = self._manager()
            if action == "list":
                self.do_list(manager, pattern=options.get("pattern", "*"),
                             as_json=bool(options.get("json")))
            elif action == "show":
                self.do_show(manager, self._name(options["name"]),
                             as_json=bool(options.get("json")))
            elif action == "release":
                self.do_release(manager, self._name(options["name"]),
                                force=bool(options.get("force")))
            elif action == "health":
                self.do_health(manager, as_json=bool(options.get("json")))
            elif action == "watch":
                self.do_watch(manager, interval=options["interval"], count=options["count"],
                              pattern=options["pattern"])
            else:  # pragma: no cover - argparse refuses other choices
                raise CommandError(f"unknown action {action!r}")
        except PatternError as e:
            raise CommandError(f"bad --pattern: {e}") from e
        except ImproperlyConfigured as e:  # e.g. a cache:<alias> node that cannot lend a pool
            raise CommandError(" ".join(str(e).split())) from e

    def _manager(self) -> Any:
        from ...conf import get_manager

        try:
            return get_manager()
        except ImproperlyConfigured as e:
            raise CommandError(" ".join(str(e).split())) from e

    @staticmethod
    def _name(name: str) -> str:
        try:
            return validate_name(name)
        except InvalidLockName as e:
            raise CommandError(f"bad lock name: {e}") from e

    def _warn_failures(self, failures: Sequence[NodeFailure]) -> None:
        for f in failures:
            self.stderr.write(self.style.WARNING(f"node {f.node} not read: {f.reason}"))

    # -------------------------------------------------------------------- list
    def render_list(self, inventory: Inventory, pattern: str, prefix: str) -> list[str]:
        """The human ``list`` table plus its summary lines (also a ``watch`` frame)."""
        st = self.style
        lines: list[str] = []
        if inventory.locks:
            rows = []
            for lock in inventory.locks:
                state_style = st.SUCCESS if lock.quorum else st.WARNING
                rows.append([
                    (lock.name, None),
                    (f"{lock.nodes}/{lock.total}", state_style),
                    (lock.state, state_style),
                    (format_ms(lock.ttl_ms), None),
                    (str(lock.fence), None),
                    (format_seconds(lock.age_s), None),
                    (format_count(lock.waiters), None),
                    (format_owner(lock.owner), None),
                ])
            lines += table(["NAME", "NODES", "STATE", "TTL", "FENCE", "AGE", "WAITERS", "OWNER"],
                           rows, st.MIGRATE_HEADING)
        where = f"under prefix {prefix!r}" + ("" if pattern == "*" else f" matching {pattern!r}")
        below = sum(1 for lock in inventory.locks if not lock.quorum)
        count = len(inventory.locks)
        summary = (f"{count} lock{'' if count == 1 else 's'} {where}" if count
                   else f"No locks held {where}.")
        if below:
            summary += f" ({below} below quorum)"
        lines.append(summary + f"; {inventory.answered} of {inventory.total} nodes read, "
                               f"quorum {inventory.quorum_size}.")
        if inventory.truncated:
            lines.append(st.WARNING("Truncated: too many keys; narrow it with --pattern."))
        for f in inventory.failures:
            lines.append(st.WARNING(f"node {f.node} not read: {f.reason}"))
        return lines

    def do_list(self, manager: Any, *, pattern: str, as_json: bool) -> None:
        inventory = scan_locks(manager, pattern)
        if inventory.answered == 0:
            raise CommandError("no node could be read: " + "; ".join(
                f"{f.node}: {f.reason}" for f in inventory.failures))
        if as_json:
            self._warn_failures(inventory.failures)
            self.stdout.write(json.dumps([lock.as_json() for lock in inventory.locks], indent=2))
            return
        for line in self.render_list(inventory, pattern, manager.key_prefix):
            self.stdout.write(line)

    # -------------------------------------------------------------------- show
    def do_show(self, manager: Any, name: str, *, as_json: bool) -> None:
        detail = inspect_lock(manager, name)
        lock = detail.lock
        if lock is None:
            if detail.answered == 0:
                raise CommandError("no node could be read: " + "; ".join(
                    f"{f.node}: {f.reason}" for f in detail.failures))
            raise CommandError(
                f"no lock {name!r} is held (key {manager.key_prefix}:{name}; "
                f"{detail.answered} of {detail.total} nodes read)")
        if as_json:
            self._warn_failures(detail.failures)
            self.stdout.write(json.dumps(lock.as_json(per_node=True), indent=2))
            return
        self.stdout.write("\n".join(self.render_show(lock)))

    def render_show(self, lock: LockInfo) -> list[str]:
        st = self.style
        state_style = st.SUCCESS if lock.quorum else st.WARNING
        state = (f"{lock.state}: held on {lock.nodes} of {lock.total} nodes "
                 f"(quorum {lock.quorum_size})")
        if lock.others:
            state += f"; {lock.others} other node(s) hold it for another holder"
        lines = [
            st.MIGRATE_HEADING(f"Lock {lock.name!r}") + f"  (key {lock.key})",
            f"  state   {state_style(state)}",
            f"  ttl     {format_ms(lock.ttl_ms)}",
            f"  fence   {lock.fence}",
            f"  owner   {format_owner(lock.owner)}",
            f"  since   {format_since(lock.since, lock.age_s)}",
            f"  token   {lock.token}... (first characters)",
            f"  waiters {format_count(lock.waiters)} queued (the longest queue among the nodes)",
            "",
        ]
        rows = []
        for v in lock.per_node:
            if v.state == "held":
                state_cell: tuple[str, Callable[[str], str] | None] = (
                    "held" if v.agrees else "held (other)", st.SUCCESS if v.agrees else st.WARNING)
            elif v.state == "unreachable":
                state_cell = ("unreachable", st.ERROR)
            else:
                state_cell = ("absent", None)
            rows.append([
                (v.node, None),
                state_cell,
                (v.token or "-", None),
                (format_ms(v.pttl_ms) if v.state == "held" else "-", None),
                (str(v.fence) if v.fence is not None else "-", None),
                (str(v.fence_counter) if v.fence_counter is not None else "-", None),
                (format_count(v.waiters), None),
                (v.error if v.error else format_owner(v.owner) if v.state == "held" else "-", None),
            ])
        lines += table(["NODE", "STATE", "TOKEN", "TTL", "FENCE", "COUNTER", "WAITERS", "OWNER"],
                       rows, st.MIGRATE_HEADING)
        return lines

    # ----------------------------------------------------------------- release
    def do_release(self, manager: Any, name: str, *, force: bool) -> None:
        if not force:
            raise CommandError(
                f"refusing to release lock {name!r} without --force: its holder may still be "
                f"working, and a second holder would get in (only fenced writes stay safe)")
        report = force_release(manager, name)
        self._warn_failures(report.failures)
        if report.answered < report.quorum_size:
            raise CommandError(
                f"lock {name!r}: only {report.answered} of {report.total} nodes answered "
                f"({report.quorum_size} needed); it may still be held until its lease ends")
        if not report.deleted:
            self.stdout.write(f"Lock {name!r} was not held on any node that answered "
                              f"({report.answered} of {report.total}); nothing to release.")
            return
        self.stdout.write(self.style.SUCCESS(
            f"Released lock {name!r}: deleted on {len(report.deleted)} of {report.total} nodes"
            + (f", {len(report.failures)} not reached (their copy expires with its lease)"
               if report.failures else "") + "; waiters were woken."))
        holders: dict[str, list[str]] = {}
        fences: dict[str, int] = {}
        for node, stored in report.deleted:
            if stored is None:
                holders.setdefault("(not a django-redlock value)", []).append(node)
                continue
            who = format_owner(stored.owner)
            holders.setdefault(who, []).append(node)
            fences[who] = max(fences.get(who, 0), stored.fence)
        for who, nodes in holders.items():
            since = ""
            for _, stored in report.deleted:
                if stored is not None and format_owner(stored.owner) == who:
                    s = stored.owner.get("since")
                    if isinstance(s, (int, float)):
                        since = f", since {format_since(s, max(0.0, time.time() - s))}"
                    break
            fence = f", fence {fences[who]}" if who in fences else ""
            self.stdout.write(f"It was held by {who} on {len(nodes)} node(s){fence}{since}.")

    # ------------------------------------------------------------------ health
    def do_health(self, manager: Any, *, as_json: bool) -> None:
        report = check_health(manager)
        if as_json:
            self.stdout.write(json.dumps([h.as_json() for h in report.nodes], indent=2))
        else:
            for line in self.render_health(report):
                self.stdout.write(line)
        if not report.ok:
            raise CommandError(
                f"no quorum: {report.healthy} of {len(report.nodes)} nodes healthy, "
                f"{report.quorum_size} needed", returncode=1)

    def render_health(self, report: HealthReport) -> list[str]:
        st = self.style
        rows = []
        for h in report.nodes:
            if not h.ok:
                rows.append([(h.node, None), ("no", st.ERROR), ("-", None), ("-", None),
                             ("-", None), ("-", None), ("-", None), (h.error or "", st.ERROR)])
                continue
            clock = "-" if h.clock_offset_ms is None else f"{round(h.clock_offset_ms):+d} ms"
            clock_style = st.WARNING if h.clock_offset_ms is not None and \
                abs(h.clock_offset_ms) > CLOCK_OFFSET_WARN_MS else None
            rows.append([
                (h.node, None),
                ("yes", st.SUCCESS),
                (f"{h.rtt_ms:.2f} ms" if h.rtt_ms is not None else "-", None),
                (f"{h.server or '?'} {h.version or '?'}", None),
                (h.role or "?", st.WARNING if h.role == "replica" else None),
                (h.persistence, st.WARNING if any("fsync" in w or "AOF" in w for w in h.warnings)
                 else None),
                (clock, clock_style),
                (f"{len(h.warnings)} warning(s)" if h.warnings else "", st.WARNING),
            ])
        lines = table(["NODE", "OK", "RTT", "SERVER", "ROLE", "PERSISTENCE", "CLOCK", "NOTES"],
                      rows, st.MIGRATE_HEADING)
        warned = [(h.node, w) for h in report.nodes for w in h.warnings]
        if warned:
            lines.append("")
            lines.append(st.WARNING("Warnings:"))
            lines += [f"  {node}: {w}" for node, w in warned]
        verdict = (f"{report.healthy} of {len(report.nodes)} nodes healthy, "
                   f"quorum {report.quorum_size}: ")
        lines.append("")
        lines.append(st.SUCCESS(verdict + "OK") if report.ok else st.ERROR(verdict + "NO QUORUM"))
        return lines

    # ------------------------------------------------------------------- watch
    def do_watch(self, manager: Any, *, interval: float, count: int | None, pattern: str) -> None:
        if not interval >= MIN_INTERVAL:
            raise CommandError(f"--interval must be at least {MIN_INTERVAL:g} s, not {interval:g}")
        if count is not None and count < 1:
            raise CommandError(f"--count must be at least 1, not {count}")
        validate_pattern(pattern)
        tty = self.stdout.isatty()
        frames = 0
        try:
            while True:
                inventory = scan_locks(manager, pattern)
                stamp = datetime.now(tz=_UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
                head = self.style.MIGRATE_HEADING(
                    f"django-redlock locks at {stamp}, every {interval:g} s"
                    + (" (Ctrl-C to stop)" if count is None else ""))
                frame = "\n".join([head, *self.render_list(inventory, pattern,
                                                           manager.key_prefix)])
                if tty:
                    self.stdout.write(CLEAR + frame)
                else:
                    self.stdout.write(("\n" if frames else "") + frame)
                self.stdout.flush()
                frames += 1
                if count is not None and frames >= count:
                    return
                time.sleep(interval)
        except KeyboardInterrupt:
            self.stdout.write("")
            return

