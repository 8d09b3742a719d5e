"""A telemetry sink that keeps what it is told, for tests that check what a run noted and which alarms it raised."""

from __future__ import annotations

from asyncrl.telemetry.sinks import AlarmEvent, Sink


class RecordingSink(Sink):
    def __init__(self) -> None:
        self.notes: list[str] = []
        self.alarms: list[AlarmEvent] = []

    def note(self, text: str) -> None:
        self.notes.append(text)

    def alarm(self, event: AlarmEvent) -> None:
        self.alarms.append(event)
