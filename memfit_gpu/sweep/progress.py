"""The sweep's progress bar on stderr: points DONE of all, and what runs or waits."""

from __future__ import annotations

import sys

from tqdm import tqdm


class Progress:
    def __init__(self, total: int, name: str):
        self.bar = tqdm(total=total, desc=f"sweep {name}", unit="point", file=sys.stderr, dynamic_ncols=True)

    def show(self, done: int, postfix: str) -> None:
        """Redraws only when something changed (a poll every second would flood a log file)."""
        if self.bar.n != done or self.bar.postfix != postfix:
            self.bar.n = done
            self.bar.set_postfix_str(postfix, refresh=False)
            self.bar.refresh()

    def close(self) -> None:
        self.bar.close()
