"""A stand-in for the ring buffer the Hubble reader polls, for tests of the reader pipeline."""

from __future__ import annotations

import queue

from cilia_agent.hubble.reader import RecordCallback


class FakeSource:
    """RecordSource handing over batches of records from a thread-safe queue."""

    def __init__(self) -> None:
        self.batches: queue.Queue[list[bytes]] = queue.Queue()
        self.callback: RecordCallback | None = None

    def open(self, on_record: RecordCallback) -> None:
        self.callback = on_record

    def poll(self, timeout_ms: int) -> None:
        try:
            batch = self.batches.get(timeout=timeout_ms / 1000)
        except queue.Empty:
            return
        assert self.callback is not None
        for record in batch:
            self.callback(record)
