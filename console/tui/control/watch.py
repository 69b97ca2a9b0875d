"""The console's file watch: another process changed a kernel cache, a sidecar or the launch
history, so the console plans again and refreshes at once (a refresh's own stamp sees structure
only, not a file changed in place)."""

from __future__ import annotations

import asyncio
import contextlib

from textual.app import App


class FileWatch:
    def __init__(self, app: App):
        self.app = app
        self.watching: tuple[str, ...] = ()
        self._stop: asyncio.Event | None = None

    def paths(self) -> tuple[str, ...]:
        from store.paths import state_dir

        spec = self.app.spec
        return tuple(str(p) for p in (spec.kernel_cache_dir, spec.model, state_dir()) if p.is_dir())

    def rearm(self) -> None:
        """Watch what exists now (a directory made since, e.g. the first run's checkpoint)."""
        paths = self.paths()
        if paths == self.watching:
            return
        self.watching = paths
        if self._stop:
            self._stop.set()
        if paths:
            self._stop = asyncio.Event()
            self.app.run_worker(self._watch(paths, self._stop), group="watch")

    async def _watch(self, paths: tuple[str, ...], stop: asyncio.Event) -> None:
        from watchfiles import awatch

        with contextlib.suppress(Exception):
            async for _ in awatch(*paths, stop_event=stop, debounce=400, recursive=True):
                if self.app.host is not None:
                    self.app.host.replan()
                self.app.refresh_now()
