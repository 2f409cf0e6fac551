"""Many clients at once: every answer is its own request's (equal to the serial result for its
seed), requests run in the order they arrived, and a client that leaves disturbs nobody."""

import socket
import threading

import torch

from xdit_backend.service.reference import serial_latent
from xdit_backend.wire import protocol
from xdit_backend.wire.protocol import Message

CLIENTS, REQUESTS = 8, 5
FIELDS = {"model": "flux-tiny", "width": 64, "height": 64, "steps": 2, "cfg": 1.0}


def serial(seed: int) -> torch.Tensor:
    return serial_latent({**FIELDS, "seed": seed})


def test_eight_clients_times_five_requests_get_their_own_answers_in_fifo_order(backend2):
    results, errors = {}, []

    def client(index: int) -> None:
        try:
            for n in range(REQUESTS):
                seed = 1000 + index * REQUESTS + n
                tensors, info = backend2.sample({**FIELDS, "seed": seed, "parallel": {"ulysses": 2}})
                results[seed] = (tensors["samples"], info["order"])
        except Exception as exc:  # noqa: BLE001 - every failure is reported by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(CLIENTS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=600)
    assert not errors and len(results) == CLIENTS * REQUESTS, errors
    for seed, (latent, _) in results.items():
        assert (latent - serial(seed)).abs().max() <= 1e-4, seed  # no cross-talk: its own seed's latent
    by_arrival = sorted((order for _, order in results.values()), key=lambda order: order["arrival"])
    executions = [order["execution"] for order in by_arrival]
    assert executions == sorted(executions), "run in arrival order (FIFO)"
    assert len({order["arrival"] for order in by_arrival}) == CLIENTS * REQUESTS


def test_a_client_that_leaves_mid_request_disturbs_nobody(backend2):
    """One client queues a long request and disconnects; the others' requests are answered right."""
    leaver = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    leaver.connect(str(backend2.socket_path))
    conn = protocol.Connection(leaver, direction="reply")
    conn.send(Message("sample", {**FIELDS, "id": "leaver", "seed": 1, "steps": 500, "width": 256, "height": 256}))
    conn.receive(idle_timeout=60)  # its first progress: it is running
    leaver.close()
    tensors, _ = backend2.sample({**FIELDS, "seed": 77, "parallel": {"ring": 2}})
    assert (tensors["samples"] - serial(77)).abs().max() <= 1e-4
