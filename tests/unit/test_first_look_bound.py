"""A model path on a file system that does not answer (a hung network mount: even ``stat`` blocks in the kernel)
must not hold rank 0's loop: the first look at a request's files is bounded, and the request fails saying why.
The hung call is stood in for by a resolve that blocks until the test releases it (a hung mount cannot be made
without root)."""

import threading
import time

import pytest

from xdit_backend.errors import UserError
from xdit_backend.models import file_kind
from xdit_backend.service import leader as leader_module
from xdit_backend.service.leader import Leader
from xdit_backend.service.server import Job
from xdit_backend.wire.protocol import Message


class Sent(list):
    def send(self, message: Message) -> None:
        self.append(message)


def test_a_look_that_never_returns_becomes_an_error_naming_the_files(monkeypatch):
    released = threading.Event()
    started = time.monotonic()
    with pytest.raises(UserError, match="model 'x' did not answer within 0.4 s: its file system is not responding"):
        file_kind.answered_within(0.4, released.wait, "model 'x'")
    assert time.monotonic() - started < 5
    started = time.monotonic()
    with pytest.raises(UserError, match="model 'x' did not answer within"):  # still blocked: refused at once
        file_kind.answered_within(30, released.wait, "model 'x'")
    looks = [thread for thread in threading.enumerate() if thread.name == "xdit-first-look"]
    assert time.monotonic() - started < 1 and len(looks) == 1  # the first look's thread only, still blocked
    released.set()
    time.sleep(0.2)
    assert file_kind.answered_within(5, lambda: 7, "model 'x'") == 7  # it answers again: looked at anew


def test_answers_and_errors_of_the_look_come_back_as_they_are():
    assert file_kind.answered_within(5, lambda: 42, "x") == 42
    with pytest.raises(KeyError, match="kept"):
        file_kind.answered_within(5, lambda: {}["kept"], "x")


def test_rank_0_answers_a_request_whose_model_hangs_and_goes_on(monkeypatch):
    released = threading.Event()
    monkeypatch.setattr(leader_module, "resolve_model", lambda ref: released.wait())  # stat on a hung mount
    monkeypatch.setattr(file_kind, "FIRST_LOOK_S", 0.6)
    leader = Leader.__new__(Leader)  # the first look needs no ranks
    leader.model_roots = ()
    replies = Sent()
    job = Job(Message("sample", {"id": "hung", "model": "/mnt/nfs/flux1-dev.safetensors", "width": 64,
                                 "height": 64, "steps": 1}), replies)
    started = time.monotonic()
    leader.sample(job)  # returns: the loop that serves the next job is free
    assert time.monotonic() - started < 5
    [error] = replies
    assert error.type == "error" and error.fields["kind"] == "bad_request"
    assert "'/mnt/nfs/flux1-dev.safetensors' or its LoRA files did not answer within 0.6 s" in error.fields["message"]
    assert "copy the model to a local disk" in error.fields["hint"]
    released.set()
