"""PipeFusion's stages in-process (through a backend: tests/backend/test_pipefusion.py, test_parity.py)."""

from xdit_backend.parallel.pipefusion import stage_bounds


def test_stages_are_balanced_by_parameters():
    assert stage_bounds([2, 2, 1, 1, 1, 1], 2) == [(0, 2), (2, 6)]
    assert stage_bounds([5, 1, 1, 1, 1, 1], 2) == [(0, 1), (1, 6)]
    assert stage_bounds([1, 1, 1, 1], 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert stage_bounds([1, 1, 1, 1], 2, counts=(3, 1)) == [(0, 3), (3, 4)]
