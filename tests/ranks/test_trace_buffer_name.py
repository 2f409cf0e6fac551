"""The flight recorder's buffer variable the project sets for its ranks is the one the installed torch reads: a
gloo group started in a fresh interpreter with it set prints no deprecation warning (issue 30: the older name warned
twice on every start)."""

import os
import subprocess
import sys

from xdit_backend.launch import worker_env


def test_this_torch_reads_the_chosen_name_without_a_warning():
    """A gloo group started with the chosen variable set, on the pinned torch: no deprecation warning in its output."""
    script = ("import os, torch.distributed as dist; os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT='0');"
              "dist.init_process_group('gloo', rank=0, world_size=1, init_method='tcp://127.0.0.1:0');"
              "dist.destroy_process_group()")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False,
                            env={**os.environ, worker_env.trace_buffer_env(): "2000"})
    assert result.returncode == 0, result.stderr
    assert "deprecated" not in result.stderr
