"""Issue 30: a model's first run sat at a silent 0 % while its weights were read. The build reports each tensor
read (the parameters of the keys it fills, so far and in all), and rank 0 tells the person waiting a line at each
new tenth, at most one a second."""

import torch
from safetensors.torch import save_file
from backend.test_model_files import bfl_state_dict
from fake_time import FakeTime

from xdit_backend.models import registry
from xdit_backend.models.resolved import resolve_model
from xdit_backend.service.load_progress import LoadProgress


def test_a_line_at_each_new_tenth_once_a_second_has_passed():
    said, clock = [], FakeTime()
    tell = LoadProgress(said.append, "flux1-dev.safetensors", 2 << 30, min_interval_s=1.0, clock=clock)
    tell(5, 100)
    clock.t += 2
    tell(9, 100)  # still in the first tenth: nothing to say
    tell(25, 100)
    tell(35, 100)  # a new tenth, but within the second after the last line
    clock.t += 0.5
    tell(38, 100)
    clock.t += 0.6
    tell(41, 100)
    clock.t += 5
    tell(100, 100)
    # 25 % and 41 % of 2 GiB: 512 MiB and 839.68 MiB
    assert said == ["loading flux1-dev.safetensors: 25 % (512 MiB of 2.0 GiB)",
                    "loading flux1-dev.safetensors: 41 % (840 MiB of 2.0 GiB)",
                    "loading flux1-dev.safetensors: 100 % (2.0 GiB of 2.0 GiB)"]


def test_a_load_within_the_second_says_nothing_and_a_folder_has_no_size():
    said, clock = [], FakeTime()
    tell = LoadProgress(said.append, "flux-tiny", None, min_interval_s=1.0, clock=clock)
    for done in range(0, 101, 10):
        tell(done, 100)
    assert said == []
    clock.t += 1
    tell(100, 100)
    assert said == ["loading flux-tiny: 100 %"]


def test_the_build_reports_every_parameter_it_fills_once(tmp_path):
    """Reading a file: the report grows with each tensor and ends at the model's whole state dict; a PipeFusion
    stage's ends at its own keys' (its blocks and the layers around them), fewer than the whole."""
    path = tmp_path / "flux.safetensors"
    save_file(bfl_state_dict(registry.build("flux-tiny", torch.device("cpu")).transformer), str(path))
    reports = []
    whole = registry.build(str(path), torch.device("cpu"), progress=lambda done, total: reports.append((done, total)))
    state = whole.transformer.state_dict()
    in_all = sum(t.numel() for t in state.values())
    assert len(reports) == len(state)
    assert all(total == in_all for _, total in reports)
    assert [done for done, _ in reports] == sorted(done for done, _ in reports)
    assert reports[-1] == (in_all, in_all)

    staged = []
    blocks = len(resolve_model(str(path)).block_sizes)
    registry.build(str(path), torch.device("cpu"), blocks=(1, blocks - 1),
                   progress=lambda done, total: staged.append((done, total)))
    assert staged[-1][0] == staged[-1][1] < in_all
