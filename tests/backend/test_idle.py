"""An idle backend lets go of its GPUs: the clock alone (a fake time), then real CPU backends
started with idle times of seconds."""

import time

import pytest
from conftest import SMALL
from fake_time import FakeTime

from xdit_backend.client import NoBackend
from xdit_backend.errors import UserError
from xdit_backend.launch import launcher
from xdit_backend.launch.idle import STOP, UNLOAD, IdleClock, nodes_idle_times
from xdit_backend.launch.options import LaunchError, LaunchOptions


def test_the_clock_unloads_then_stops_and_a_request_starts_it_again():
    now = FakeTime()
    clock = IdleClock(unload_after=60.0, stop_after=600.0, now=now)
    assert clock.due(models_loaded=True) is None
    assert clock.wait(heartbeat=30.0) == 30.0  # the heartbeat comes before either deadline
    now.t += 50.0
    assert clock.wait(heartbeat=30.0) == 10.0  # wakes at the unload deadline, not a heartbeat later
    now.t += 10.0
    assert clock.due(models_loaded=True) == UNLOAD
    assert clock.due(models_loaded=False) is None  # nothing to unload: nothing to do
    assert clock.wait(heartbeat=30.0) == 30.0  # the unload deadline has passed; the stop is 540 s away
    now.t += 530.0
    assert clock.wait(heartbeat=30.0) == 10.0
    clock.request_started()
    now.t += 5000.0  # a long request is not idle time
    assert clock.idle_s() == 0.0 and clock.due(models_loaded=True) is None
    clock.request_ended()  # both deadlines are counted from now again
    now.t += 20.0
    assert clock.due(models_loaded=True) is None and clock.wait(heartbeat=30.0) == 30.0
    now.t += 580.0
    assert clock.due(models_loaded=False) == STOP and clock.due(models_loaded=True) == STOP


def test_zero_means_never():
    now = FakeTime()
    clock = IdleClock(unload_after=0.0, stop_after=0.0, now=now)
    now.t += 1e9
    assert clock.due(models_loaded=True) is None and clock.wait(heartbeat=30.0) == 30.0


def test_a_negative_idle_time_is_refused():
    with pytest.raises(LaunchError, match="--idle-stop -1 must be 0"):
        LaunchOptions(socket="/tmp/x.sock", nproc=1, device="cpu", idle_stop=-1.0).resolved()


def wait_for(condition, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "the condition did not hold in time"
        time.sleep(0.2)


def test_idle_backend_unloads_its_models_then_stops_cleanly(backends):
    client = backends.start(2, idle_unload=2.0, idle_stop=8.0)
    client.sample(SMALL)
    status = client.status()
    assert status["idle"]["unload_after_s"] == 2.0 and status["idle"]["stop_after_s"] == 8.0
    wait_for(lambda: client.status()["models"] == [])
    assert client.hello_or_none() is not None, "unloading must not stop the backend"
    wait_for(lambda: client.hello_or_none() is None)
    sock = backends.started[-1][0]
    wait_for(lambda: (launcher.read_state(sock) or {}).get("status") == "stopped")
    assert not sock.exists()
    with pytest.raises(NoBackend):
        client.status()


def test_a_request_in_between_resets_the_clock(backends):
    """Two requests 4 s apart, the second ending past the 6 s the first would have left: still serving."""
    client = backends.start(2, idle_stop=6.0)
    client.sample(SMALL)
    time.sleep(4.0)
    client.sample(SMALL)
    time.sleep(4.0)
    assert client.hello_or_none() is not None, "the second request must have reset the idle clock"


def test_the_nodes_idle_times_default_to_30_minutes_and_4_hours_and_follow_the_environment():
    assert nodes_idle_times({}) == (1800.0, 14400.0)
    assert nodes_idle_times({"XDIT_IDLE_UNLOAD": "60", "XDIT_IDLE_STOP": "0"}) == (60.0, 0.0)
    for bad in ("soon", "-5", "nan"):
        with pytest.raises(UserError, match=f"XDIT_IDLE_STOP={bad!r} is not a number of seconds"):
            nodes_idle_times({"XDIT_IDLE_STOP": bad})
