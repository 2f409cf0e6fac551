"""When an idle backend lets go of its GPUs: unload its models after ``--idle-unload`` seconds
without a request, and stop after ``--idle-stop`` seconds without one (0: never, the default of a
backend started by hand; the ComfyUI nodes start theirs with 30 minutes and 4 hours).

Both are counted from the end of the last queued request (``sample`` or ``unload``): asking for
``status`` does not keep a backend alive, or a page that watches it would hold the GPUs forever.
Rank 0's loop (leader.py) asks ``due`` whenever it wakes without a job and waits at most
``wait``, so a deadline is met to within the time a broadcast takes, whatever the heartbeat.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from ..errors import UserError

UNLOAD, STOP = "unload", "stop"

# What a backend the ComfyUI nodes start uses (nodes/sampler.py), unless the environment says otherwise
NODES_UNLOAD_AFTER_S = 30 * 60.0
NODES_STOP_AFTER_S = 4 * 3600.0
UNLOAD_ENV, STOP_ENV = "XDIT_IDLE_UNLOAD", "XDIT_IDLE_STOP"


def nodes_idle_times(environ: Mapping[str, str]) -> tuple[float, float]:
    """(unload after, stop after) in seconds for a backend the nodes start: $XDIT_IDLE_UNLOAD and
    $XDIT_IDLE_STOP (set where ComfyUI starts; 0: never), else 30 minutes and 4 hours."""
    times = []
    for name, default in ((UNLOAD_ENV, NODES_UNLOAD_AFTER_S), (STOP_ENV, NODES_STOP_AFTER_S)):
        text = environ.get(name, "").strip()
        try:
            value = float(text) if text else default
        except ValueError:
            value = -1.0
        if not value >= 0:
            raise UserError(f"${name}={text!r} is not a number of seconds",
                            f"set it to 0 (never) or a number of seconds, e.g. {name}={default:g}, or unset it "
                            f"(default {default:g})")
        times.append(value)
    return times[0], times[1]


@dataclass
class IdleClock:
    unload_after: float  # seconds without a request before the models are unloaded; 0: never
    stop_after: float  # seconds without a request before the backend stops; 0: never
    now: Callable[[], float] = time.monotonic
    last_request: float = field(init=False)  # when the last request ended (at first: when the backend started)
    running: bool = field(init=False, default=False)

    def __post_init__(self):
        self.last_request = self.now()

    def request_started(self) -> None:
        self.running = True

    def request_ended(self) -> None:
        """The idle time starts again from now."""
        self.running = False
        self.last_request = self.now()

    def idle_s(self) -> float:
        return 0.0 if self.running else self.now() - self.last_request

    def due(self, models_loaded: bool) -> str | None:
        """What the backend should do now: STOP, UNLOAD (only with models to unload), or None."""
        idle = self.idle_s()
        if self.stop_after and idle >= self.stop_after:
            return STOP
        if self.unload_after and idle >= self.unload_after and models_loaded:
            return UNLOAD
        return None

    def wait(self, heartbeat: float) -> float:
        """How long rank 0 may wait for a job: the heartbeat, or less when a deadline comes first."""
        idle = self.idle_s()
        ahead = [limit - idle for limit in (self.unload_after, self.stop_after) if limit and limit > idle]
        return min([heartbeat, *ahead])

    def to_json(self) -> dict:
        """For ``status``: the settings and how long the backend has been idle."""
        return {"unload_after_s": self.unload_after, "stop_after_s": self.stop_after,
                "idle_s": round(self.idle_s(), 1)}
