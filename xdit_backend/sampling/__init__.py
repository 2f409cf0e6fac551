"""Schedules, samplers and noise, with ComfyUI's math so results match KSampler's."""
