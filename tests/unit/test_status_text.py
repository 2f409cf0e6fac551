"""The backend's status as people read it (the xDiT Backend node, `xdit-backend status`): both shapes
of the record, before and after per-rank memory and per-model dicts."""

from xdit_backend.launch.status_text import describe, human_bytes

GiB = 1 << 30

BASE = {"version": "0.1.0", "pid": 4242, "world_size": 2, "attention_kernel": "flash", "uptime_s": 61.4,
        "ranks": [{"rank": 0, "device": "cuda:0", "device_name": "NVIDIA RTX 4090", "gpu": 2, "uuid": "GPU-ab12"},
                  {"rank": 1, "device": "cuda:1", "device_name": "NVIDIA RTX 4090", "gpu": 3, "uuid": None}],
        "queued": 0, "running": None}


def test_names_only_as_before():
    text = describe({**BASE, "models": ["flux1-dev.safetensors (bfloat16)"]})
    assert text.splitlines() == [
        "xDiT backend 0.1.0 (pid 4242), world size 2, attention flash, up 61 s",
        "rank 0: cuda:0 = GPU 2 (NVIDIA RTX 4090, GPU-ab12)",
        "rank 1: cuda:1 = GPU 3 (NVIDIA RTX 4090)",
        "models loaded:",
        "  flux1-dev.safetensors (bfloat16)",
    ]


def test_memory_per_rank_models_as_dicts_and_the_idle_times():
    memory = [{"total": 24 * GiB, "free": 10 * GiB, "allocated": 12 * GiB, "peak": 13.5 * GiB, "parameters": 6 * GiB},
              {"total": 24 * GiB, "free": 11 * GiB, "allocated": 11 * GiB, "peak": 12.5 * GiB,
               "parameters": 6 * GiB}]
    model = {"name": "/models/flux1-dev-fp8.safetensors", "storage_dtype": "float8_e4m3fn",
             "compute_dtype": "bfloat16", "sharded": True,
             "loras": [{"path": "/loras/style.safetensors", "strength": 0.8}], "bytes_per_rank": [6 * GiB, 6 * GiB]}
    status = {**BASE, "memory": memory, "models": [model], "queued": 2, "running": "ab12",
              "idle": {"unload_after_s": 1800.0, "stop_after_s": 0.0, "idle_s": 0.0}}
    assert describe(status).splitlines() == [
        "xDiT backend 0.1.0 (pid 4242), world size 2, attention flash, up 61 s",
        "idle 0 s; unloads the models at 1800 s idle, stops never",
        "running ab12, 2 queued",
        "rank 0: cuda:0 = GPU 2 (NVIDIA RTX 4090, GPU-ab12)",
        "  memory: 24.0 GiB total, 10.0 GiB free, 12.0 GiB allocated, 13.5 GiB peak, 6.0 GiB parameters",
        "rank 1: cuda:1 = GPU 3 (NVIDIA RTX 4090)",
        "  memory: 24.0 GiB total, 11.0 GiB free, 11.0 GiB allocated, 12.5 GiB peak, 6.0 GiB parameters",
        "models loaded:",
        "  /models/flux1-dev-fp8.safetensors: storage float8_e4m3fn, compute bfloat16, sharded, "
        "LoRA /loras/style.safetensors × 0.8; per rank 6.0 GiB, 6.0 GiB",
    ]


def test_memory_inside_each_rank_entry_and_an_unsharded_model_without_loras():
    ranks = [{**rank, "memory": {"total": 8 * GiB, "free": 3 * GiB}} for rank in BASE["ranks"]]
    model = {"name": "flux-tiny", "storage_dtype": "float32", "compute_dtype": "float32", "sharded": False,
             "loras": [], "bytes_per_rank": [3 << 20, 3 << 20]}
    text = describe({**BASE, "ranks": ranks, "models": [model]})
    assert text.count("  memory: 8.0 GiB total, 3.0 GiB free") == 2
    assert "  flux-tiny: storage float32, compute float32, not sharded; per rank 3 MiB, 3 MiB" in text


def test_a_pipefusion_copy_of_a_model_is_told_apart_from_the_whole_one():
    """Issue 30: the stages of a PipeFusion run (each rank its blocks) read as a second identical flux-tiny."""
    whole = {"name": "flux-tiny", "storage_dtype": "float32", "compute_dtype": "float32", "sharded": False,
             "pipefusion_stages": False, "bytes_per_rank": [3 << 20, 3 << 20]}
    stages = {**whole, "pipefusion_stages": True, "bytes_per_rank": [2 << 20, 1 << 20]}
    lines = [line for line in describe({**BASE, "models": [whole, stages]}).splitlines() if "flux-tiny" in line]
    assert len(lines) == 2 and lines[0] != lines[1]
    assert "PipeFusion stages" in lines[1] and "PipeFusion" not in lines[0]


def test_no_models():
    assert describe({**BASE, "models": []}).endswith("models loaded: none")


def test_human_bytes():
    assert [human_bytes(n) for n in (512, 1536, 5 << 20, int(1.5 * GiB))] == ["512 B", "2 KiB", "5 MiB", "1.5 GiB"]
