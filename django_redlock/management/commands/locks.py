"""``manage.py locks``: see, explain and repair the locks of a running site.

(Why one module of 630 lines: one Django command with its subcommands, whose
text and JSON forms share their formatting helpers; the reading itself is in
:mod:`django_redlock.engine.inspection`.)

Forms (the contract in ``docs/commands.rst``)::

    locks                                  same as ``locks list``
    locks list [--json] [--pattern GLOB]   every held lock, merged across nodes
    locks show NAME [--json]               one lock, node by node
    locks release NAME --force             delete it everywhere, wake its waiters
                                           (--holder=TOKEN: only while that one holds it)
    locks health [--json]                  the nodes; exit 1 without a quorum
    locks watch [--interval S] [--count N] [--pattern GLOB]   ``list``, refreshed

Reading is done by :mod:`django_redlock.engine.inspection` (SCAN, never KEYS; bounded
by the node timeouts). Bad input is a one-line error and a non-zero exit, never
a traceback, and nothing printed contains a node password.
"""

from __future__ import annotations

import argparse
import copy
import json
import time
import unicodedata
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from typing import Any, NoReturn

from django.core.exceptions import ImproperlyConfigured
from django.core.management.base import (
    BaseCommand,
    CommandError,
    CommandParser,
    DjangoHelpFormatter,
)
from django.core.management.color import color_style, no_style

from ...core.keys import InvalidLockName, validate_name
from ...engine.inspection import (
    CLOCK_OFFSET_WARN_MS,
    ForeignKey,
    HealthReport,
    Inventory,
    LockInfo,
    NodeFailure,
    PatternError,
    SemaphoreInfo,
    check_health,
    force_release,
    inspect_lock,
    inspect_semaphore,
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

#: Invisible characters that move the cursor or reorder text: escaped in output.
_BIDI = frozenset("\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")


def clean(text: object) -> str:
    """``text`` safe for a terminal: control characters escaped (``\\x1b``).

    Lock names are validated, but a key found by ``SCAN``, an owner label, a
    foreign value or a server's error text is whatever someone wrote: a raw ESC
    would let it recolour, move or erase what the operator reads.
    """
    out = []
    for c in str(text):
        if c in _BIDI or unicodedata.category(c) in ("Cc", "Zl", "Zp"):
            code = ord(c)
            out.append(f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}")
        else:
            out.append(c)
    return "".join(out)


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
    return clean(text)


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
    requires_system_checks: list[str] = []  # a bad setting is reported as a CommandError

    def create_parser(self, prog_name: str, subcommand: str, **kwargs: Any) -> CommandParser:
        parser = super().create_parser(prog_name, subcommand, **kwargs)
        parser.error = _Parser.error.__get__(parser)  # type: ignore[method-assign]
        return parser

    def add_arguments(self, parser: CommandParser) -> None:
        subs = parser.add_subparsers(dest="action", metavar="{list,show,release,health,watch}",
                                     parser_class=_Parser)
        # Django's common options (--settings, --pythonpath, -v, --traceback, the
        # colour options, ...) in every position a Django user types them: after
        # the subcommand too, as with any built-in command. They are copies of the
        # top-level options with a SUPPRESS default, so an option not repeated
        # after the subcommand keeps its top-level value.
        common = [action for action in parser._actions
                  if set(action.option_strings) & DjangoHelpFormatter.show_last]

        def sub(name: str, help_: str) -> CommandParser:
            p = subs.add_parser(name, help=help_, description=help_,
                                formatter_class=DjangoHelpFormatter)
            for action in common:
                twin = copy.copy(action)
                twin.default = argparse.SUPPRESS
                p._add_action(twin)
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
        p.add_argument("--holder", default="", metavar="TOKEN",
                       help="Only while this holder holds it (the TOKEN column of `locks show`): "
                            "if the lock changed hands since you looked, nothing is deleted. "
                            "Write --holder=TOKEN: a token may start with '-'.")

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
                                force=bool(options.get("force")),
                                holder=str(options.get("holder") or ""))
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
            self.stderr.write(self.style.WARNING(f"node {clean(f.node)} not read: {clean(f.reason)}"))

    # -------------------------------------------------------------------- list
    def render_list(self, inventory: Inventory, pattern: str, prefix: str) -> list[str]:
        """The human ``list`` table plus its summary lines (also a ``watch`` frame)."""
        st = self.style
        lines: list[str] = []
        plain = inventory.ungrouped()
        if plain:
            rows = [self.lock_row(lock, [(clean(lock.name), None)], with_waiters=True)
                    for lock in plain]
            lines += table(["NAME", "NODES", "STATE", "TTL", "FENCE", "AGE", "WAITERS", "OWNER"],
                           rows, st.MIGRATE_HEADING)
        for sem in inventory.semaphores:
            if lines:
                lines.append("")
            lines += self.render_semaphore(sem)
        where = f"under prefix {prefix!r}" + ("" if pattern == "*" else f" matching '{clean(pattern)}'")
        every = inventory.locks
        below = sum(1 for lock in every if not lock.quorum)
        count = len(plain)
        sems = len(inventory.semaphores)
        if count or sems:
            parts = ([f"{count} lock{'' if count == 1 else 's'}"] if count else []) + (
                [f"{sems} semapho{'re' if sems == 1 else 'res'}"] if sems else [])
            summary = f"{' and '.join(parts)} {where}"
        elif inventory.complete:
            summary = f"No locks held {where}."
        else:
            # Not "no locks held": the nodes not read may hold some.
            summary = f"No locks found {where} on the nodes read."
        if below:
            summary += f" ({below} below quorum)"
        lines.append(summary + f"; {inventory.answered} of {inventory.total} nodes read, "
                               f"quorum {inventory.quorum_size}.")
        for lock in every:
            if lock.ttl_ms < 0:
                lines.append(st.WARNING(
                    f"Lock '{clean(lock.name)}' has no expiry (a raw SET or a PERSIST): it "
                    f"never frees itself; see 'locks show {clean(lock.name)}'."))
        for foreign in inventory.foreign:
            lines.append(st.WARNING(self.foreign_line(foreign)))
        if inventory.truncated:
            lines.append(st.WARNING("Truncated: too many keys; narrow it with --pattern."))
        for f in inventory.failures:
            lines.append(st.WARNING(f"node {clean(f.node)} not read: {clean(f.reason)}"))
        if not inventory.enough:
            lines.append(st.ERROR(self.no_quorum_read(inventory)))
        return lines

    def lock_row(self, lock: LockInfo, first: list[Cell], *, with_waiters: bool) -> list[Cell]:
        """One lock's cells after ``first``: nodes, state, ttl, fence, age, [waiters,] owner."""
        st = self.style
        state_style = st.SUCCESS if lock.quorum else st.WARNING
        return [
            *first,
            (f"{lock.nodes}/{lock.total}", state_style),
            (lock.state, state_style),
            (format_ms(lock.ttl_ms), None),
            (str(lock.fence), None),
            (format_seconds(lock.age_s), None),
            *([(format_count(lock.waiters), None)] if with_waiters else []),
            (format_owner(lock.owner), None),
        ]

    def render_semaphore(self, sem: SemaphoreInfo) -> list[str]:
        """A semaphore as one entry: its count, a row per permit held, its line."""
        st = self.style
        permits = "?" if sem.permits is None else str(sem.permits)
        head = (f"Semaphore '{clean(sem.name)}': {sem.held} of {permits} permits held, "
                f"{sem.waiters} waiting")
        line = sem.line
        if line is not None and line.quorum:
            head += (f" (first in line {format_owner(line.owner)}, "
                     f"{format_count(line.waiters)} queued behind)")
        lines = [st.MIGRATE_HEADING(head)]
        if sem.permits is None or len(sem.recorded) > 1:
            lines.append(st.WARNING(
                "  the nodes disagree on its permit count: " + ", ".join(
                    f"{count} on {nodes} node(s)" for count, nodes in sorted(sem.recorded.items()))))
        rows = [self.lock_row(lock, [(f"#{index}", None)], with_waiters=False)
                for index, lock in sem.holders]
        if line is not None and not line.quorum:
            rows.append(self.lock_row(line, [("line", None)], with_waiters=False))
        if rows:
            lines += ["  " + text for text in table(
                ["PERMIT", "NODES", "STATE", "TTL", "FENCE", "AGE", "OWNER"], rows,
                st.MIGRATE_HEADING)]
        else:
            lines.append("  no permit held")
        return lines

    @staticmethod
    def foreign_line(foreign: ForeignKey) -> str:
        return (f"Key {clean(foreign.key)} (lock '{clean(foreign.name)}') holds no "
                f"django-redlock lock but {clean(foreign.describe())}; it blocks that "
                f"lock until it is removed.")

    @staticmethod
    def no_quorum_read(inventory: Inventory) -> str:
        return (f"only {inventory.answered} of {inventory.total} nodes read "
                f"({inventory.quorum_size} needed; not read: "
                f"{', '.join(clean(f.node) for f in inventory.failures)}): locks held on the "
                f"others may be missing from this list")

    def do_list(self, manager: Any, *, pattern: str, as_json: bool) -> None:
        inventory = scan_locks(manager, pattern)
        if inventory.answered == 0:
            raise CommandError("no node could be read: " + "; ".join(
                f"{clean(f.node)}: {clean(f.reason)}" for f in inventory.failures))
        if as_json:
            self._warn_failures(inventory.failures)
            items = [lock.as_json() for lock in inventory.ungrouped()]
            items += [sem.as_json() for sem in inventory.semaphores]
            items += [foreign.as_json() for foreign in inventory.foreign]
            self.stdout.write(json.dumps(items, indent=2))
        else:
            for line in self.render_list(inventory, pattern, manager.key_prefix):
                self.stdout.write(line)
        if not inventory.enough:
            raise CommandError(self.no_quorum_read(inventory), returncode=1)

    # -------------------------------------------------------------------- show
    def do_show(self, manager: Any, name: str, *, as_json: bool) -> None:
        detail = inspect_lock(manager, name)
        lock = detail.lock
        if lock is None:
            if detail.answered == 0:
                raise CommandError("no node could be read: " + "; ".join(
                    f"{clean(f.node)}: {clean(f.reason)}" for f in detail.failures))
            if detail.foreign is not None:
                self._warn_failures(detail.failures)
                if as_json:
                    self.stdout.write(json.dumps(detail.foreign.as_json(), indent=2))
                else:
                    self.stdout.write(self.foreign_line(detail.foreign))
                    for v in detail.foreign.per_node:
                        self.stdout.write(f"  {clean(v.node)}: {clean(v.describe())}")
                return
            semaphore = self._semaphore(manager, name)
            if semaphore is not None:
                if as_json:
                    self.stdout.write(json.dumps(semaphore.as_json(), indent=2))
                else:
                    self.stdout.write("\n".join(self.render_semaphore(semaphore)))
                return
            raise CommandError(
                f"no lock {name!r} is held (key {manager.key_prefix}:{name}; "
                f"{detail.answered} of {detail.total} nodes read)")
        if as_json:
            self._warn_failures(detail.failures)
            self.stdout.write(json.dumps(lock.as_json(per_node=True), indent=2))
            return
        self.stdout.write("\n".join(self.render_show(lock)))

    def _semaphore(self, manager: Any, name: str) -> SemaphoreInfo | None:
        """Semaphore ``name`` as ``list`` groups it, or None when it is none (no
        count recorded for it on the nodes, or none of its permits held)."""
        semaphore, failures = inspect_semaphore(manager, name)
        self._warn_failures(failures)
        return semaphore

    def render_show(self, lock: LockInfo) -> list[str]:
        st = self.style
        state_style = st.SUCCESS if lock.quorum else st.WARNING
        state = (f"{lock.state}: held on {lock.nodes} of {lock.total} nodes "
                 f"(quorum {lock.quorum_size})")
        if lock.others:
            state += f"; {lock.others} other node(s) hold it for another holder"
        lines = [
            st.MIGRATE_HEADING(f"Lock '{clean(lock.name)}'") + f"  (key {clean(lock.key)})",
            f"  state   {state_style(state)}",
            f"  ttl     {format_ms(lock.ttl_ms)}" + (st.WARNING(
                "  (a raw SET or a PERSIST: it never frees itself; 'locks release NAME "
                "--force' removes it)") if lock.ttl_ms < 0 else ""),
            f"  fence   {lock.fence}",
            f"  owner   {format_owner(lock.owner)}",
            f"  since   {format_since(lock.since, lock.age_s)}",
            f"  token   {clean(lock.token)}... (first characters)",
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
            elif v.state == "foreign":
                state_cell = ("foreign", st.ERROR)
            else:
                state_cell = ("absent", None)
            if v.error:
                note = clean(v.error)
            elif v.foreign is not None:
                note = "not a lock value: " + clean(v.foreign.describe())
            else:
                note = format_owner(v.owner) if v.state == "held" else "-"
            rows.append([
                (clean(v.node), None),
                state_cell,
                (clean(v.token or "-"), None),
                (format_ms(v.pttl_ms) if v.state == "held" else "-", None),
                (str(v.fence) if v.fence is not None else "-", None),
                (str(v.fence_counter) if v.fence_counter is not None else "-", None),
                (format_count(v.waiters), None),
                (note, None),
            ])
        lines += table(["NODE", "STATE", "TOKEN", "TTL", "FENCE", "COUNTER", "WAITERS", "OWNER"],
                       rows, st.MIGRATE_HEADING)
        return lines

    # ----------------------------------------------------------------- release
    def do_release(self, manager: Any, name: str, *, force: bool, holder: str = "") -> None:
        if not force:
            raise CommandError(
                f"refusing to release lock {name!r} without --force: its holder may still be "
                f"working, and a second holder would get in (only fenced writes stay safe)")
        try:
            report = force_release(manager, name, holder)
        except ValueError as e:
            raise CommandError(f"--holder: {e}") from None
        self._warn_failures(report.failures)
        if report.answered < report.quorum_size:
            raise CommandError(
                f"lock {name!r}: only {report.answered} of {report.total} nodes answered "
                f"({report.quorum_size} needed); it may still be held until its lease ends")
        if report.kept and not report.deleted:
            now_held = sorted({format_owner(stored.owner) for _, stored in report.kept
                               if stored is not None}) or ["another holder"]
            raise CommandError(
                f"lock {name!r} is held by another holder than {holder!r} now "
                f"({', '.join(now_held)}); nothing was released: look again (locks show)")
        if not report.deleted:
            self.stdout.write(f"Lock {name!r} was not held on any node that answered "
                              f"({report.answered} of {report.total}); nothing to release.")
            return
        self.stdout.write(self.style.SUCCESS(
            f"Released lock {name!r}: deleted on {len(report.deleted)} of {report.total} nodes"
            + (f", {len(report.failures)} not reached (their copy expires with its lease)"
               if report.failures else "")
            + ("; other holders of this read-write lock still hold it, so no waiter was woken."
               if report.shared and len(report.shared) == len(report.deleted)
               else "; waiters were woken.")))
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
            raise CommandError(self.verdict_reason(report), returncode=1)

    @staticmethod
    def verdict_reason(report: HealthReport) -> str:
        if report.reachable < report.quorum_size:
            return (f"no quorum: {report.healthy} of {len(report.nodes)} nodes healthy, "
                    f"{report.quorum_size} needed")
        bad = [f"{clean(h.node)} ({h.status})" for h in report.nodes
               if h.error is None and not h.ok]
        return (f"not safe: {report.healthy} of {len(report.nodes)} nodes healthy, "
                f"{report.quorum_size} needed; answered but not healthy: {', '.join(bad)}")

    def render_health(self, report: HealthReport) -> list[str]:
        st = self.style
        rows = []
        for h in report.nodes:
            if h.error is not None:
                rows.append([(clean(h.node), None), ("no", st.ERROR), ("-", None), ("-", None),
                             ("-", None), ("-", None), ("-", None), (clean(h.error), st.ERROR)])
                continue
            clock = "-" if h.clock_offset_ms is None else f"{round(h.clock_offset_ms):+d} ms"
            clock_style = st.WARNING if h.clock_offset_ms is not None and \
                abs(h.clock_offset_ms) > CLOCK_OFFSET_WARN_MS else None
            status = {"ok": ("yes", st.SUCCESS), "unsafe": ("UNSAFE", st.ERROR),
                      "unknown": ("unknown", st.WARNING)}.get(h.status, ("no", st.ERROR))
            rows.append([
                (clean(h.node), None),
                status,
                (f"{h.rtt_ms:.2f} ms" if h.rtt_ms is not None else "-", None),
                (clean(f"{h.server or '?'} {h.version or '?'}"), None),
                (clean(h.role or "?"), st.WARNING if h.role == "replica" else None),
                (clean(h.persistence), st.WARNING if any("fsync" in w or "AOF" in w
                                                         for w in h.warnings) else None),
                (clock, clock_style),
                (clean("; ".join(x for x in (
                    h.topology, f"{len(h.warnings)} warning(s)" if h.warnings else "") if x)),
                 st.WARNING if h.warnings else None),
            ])
        lines = table(["NODE", "OK", "RTT", "SERVER", "ROLE", "PERSISTENCE", "CLOCK", "NOTES"],
                      rows, st.MIGRATE_HEADING)
        warned = [(h.node, w) for h in report.nodes for w in h.warnings]
        if warned:
            lines.append("")
            lines.append(st.WARNING("Warnings:"))
            lines += [f"  {clean(node)}: {clean(w)}" for node, w in warned]
        verdict = (f"{report.healthy} of {len(report.nodes)} nodes healthy, "
                   f"quorum {report.quorum_size}: ")
        lines.append("")
        if report.ok:
            lines.append(st.SUCCESS(verdict + "OK"))
        elif report.reachable < report.quorum_size:
            lines.append(st.ERROR(verdict + "NO QUORUM"))
        else:
            lines.append(st.ERROR(verdict + "NOT SAFE (nodes that evict keys, or whose "
                                            "eviction settings are unknown)"))
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

