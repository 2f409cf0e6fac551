"""distributed."""
