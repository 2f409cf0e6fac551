"""Host synchronisations per sampler step: the check that the step loop never makes the host wait
for the device.

The host should queue a step's kernels while the GPU still runs the previous ones. Anything that
needs a device value on the host stops that and leaves the GPU idle until the host catches up:
``.item()``, ``bool()`` / ``float()`` / ``int()`` of a tensor (an ``if`` on a device scalar),
``.tolist()``, ``.numpy()``, ``.cpu()``, and a blocking host→device copy (``t.to(device)``,
``torch.tensor(data, device=…)``, ``new_tensor``), which waits for the stream to drain first.

``count_syncs(device)`` counts them while a generation runs, split by step::

    with count_syncs(model.device) as syncs:
        generate(Denoiser(model), gen, syncs.after_step)
    syncs.per_step  # [prologue and step 1, step 2, …]: a sound loop has zeros after the first

The first entry holds the generation's prologue too (the latent, noise and conditioning copied to
the device once); what runs after the last step (the result back to the host) is in ``total`` only.

- On CUDA the count is torch's own detector, ``torch.cuda.set_sync_debug_mode("warn")``: every
  synchronising call warns, and the warnings are counted here instead of shown.
- On any other device the Tensor methods above are patched for the duration: a read of a non-CPU
  tensor's values counts, and so does a blocking copy from the CPU to a non-CPU device. The CPU
  tests run the model on ``meta``, which stands in for an accelerator (shapes, no data): a read of a
  meta tensor gets a stand-in (zeros, False) so that the run goes on and every sync is counted.
  Copies with ``non_blocking=True`` are not counted: they are asynchronous when their source is
  pinned, which sampling/host_copy.py sees to on CUDA.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from contextlib import contextmanager

import torch

CUDA_SYNC_WARNING = "synchronizing CUDA operation"  # what torch's sync debug mode warns


class SyncCount:
    """Host synchronisations counted so far (``total``), and the running count at each step's end."""

    def __init__(self, counter: Callable[[], int]):
        self._counter = counter
        self.marks: list[int] = []

    @property
    def total(self) -> int:
        return self._counter()

    def after_step(self, done: int, steps: int) -> bool:
        """``generate``'s after_step: marks a step's end (and never stops the generation)."""
        self.marks.append(self.total)
        return True

    @property
    def per_step(self) -> list[int]:
        """Syncs in each step; the first also holds the generation's prologue."""
        return [end - begin for begin, end in zip([0, *self.marks], self.marks)]


@contextmanager
def count_syncs(device: str | torch.device):
    """Count host synchronisations while the block runs on ``device`` (see the module's text)."""
    if torch.device(device).type == "cuda":
        with _cuda_sync_warnings() as count:
            yield count
    else:
        with _patched_tensor_methods() as count:
            yield count


@contextmanager
def _cuda_sync_warnings():
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield SyncCount(lambda: sum(CUDA_SYNC_WARNING in str(w.message) for w in caught))
        finally:
            torch.cuda.set_sync_debug_mode(previous)


def _on_device(tensor: torch.Tensor) -> bool:
    return tensor.device.type != "cpu"


def _stand_in(tensor: torch.Tensor) -> torch.Tensor:
    """Zeros on the CPU in place of a meta tensor's (absent) values."""
    return torch.zeros(tensor.shape, dtype=tensor.dtype)


@contextmanager
def _patched_tensor_methods():
    """The Tensor methods that read device values on the host, or copy host data to the device
    blocking, counting; each does what it did before, except that reads of meta tensors give stand-ins."""
    saved = {name: vars(torch.Tensor).get(name) for name in
             ("item", "tolist", "numpy", "cpu", "__bool__", "__float__", "__int__", "__index__", "to", "copy_",
              "new_tensor")}
    saved_factories = {"tensor": torch.tensor, "as_tensor": torch.as_tensor}
    original = {name: getattr(torch.Tensor, name) for name in saved}
    calls = [0]
    count = SyncCount(lambda: calls[0])

    def read(name, stand_in):
        def method(tensor, *args, **kwargs):
            if not _on_device(tensor):
                return original[name](tensor, *args, **kwargs)
            calls[0] += 1
            return stand_in(tensor) if tensor.device.type == "meta" else original[name](tensor, *args, **kwargs)
        return method

    def to(tensor, *args, **kwargs):
        target, _, non_blocking, _ = torch._C._nn._parse_to(*args, **kwargs)
        if target is not None and _on_device(tensor) and target.type == "cpu":
            calls[0] += 1
            if tensor.device.type == "meta":
                return original["to"](_stand_in(tensor), *args, **kwargs)
        elif target is not None and not _on_device(tensor) and target.type != "cpu" and not non_blocking:
            calls[0] += 1
        return original["to"](tensor, *args, **kwargs)

    def copy_(destination, source, non_blocking=False):
        if _on_device(source) and not _on_device(destination):
            calls[0] += 1
            if source.device.type == "meta":
                return destination.zero_()
        elif _on_device(destination) and not _on_device(source) and not non_blocking:
            calls[0] += 1
        return original["copy_"](destination, source, non_blocking)

    def new_tensor(tensor, data, *args, **kwargs):
        if _on_device(tensor) and kwargs.get("device") is None:
            calls[0] += 1  # host data onto the tensor's device
        return original["new_tensor"](tensor, data, *args, **kwargs)

    def factory(name):
        def make(data, *args, **kwargs):
            device = kwargs.get("device")
            if device is not None and torch.device(device).type != "cpu":
                calls[0] += 1  # host data onto the device
            return saved_factories[name](data, *args, **kwargs)
        return make

    patches = {
        "item": read("item", lambda t: _stand_in(t).item()),
        "tolist": read("tolist", lambda t: _stand_in(t).tolist()),
        "numpy": read("numpy", lambda t: _stand_in(t).numpy()),
        "cpu": read("cpu", _stand_in),
        "__bool__": read("__bool__", lambda t: False),
        "__float__": read("__float__", lambda t: 0.0),
        "__int__": read("__int__", lambda t: 0),
        "__index__": read("__index__", lambda t: 0),
        "to": to, "copy_": copy_, "new_tensor": new_tensor,
    }
    try:
        for name, method in patches.items():
            setattr(torch.Tensor, name, method)
        for name in saved_factories:
            setattr(torch, name, factory(name))
        yield count
    finally:
        for name, method in saved.items():
            if method is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, method)
        for name, function in saved_factories.items():
            setattr(torch, name, function)
