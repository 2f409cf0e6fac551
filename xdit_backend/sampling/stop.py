"""The one exception a sampler loop raises on purpose; its own module so that samplers.py and
generate.py (which imports samplers) both import it at the top, without a cycle."""


class GenerationStopped(Exception):
    """The step callback asked to stop (a cancel, a client that went away)."""
