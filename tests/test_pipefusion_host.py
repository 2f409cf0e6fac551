"""PipeFusion's result is on the device even with nothing to do."""

from types import SimpleNamespace

import torch

from xdit_backend.parallel.pipefusion import PipeFusion


class _Layout:
    """The part of a mesh.Layout PipeFusion reads: one stage of two, no other parallelism."""

    config = SimpleNamespace(pipefusion=2, num_pipeline_patch=None, warmup_steps=1, sequence=1)
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
