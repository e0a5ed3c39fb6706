"""Progress for long commands: a tqdm bar on a terminal, a plain line every `every_s` seconds otherwise (logs
and CI output should not fill with carriage returns)."""

from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, total: int, desc: str, unit: str = "it", every_s: float = 10.0, stream=None):
        self.total, self.desc, self.unit, self.every_s = total, desc, unit, every_s
        self.stream = stream or sys.stderr
        self.done = 0
        self.bar = None
        self._start = self._last = time.perf_counter()
        if self.stream.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=desc, unit=unit, dynamic_ncols=True, file=self.stream)

    def update(self, n: int = 1) -> None:
        self.done += n
        if self.bar is not None:
            self.bar.update(n)
            return
        now = time.perf_counter()
        if now - self._last >= self.every_s or self.done >= self.total:
            self._last = now
            rate = self.done / max(now - self._start, 1e-9)
            eta = (self.total - self.done) / rate if rate > 0 else float("inf")
            print(
                f"{self.desc}: {self.done}/{self.total} {self.unit}s ({rate:.0f}/s, eta {eta:.0f} s)",
                file=self.stream,
                flush=True,
            )

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.close()
