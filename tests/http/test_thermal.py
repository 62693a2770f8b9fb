"""Thermal policy with a fake temperature file: throttling and the precision switch kick in
above the threshold and release when cool."""
from __future__ import annotations

import time

import httpx
import pytest

from edgellm.serving.thermal import ThermalGovernor
from tests.http.conftest import MODEL_ID


def test_governor_scale_and_hysteresis(tmp_path):
    sensor = tmp_path / "temp"
    governor = ThermalGovernor(sensor, threshold_c=75, hysteresis_c=5, poll_s=0)
    sensor.write_text("50000")  # sysfs millidegrees
    assert governor.state().hot is False and governor.state().rate_scale == 1.0
    sensor.write_text("80")
    state = governor.state()
    assert state.hot and state.rate_scale == pytest.approx(1 - (80 - 60) / 100)
    sensor.write_text("72")  # below the threshold but within the hysteresis: still hot
    assert governor.state().hot
    sensor.write_text("69")
    assert not governor.state().hot
    assert (governor.throttle_events, governor.restore_events) == (1, 1)


def test_missing_sensor_never_throttles(tmp_path):
    governor = ThermalGovernor(tmp_path / "absent", poll_s=0)
    assert governor.state().hot is False


def test_hot_device_throttles_decode_and_switches_kv_precision(server_factory, served_model, tmp_path, monkeypatch):
    """While hot, the engine stretches every decode step to the cool step time / rate_scale (it sleeps
    the difference: checked by what it asks to sleep, not by the clock, since a request's wall time
    is mostly HTTP and prefill on a fast CPU) and serves with the fallback KV precision."""
    from edgellm.serving import service

    sensor = tmp_path / "temp"
    sensor.write_text("45")
    server = server_factory(thermal=ThermalGovernor(sensor, threshold_c=75, poll_s=0))
    body = {"model": MODEL_ID, "prompt": "Once upon a time", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    url = server.url + "/v1/completions"
    paced: list[float] = []
    real_sleep = time.sleep
    monkeypatch.setattr(service.time, "sleep", lambda s: paced.append(s) or real_sleep(s))

    def paced_reply() -> tuple[list[float], dict]:
        paced.clear()
        reply = httpx.post(url, json=body, timeout=120).json()
        return list(paced), reply

    cool_sleeps, cool = paced_reply()  # measures the cool decode step time
    assert cool["edgellm"]["degraded"] == [] and cool_sleeps == []
    sensor.write_text("95")  # scale 1 - 35/100 = 0.65: each step stretched to ~1.5x the cool one
    hot_sleeps, hot = paced_reply()
    assert set(hot["edgellm"]["degraded"]) == {"thermal_throttle", "thermal_kv_fallback"}
    assert len(hot_sleeps) >= 20  # every decode step is paced: it waits for what the cool rate leaves (0 when late)
    assert sum(s > 0 for s in hot_sleeps) >= len(hot_sleeps) // 2
    assert hot["edgellm"]["kv_precision"] == "int8"  # the fallback KV served the hot request
    sensor.write_text("40")
    restored_sleeps, restored = paced_reply()
    assert restored["edgellm"]["degraded"] == [] and restored["edgellm"]["kv_precision"] == "f16"
    assert restored_sleeps == []
    assert served_model.kv.config.k_precision == "f16"  # per request: the shared model is never changed
    metrics = httpx.get(server.url + "/metrics").text
    assert 'edgellm_thermal_events{kind="throttle"} 1.0' in metrics
    assert 'edgellm_thermal_events{kind="restore"} 1.0' in metrics
    assert 'edgellm_degrades_total{reason="thermal_throttle"} 1.0' in metrics
