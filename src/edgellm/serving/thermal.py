"""Thermal policy: read a temperature; above the threshold, slow decoding down (target rate
× (1 − (T − 60)/100)) and run new requests with the lower-precision KV fallback; restore when
cool again (with hysteresis so the state does not flap)."""
from __future__ import annotations

import glob
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

LINUX_ZONES = "/sys/class/thermal/thermal_zone*/temp"
BASE_C = 60.0  # where the slowdown formula starts counting
MIN_SCALE = 0.1


def _read_file(path: str | Path) -> float:
    value = float(Path(path).read_text().strip())
    return value / 1000.0 if value > 200 else value  # sysfs reports millidegrees


def linux_temperature() -> float | None:
    """The hottest thermal zone, or None where there is none (containers, other systems)."""
    temps = []
    for zone in glob.glob(LINUX_ZONES):
        try:
            temps.append(_read_file(zone))
        except (OSError, ValueError):
            continue
    return max(temps) if temps else None


@dataclass
class ThermalState:
    temperature_c: float | None
    hot: bool
    rate_scale: float  # 1.0 when cool


class ThermalGovernor:
    def __init__(self, source: str | Path | Callable[[], float | None] | None = None, *,
                 threshold_c: float = 75.0, hysteresis_c: float = 5.0, poll_s: float = 1.0):
        if source is None:
            self._read = linux_temperature
        elif callable(source):
            self._read = source
        else:
            self._read = lambda: _read_file(source)
        self.threshold_c, self.hysteresis_c, self.poll_s = threshold_c, hysteresis_c, poll_s
        self.hot = False
        self.throttle_events = 0
        self.restore_events = 0
        self._last_poll = 0.0
        self._state = ThermalState(None, False, 1.0)

    def state(self) -> ThermalState:
        """The current policy, re-reading the sensor at most every poll_s seconds."""
        now = time.monotonic()
        if now - self._last_poll >= self.poll_s:
            self._last_poll = now
            self._state = self._update(self._safe_read())
        return self._state

    def _safe_read(self) -> float | None:
        try:
            return self._read()
        except (OSError, ValueError):
            return None  # a missing sensor never stops the service

    def _update(self, temp: float | None) -> ThermalState:
        if temp is not None and not self.hot and temp >= self.threshold_c:
            self.hot = True
            self.throttle_events += 1
        elif self.hot and (temp is None or temp <= self.threshold_c - self.hysteresis_c):
            self.hot = False
            self.restore_events += 1
        scale = max(MIN_SCALE, 1.0 - (temp - BASE_C) / 100.0) if self.hot and temp is not None else 1.0
        return ThermalState(temp, self.hot, scale)
