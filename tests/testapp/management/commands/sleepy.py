"""A slow command for ``manage.py locked`` tests: writes a line to a file, then sleeps."""

from __future__ import annotations

import time
from typing import Any

from django.core.management.base import BaseCommand, CommandError


class Command(BaseCommand):
    help = "Append 'start' to FILE, sleep S seconds, append 'end'; --fail exits with status 5."

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("file")
        parser.add_argument("--seconds", type=float, default=0.0)
        parser.add_argument("--fail", action="store_true")

    def handle(self, *args: Any, **options: Any) -> None:
        with open(options["file"], "a") as f:
            f.write("start\n")
        time.sleep(options["seconds"])
        if options["fail"]:
            raise CommandError("failed on purpose", returncode=5)
        with open(options["file"], "a") as f:
            f.write("end\n")
