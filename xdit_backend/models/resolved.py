"""A model argument resolved once for a request, and handed down instead of its name.

A request names its model: a built-in or a path. The leader (to validate the request and choose its
layout) and each rank's executor (to run it) resolve that name once and pass this object to what needs
the model: its spec, the identity the model cache keys on, its shapes on the meta device for the fit
check, the block sizes PipeFusion cuts into stages, where the step cache's span begins, its attention
width. What is costly to find (a file's header, the meta transformer, the block sizes) is kept per
version of the file, so a request resolves in microseconds once a model has been seen.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from . import registry
from .base import FamilySpec


@dataclass(frozen=True)
class ResolvedModel:
    """A resolved model argument: where its weights come from (``source``) and the facts of its version."""

    name: str  # as the request gives it: a built-in's name or a path
    source: registry.ModelSource
    version: int  # the file's (or folder's) modification time in ns; 0 for a built-in

    @property
    def cache_name(self) -> str:
        """What a loaded model is cached under: a built-in's name, else the resolved path."""
        return self.name if self.source.kind == "builtin" else self.source.ref

    @functools.cached_property
    def spec(self) -> FamilySpec:
        """What the model takes and allows, from its config: nothing is built or loaded."""
        return registry.FAMILIES[self.source.family].spec(self.source.config)

    def on_meta(self) -> torch.nn.Module:
        """The diffusers transformer with its parameters on the meta device: its shapes, no weights (the fit
        check and auto size a model with it before loading). Built once per version of the model (a
        full-size one takes a quarter of a second of CPU), so read it, never change it."""
        return _on_meta(self.cache_name, self.version)

    @property
    def block_sizes(self) -> tuple[int, ...]:
        """Parameter count of each transformer block, in execution order (nothing allocated)."""
        return _block_sizes(self.cache_name, self.version)

    @property
    def cache_head(self) -> int:
        """Where the step cache's span (its CachePlan) begins, as an index in the block order PipeFusion
        cuts into stages: the stage that holds that block decides for every stage."""
        return _cache_head(self.cache_name, self.version)

    @property
    def width(self) -> int:
        """The attention width C = heads × head size (auto's traffic model)."""
        return math.prod(registry.attention_geometry(self.source.config))

    def build(self, device: torch.device, dtype: torch.dtype = torch.float32, loras=(),
              blocks: tuple[int, int] | None = None, weight_dtype: str = "default", sharding=None, progress=None):
        """The model built or loaded onto ``device`` (registry.build_source)."""
        return registry.build_source(self.source, self.name, device, dtype, loras, blocks, weight_dtype, sharding,
                                     progress)


def resolve_model(ref: str) -> ResolvedModel:
    """A built-in name, a model file or a diffusers folder, resolved (registry.resolve) with its version."""
    source = registry.resolve(ref)
    version = 0 if source.kind == "builtin" else Path(source.ref).stat().st_mtime_ns
    return ResolvedModel(ref, source, version)


@functools.lru_cache(maxsize=8)
def _on_meta(cache_name: str, version: int) -> torch.nn.Module:
    return registry.construct(registry.resolve(cache_name))


@functools.lru_cache(maxsize=32)
def _block_sizes(cache_name: str, version: int) -> tuple[int, ...]:
    transformer = _on_meta(cache_name, version)
    lists = registry.FAMILIES[registry.resolve(cache_name).family].block_lists
    blocks = [block for name in lists for block in getattr(transformer, name)]
    return tuple(sum(p.numel() for p in block.parameters()) for block in blocks)


@functools.lru_cache(maxsize=32)
def _cache_head(cache_name: str, version: int) -> int:
    transformer = _on_meta(cache_name, version)
    source = registry.resolve(cache_name)
    family = registry.FAMILIES[source.family]
    lists, first = family.block_lists, family.spec(source.config).cache_plan.blocks[0]
    return sum(len(getattr(transformer, name)) for name in lists[:lists.index(first)])
