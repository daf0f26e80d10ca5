"""The demo's output: lines stamped with the seconds since the start, and a progress line."""

from __future__ import annotations

import sys
import textwrap
import threading
import time
from typing import TextIO

WIDTH = 100


class Console:
    """Lines stamped with the seconds since the start; one progress line per run, redrawn in
    place on a terminal, printed at every tenth of the run elsewhere (CI logs). Thread-safe."""

    def __init__(self, *, quiet: bool, stream: TextIO = sys.stdout) -> None:
        self.stream = stream
        self.quiet = quiet
        self.tty = stream.isatty()
        self.started = time.monotonic()
        self._lock = threading.RLock()
        self._drawn = False
        self._tenth = 0
        self._run: object = None

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def _write(self, text: str) -> None:
        with self._lock:
            if self._drawn:
                self.stream.write("\r" + " " * (WIDTH - 1) + "\r")
                self._drawn = False
            self.stream.write(text + "\n")
            self.stream.flush()

    def say(self, text: str) -> None:
        if not self.quiet:
            self.detail(text, f"[{self.elapsed():5.1f}s] ", indent=9)

    def detail(self, text: str, label: str = "", *, indent: int | None = None) -> None:
        """``text`` wrapped under ``label``, 9 spaces in (``indent``: the later lines')."""
        if not self.quiet:
            lead = label if indent is not None else " " * 9 + label
            later = " " * (indent if indent is not None else len(lead))
            self._write(
                textwrap.fill(text, WIDTH - 1, initial_indent=lead, subsequent_indent=later)
            )

    def always(self, text: str = "") -> None:
        self._write(text)

    def progress(
        self, label: str, done: int, total: int, where: str, *, run: object, start: int = 0
    ) -> None:
        """Draw the progress of ``run`` (any value naming it): ``done`` of ``total`` events,
        of which ``start`` were there before it began (its tenths count from there)."""
        if self.quiet or total <= 0:
            return
        with self._lock:
            if run != self._run:
                self._run, self._tenth = run, 0
            share = min(done / total, 1.0)
            counts = f"{share:4.0%}  {done:,}/{total:,} events  {where}"
            if self.tty:
                bar = "#" * round(share * 24)
                line = f"[{self.elapsed():5.1f}s] {label} [{bar:<24}] {counts}"
                self.stream.write("\r" + line[: WIDTH - 1].ljust(WIDTH - 1))
                self.stream.flush()
                self._drawn = True
                return
            tenth = int(min((done - start) / max(total - start, 1), 1.0) * 10)
            if tenth > self._tenth:
                self._tenth = tenth
                self._write(f"[{self.elapsed():5.1f}s] {label} {counts}")
