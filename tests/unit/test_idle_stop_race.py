"""A request that arrives exactly at the --idle-stop deadline (after rank 0's wait for a job ran out, before it
decides to stop) is served, not accepted and then failed with ``shutdown``: rank 0's idle step alone, with the
real socket server's queue and a clock past the deadline."""

from fake_time import FakeTime

from xdit_backend.launch.idle import IdleClock
from xdit_backend.service.leader import Leader
from xdit_backend.service.server import Job, SocketServer
from xdit_backend.wire.protocol import Message


class NoModels:
    def loaded(self) -> list[str]:
        return []


class Sent(list):
    def send(self, message: Message) -> None:
        self.append(message)


def _rank_0_past_its_deadline(tmp_path) -> tuple[Leader, list]:
    clock = FakeTime()
    leader = Leader.__new__(Leader)  # rank 0's idle step needs only these
    leader.idle = IdleClock(unload_after=0.0, stop_after=60.0, now=clock)
    leader.server = SocketServer(tmp_path / "backend.sock", status=dict)
    leader.executor = NoModels()
    stops = []
    leader.shut_down = lambda message, why, spare=None: stops.append(why)
    clock.t += 61.0
    return leader, stops


def test_a_request_queued_at_the_deadline_is_served_not_failed(tmp_path):
    leader, stops = _rank_0_past_its_deadline(tmp_path)
    replies = Sent()
    job = Job(Message("sample", {"id": "at-the-deadline"}), replies)
    assert leader.server._enqueue(job) is None  # accepted while rank 0 was between its wait and its decision
    assert leader.on_idle() is True and stops == []  # the backend goes on
    assert leader.server.next_job(timeout=0) is job and replies == []  # and runs it: nothing failed it
    assert not leader.server.shutting_down


def test_with_nothing_queued_the_backend_stops_and_refuses_what_comes_after(tmp_path):
    leader, stops = _rank_0_past_its_deadline(tmp_path)
    assert leader.on_idle() is False and len(stops) == 1 and "--idle-stop" in stops[0]
    late = Job(Message("sample", {"id": "late"}), Sent())
    assert "--idle-stop" in leader.server._enqueue(late)  # refused at once, with the reason, never queued
