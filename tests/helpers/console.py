"""An in-memory console (what the agent's log pumps write to) that a test can wait on."""

from __future__ import annotations

import re

import anyio


class Sink:
    """A text stream that keeps what was written; :meth:`wait_for` awaits a pattern instead of sleeping."""

    def __init__(self) -> None:
        self.chunks: list[str] = []
        self._changed: anyio.Event | None = None

    @property
    def text(self) -> str:
        return "".join(self.chunks)

    def write(self, s: str, /) -> int:
        self.chunks.append(s)
        if self._changed is not None:
            self._changed.set()
        return len(s)

    def flush(self) -> None:
        pass

    async def wait_for(self, pattern: str, count: int = 1) -> list[re.Match[str]]:
        """The first ``count`` matches of ``pattern`` (multiline) once the text has them."""
        while True:
            found = list(re.finditer(pattern, self.text, re.MULTILINE))
            if len(found) >= count:
                return found
            self._changed = anyio.Event()
            await self._changed.wait()
