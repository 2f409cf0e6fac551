"""Parallel methods, attached to a model from outside: one module per method."""
