"""The links' figures are timed once per machine and kept (topology.py): a later start of the same ranks on
the same devices reuses them, so ``auto`` decides from the same figures after a restart; ``again`` times
anew and replaces them; ``off`` times nothing; a damaged kept file or entry is measured over, never trusted."""

import json
import os
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from spawned import on_ranks

from xdit_backend.distributed.runtime import Runtime
from xdit_backend.distributed.topology import KEPT_ENV, probe

BOGUS = {"gbps": {"0,1": 123.0}, "tflops": 4.5}  # figures no probe of this machine would give


def _probe_in_every_mode(rank: int, kept_path: str) -> dict:
    os.environ[KEPT_ENV] = kept_path
    rt = Runtime(rank, 2, rank, torch.device("cpu"), dist.group.WORLD, 0.0, timedelta(seconds=60))
    kept = Path(kept_path)
    seen = {"damaged": probe(rt, None, None, "on").to_json()}  # the file holds no JSON: timed, and kept
    dist.barrier()
    seen["file"] = json.loads(kept.read_text())
    dist.barrier()
    if rank == 0:  # the kept entry changed under the backend's feet: only a reused entry can show these
        [key] = seen["file"]
        kept.write_text(json.dumps({key: {**BOGUS, "at": seen["file"][key]["at"]}}))
    dist.barrier()
    seen["reused"] = probe(rt, None, None, "on").to_json()
    seen["again"] = probe(rt, None, None, "again").to_json()
    dist.barrier()
    seen["file after again"] = json.loads(kept.read_text())
    dist.barrier()  # every rank has read it before rank 0 writes it
    if rank == 0:  # an entry with a negative bandwidth: not a figure to decide from
        kept.write_text(json.dumps({key: {**BOGUS, "gbps": {"0,1": -1.0}, "at": 0} for key in seen["file"]}))
    dist.barrier()
    seen["bad entry"] = probe(rt, None, None, "on").to_json()
    seen["off"] = probe(rt, None, None, "off").to_json()
    return seen


def test_figures_are_kept_per_machine_reused_retimed_on_again_and_never_read_when_damaged(tmp_path):
    kept = tmp_path / "topology.json"
    kept.write_text("{not json")
    ranks = on_ranks(_probe_in_every_mode, 2, str(kept))
    assert ranks[0] == ranks[1], "every rank must see the same links (auto decides on each)"
    seen = ranks[0]

    timed = seen["damaged"]
    assert timed["measured"] == "measured at this start" and timed["pairs"][0]["bandwidth_gbps"] > 0
    [entry] = seen["file"].values()
    assert entry["gbps"] == {"0,1": timed["pairs"][0]["bandwidth_gbps"]} and entry["tflops"] == timed["compute_tflops"]

    reused = seen["reused"]
    assert reused["pairs"] == [{"ranks": [0, 1], "p2p": False, "bandwidth_gbps": 123.0}]
    assert reused["compute_tflops"] == 4.5 and reused["measured"].endswith(", kept")

    again = seen["again"]
    assert again["measured"] == "measured at this start" and again["pairs"][0]["bandwidth_gbps"] != 123.0
    [entry] = seen["file after again"].values()
    assert entry["gbps"] == {"0,1": again["pairs"][0]["bandwidth_gbps"]}  # what was kept is replaced

    assert seen["bad entry"]["measured"] == "measured at this start"
    assert seen["bad entry"]["pairs"][0]["bandwidth_gbps"] > 0

    off = seen["off"]
    assert off["pairs"][0]["bandwidth_gbps"] is None and off["compute_tflops"] is None and off["measured"] is None
