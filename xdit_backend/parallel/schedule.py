"""PipeFusion's schedule: the work items every stage runs in order, and where each stage meets the step gate.

Items: one per warm-up step (the whole latent, exact), then one per patch and step. Every stage
runs the same list in order; stage s + 1 takes item i from stage s, stage 0 takes item i's input
rows from the last stage's items of the step before.

The step gate (control.StepGate, one all-reduce over every rank per step) must not drain the
pipeline: if every rank met it at the end of its own step k, stage 0 would wait there for the
last stage to finish step k, then the last stage would wait for stage 0's first patch of step
k + 1 — N − 1 idle patch slots per step. Instead each stage meets gate k where it is in the
ideal pipelined timeline when the last stage finishes step k: the last stage after its last
item of step k, stage 0 some patches into step k + 1 (``gate_positions``). Every rank still
passes every gate in order, so a Cancel or a failure seen at gate k stops every rank before it
starts more than one further step of its own: within two steps.

The positions are closed under the items' dependencies (an item a stage runs before gate k only
needs items its peers run before gate k), so no rank waits at a gate for work a peer can only do
after it; and the messages a rank receives in the interval before gate k are exactly those its
peers send in that interval (``window``), so on a stop every posted receive has its send.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Item:
    """Patches [first, end) of one step, run through the stages as one chunk of the latent."""

    step: int
    first: int
    end: int


def items(steps: int, warmup: int, patches: int) -> list[Item]:
    """The work list: the whole latent in each warm-up step, then each patch of each later step."""
    work = []
    for step in range(steps):
        chunks = [(0, patches)] if step < warmup else [(p, p + 1) for p in range(patches)]
        work.extend(Item(step, first, end) for first, end in chunks)
    return work


def _needs(work: list[Item]) -> list[int]:
    """For each item, the last item of the step before whose rows stage 0 needs back (−1: none)."""
    needs = []
    for i, item in enumerate(work):
        before = [j for j in range(i) if work[j].step == item.step - 1
                  and work[j].first < item.end and item.first < work[j].end]
        needs.append(max(before, default=-1))
    return needs


def gate_positions(work: list[Item], stages: int, steps: int) -> list[list[int]]:
    """[stage][k]: index of the last item the stage runs before meeting gate k (after step k).

    From the ideal timeline (each item costs its number of patches, transfers free): the last
    stage meets gate k when it finishes step k; every other stage after the items it has
    finished by then.
    """
    needs = _needs(work)
    finish = [[0] * len(work) for _ in range(stages)]
    for i, item in enumerate(work):
        cost = item.end - item.first
        for s in range(stages):
            ready = finish[s][i - 1] if i else 0
            if s:
                ready = max(ready, finish[s - 1][i])
            elif needs[i] >= 0:
                ready = max(ready, finish[stages - 1][needs[i]])
            finish[s][i] = ready + cost
    last_of_step = [max(i for i, item in enumerate(work) if item.step == k) for k in range(steps)]
    positions = []
    for s in range(stages):
        positions.append([max(i for i in range(len(work)) if finish[s][i] <= finish[stages - 1][e])
                          for e in last_of_step])
    return positions


def window(positions: list[int], gate: int) -> range:
    """The items a stage runs between gate ``gate`` − 1 and gate ``gate``: those whose messages its
    peer receives in that interval."""
    start = positions[gate - 1] + 1 if gate else 0
    return range(start, positions[gate] + 1)
