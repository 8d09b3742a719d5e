"""Alarms: configured thresholds on the figures a user watches (`telemetry.alarms`), checked as events arrive.

`Alarms` is a telemetry `Sink` like the views: every step row (ESS fraction, k3), weight sync (parity) and pool
snapshot (stale drops, learner idle) is compared with its threshold. A crossing is reported once, when it
happens, not on every event while the figure stays beyond: a warning line naming the figure and the threshold
(`Telemetry.note`), an `AlarmEvent` (`Telemetry.alarm`: the Prometheus gauge `asyncrl_alarm{name}` and the
dashboard show it) and, for a rule with `stop: true`, a clean stop of the run (`Controller.request_stop`). When
the figure comes back within the threshold an `AlarmEvent(active=False)` clears it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from asyncrl.config import AlarmName, AlarmRule
from asyncrl.telemetry.sinks import AlarmEvent, PoolSnapshot, Sink, SyncEvent


@dataclass(frozen=True)
class Check:
    """One alarm: its config key, the figure it watches (as it reads to a user) and the direction of trouble."""

    name: AlarmName
    figure: str
    above: bool
    """True: trouble is a figure above the threshold; False: below."""


ESS = Check("ess_fraction_below", "mismatch ESS fraction", above=False)
K3 = Check("k3_above", "mismatch k3 KL", above=True)
PARITY = Check("parity_above", "weight-sync parity max |engine - learner| log-prob", above=True)
STALE_DROPS = Check("stale_drops_above", "fraction of finished samples dropped as stale", above=True)
LEARNER_IDLE = Check("learner_idle_above", "learner idle fraction", above=True)


class Alarms(Sink):
    """Checks each configured rule against the events; `report` is the run's Telemetry, `request_stop` the
    controller's (both called from the controller's thread, inside the event that crossed)."""

    def __init__(self, config: dict[AlarmName, AlarmRule], report: Sink, request_stop: Callable[[str], None]):
        self.config = config
        self.report = report
        self.request_stop = request_stop
        self.active: dict[str, AlarmEvent] = {}
        """Alarms beyond their threshold now, by name."""
        self.fired: list[AlarmEvent] = []
        """Every crossing of the run, in order: this sink's own and those raised elsewhere (`starved`, by the
        controller), which reach it through the run's Telemetry."""
        self.first_step_s: float | None = None
        """Run time of the first step row: windows that start before it measure start-up, not training."""

    def step(self, row: dict[str, Any]) -> None:
        if self.first_step_s is None:
            self.first_step_s = row.get("wall_s", 0.0)
        self.check(ESS, row.get("mismatch_kappa_ess"), f"step {row.get('step')}")
        self.check(K3, row.get("mismatch_k3_kl"), f"step {row.get('step')}")

    def sync(self, event: SyncEvent) -> None:
        self.check(PARITY, event.parity, f"weight sync to version {event.version}")

    def pool(self, snapshot: PoolSnapshot) -> None:
        """Stale drops and learner idle over the live window, once the window lies after the first step
        (before it the learner waits for engines to start: idle by design)."""
        live = snapshot.live
        if (
            live is None
            or live.window_s <= 0
            or self.first_step_s is None
            or snapshot.wall_s - live.window_s < self.first_step_s
        ):
            return
        where = f"the last {live.window_s:.0f} s"
        self.check(STALE_DROPS, live.stale_drop_fraction, where)
        self.check(LEARNER_IDLE, live.learner_idle_fraction, where)

    def alarm(self, event: AlarmEvent) -> None:
        """An alarm raised anywhere in the run (its own come back through the Telemetry: kept once)."""
        if event.active and not any(seen is event for seen in self.fired):
            self.fired.append(event)

    def check(self, check: Check, value: float | None, where: str) -> None:
        """Compare `value` with the rule of `check` (nothing when the rule is off or the figure unknown)."""
        rule = self.config.get(check.name)
        if rule is None or value is None:
            return
        beyond = value > rule.threshold if check.above else value < rule.threshold
        if beyond and check.name not in self.active:
            self._fire(check, rule, value, where)
        elif not beyond and check.name in self.active:
            del self.active[check.name]
            message = (
                f"alarm {check.name} cleared: {check.figure} {value:.4g} ({where}) is back within {rule.threshold:g}"
            )
            self.report.note(message)
            self.report.alarm(AlarmEvent(check.name, value, rule.threshold, message, rule.stop, active=False))

    def _fire(self, check: Check, rule: AlarmRule, value: float, where: str) -> None:
        side = "above" if check.above else "below"
        message = f"ALARM {check.name}: {check.figure} {value:.4g} ({where}) is {side} the threshold {rule.threshold:g}"
        event = AlarmEvent(check.name, value, rule.threshold, message, rule.stop)
        self.active[check.name] = event
        self.fired.append(event)
        self.report.note(message)
        self.report.alarm(event)
        if rule.stop:
            self.request_stop(f"alarm {check.name}: {check.figure} {value:.4g} {side} {rule.threshold:g}")
