"""``xdit-backend selftest``: the GPU smoke suite, the first command to run on a GPU machine.

runner.py runs the sections in order and prints PASS, FAIL or SKIP for each, with its figures;
the sections live in kernels.py (environment, attention, a ring on one GPU), models.py (families,
samplers, LoRA, host syncs), storage.py (fp8, scaled-fp8 and GGUF files kept as stored), memory.py
(the memory model against the allocator's peak, a LoRA's patches on one base), service.py (a world-1
backend, an injected fault, the demo) and scale.py (torch.compile, the full-size Flux.1-dev
architecture). Without CUDA the suite skips and says why; ``--cpu`` runs what can run on the CPU, a
dry run of the suite's own code (the tests do).
"""
