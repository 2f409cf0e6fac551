"""A clock the test moves by hand (``clock.t += 5``), for the code that takes its time source as an argument: the
idle clock (tests/backend/test_idle.py, tests/unit/test_idle_stop_race.py) and load progress
(tests/unit/test_load_progress.py)."""


class FakeTime:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t
