"""PipeFusion's step loop reads nothing back from the device (the stale K/V buffers track what is
written on the host; σ are host floats), and its result is on the device even with nothing to do.
The ``meta`` device holds no values: any read-back there raises, as a host sync would cost on a GPU."""

from types import SimpleNamespace

import pytest
import torch

from xdit_backend.distributed.config import ParallelConfig
from xdit_backend.models import registry
from xdit_backend.parallel.pipefusion import PipeFusion, call_sigmas
from xdit_backend.parallel.stale_kv import Chunk, KVBuffer, StaleKV
from xdit_backend.service.request import SampleRequest
from xdit_backend.wire.protocol import Message

B, L, H, D = 2, 3, 2, 4
FRAMES, ROWS, COLUMNS = 2, 4, 3
TOKENS = L + FRAMES * ROWS * COLUMNS  # every position a buffer holds (without references)


def _attention(sees_text=True):
    """A StaleKV whose kernel hands back the K/V it was given."""
    seen = []

    def kernel(q, k, v):
        seen.append((k, v))
        return q, None

    return StaleKV(Chunk(), None, kernel, sees_text, KVBuffer()), seen


def _run_chunk(attention, truth_k, truth_v, rows, first, references=0):
    """One chunk through ``attention``: its text and references (the step's ``first`` chunk carries them) and its
    rows of every frame, cut from the truth [B, L + R + N, H, D]."""
    chunk = attention.chunk
    chunk.describe(L if first else 0, L, (FRAMES, ROWS, COLUMNS), rows, references if first else 0, references)
    prefix = L + references
    image = [truth[:, prefix:].view(B, FRAMES, ROWS, COLUMNS, H, D)[:, :, rows[0]:rows[1]].reshape(B, -1, H, D)
             for truth in (truth_k, truth_v)]  # [B, T · rows · C, H, D]
    start = 0 if attention.sees_text else L  # a module that does not see the text is given the rest only
    key, value = ((torch.cat([truth[:, start:prefix], part], dim=1) if first else part)
                  for truth, part in zip((truth_k, truth_v), image))
    attention(key.clone(), key, value)


def _written(rows_written: set, with_text: bool, references: int = 0) -> torch.Tensor:
    """[L + R + N] bool: the positions a chunk sequence wrote, in token order (text, references, then frame-major
    rows)."""
    rows = torch.tensor([r in rows_written for r in range(ROWS)])
    image = rows.view(1, ROWS, 1).expand(FRAMES, ROWS, COLUMNS).reshape(-1)
    return torch.cat([torch.full((L,), with_text), torch.ones(references, dtype=torch.bool), image])


@pytest.mark.parametrize("references", [0, 5])
@pytest.mark.parametrize("sees_text", [True, False])
def test_stale_kv_attends_to_exactly_the_written_positions_in_token_order(sees_text, references):
    """A first step without warm-up: patches of rows 2, then 0, then 1 and 3 (non-contiguous,
    two frames), the first carrying the text and the reference tokens (an edit's); each read holds the written
    positions only, as a mask over the tokens picks them; then a second step's first patch, whose read is whole."""
    truth_k, truth_v = (torch.randn(B, TOKENS + references, H, D) for _ in range(2))
    attention, seen = _attention(sees_text)
    written = set()
    for index, rows in enumerate([(2, 3), (0, 1), (1, 2), (3, 4)]):
        _run_chunk(attention, truth_k, truth_v, rows, first=index == 0, references=references)
        written |= set(range(*rows))
        mask = _written(written, sees_text, references)
        k, v = seen[-1]
        assert torch.equal(k, truth_k[:, mask]) and torch.equal(v, truth_v[:, mask]), (index, rows)
    _run_chunk(attention, truth_k, truth_v, (0, 2), first=True, references=references)
    mask = _written(written, sees_text, references)
    assert torch.equal(seen[-1][0], truth_k[:, mask]) and torch.equal(seen[-1][1], truth_v[:, mask])


def test_stale_kv_reads_nothing_back_from_the_device():
    """On ``meta`` (no values): partial reads, then full ones, of the right sizes, and no error from a
    flag or a mask read back to the host."""
    meta = torch.device("meta")
    truth = torch.empty(B, TOKENS, H, D, device=meta)
    attention, seen = _attention()
    for index, rows in enumerate([(0, 2), (2, 4), (0, 2)]):
        _run_chunk(attention, truth, truth, rows, first=index == 0)
    sizes = [k.shape[1] for k, _ in seen]
    assert sizes == [L + FRAMES * 2 * COLUMNS, TOKENS, TOKENS]
    assert seen[-1][0].device == meta


def test_the_sigma_of_each_call_is_a_host_float():
    """The step loop builds each σ tensor from a host float (a fill), never by copying a host tensor
    to the device (a synchronisation per step on CUDA)."""
    spec = registry.spec("flux-tiny")
    request = SampleRequest.parse(Message("sample", {"model": "flux-tiny", "width": 64, "height": 64, "steps": 4,
                                                     "sampler": "dpmpp_2m_sde"}, {}))
    gen = request.generation(spec, {}, None)
    sigmas = call_sigmas(gen.sampler, gen.sigmas, gen.sampling)
    assert len(sigmas) == 4 and all(type(sigma) is float for sigma in sigmas), sigmas


class _Layout:
    """The part of a mesh.Layout PipeFusion reads: one stage of two, no other parallelism."""

    config = ParallelConfig(pipefusion=2)
    sequence_group, sequence_index, links = None, 0, None

    def group(self, axis):
        return None

    def index(self, axis):
        return 0


def test_nothing_to_do_returns_the_input_on_the_device():
    """start_step past the end: the input latent comes back on the stage's device, where dp gathers it."""
    meta = torch.device("meta")
    model = SimpleNamespace(spec=SimpleNamespace(stage_plan=None))
    gen = SimpleNamespace(steps=0, latent=torch.zeros(2, 16, 8, 8))
    result = PipeFusion(model, _Layout(), meta, []).run(gen, slice(1, 2), after_step=None)
    assert result.device == meta and result.shape == (1, 16, 8, 8)
