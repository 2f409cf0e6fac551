"""A backend's ``status`` as text for people: what the xDiT Backend node shows in the page and
``xdit-backend status`` prints (``--json`` gives the record itself).

Reads both shapes of the record: ``models`` as names, or as dicts (name, storage and compute
dtype, sharded, LoRAs, bytes per rank); each rank's ``memory`` (total, free, allocated, peak,
parameters, in bytes) inside its ``ranks`` entry or in a top-level ``memory`` list, one per rank.
Light on purpose (no torch): the nodes import it.
"""

from __future__ import annotations

MEMORY_FIELDS = ("total", "free", "allocated", "peak", "parameters")


def describe(status: dict) -> str:
    ranks = status.get("ranks", [])
    lines = [f"xDiT backend {status.get('version')} (pid {status.get('pid')}), world size {status.get('world_size')}, "
             f"attention {status.get('attention_kernel')}, up {status.get('uptime_s', 0):.0f} s"]
    if "idle" in status:
        lines.append(idle_line(status["idle"]))
    if status.get("running") or status.get("queued"):
        lines.append(f"running {status.get('running') or 'nothing'}, {status.get('queued', 0)} queued")
    for rank in ranks:
        lines.append(f"rank {rank['rank']}: {device(rank)}")
        memory = rank_memory(status, rank["rank"])
        if memory:
            figures = [f"{human_bytes(memory[k])} {k}" for k in MEMORY_FIELDS if k in memory]
            lines.append("  memory: " + ", ".join(figures))
    models = status.get("models", [])
    lines.append("models loaded:" + ("" if models else " none"))
    lines += ["  " + model_line(model) for model in models]
    return "\n".join(lines)


def idle_line(idle: dict) -> str:
    """``idle 12 s; unloads the models at 1800 s idle, stops at 14400 s`` (0: never)."""
    def at(seconds: float) -> str:
        return f"at {seconds:g} s idle" if seconds else "never"

    return (f"idle {idle.get('idle_s', 0):.0f} s; unloads the models {at(idle.get('unload_after_s', 0))}, "
            f"stops {at(idle.get('stop_after_s', 0))}")


def rank_memory(status: dict, rank: int) -> dict | None:
    """A rank's memory record, from its ``ranks`` entry or the top-level ``memory`` list."""
    entry = next((r for r in status.get("ranks", []) if r.get("rank") == rank), {})
    if entry.get("memory"):
        return entry["memory"]
    memory = status.get("memory")
    if isinstance(memory, list) and rank < len(memory):
        return memory[rank]
    if isinstance(memory, dict):
        return memory.get(str(rank), memory.get(rank))
    return None


def model_line(model) -> str:
    """A loaded model: a name as it comes, or ``name: storage fp8, compute bf16, sharded, LoRA x × 0.8;
    per rank 6.0 GiB, 6.0 GiB``."""
    if not isinstance(model, dict):
        return str(model)
    parts = [f"storage {model['storage_dtype']}" if model.get("storage_dtype") else "",
             f"compute {model['compute_dtype']}" if model.get("compute_dtype") else "",
             "sharded" if model.get("sharded") else "not sharded" if "sharded" in model else "",
             "PipeFusion stages (each rank its blocks)" if model.get("pipefusion_stages") else ""]
    loras = model.get("loras") or []
    if loras:
        parts.append("LoRA " + ", ".join(lora_text(lora) for lora in loras))
    text = f"{model.get('name', '?')}: " + ", ".join(part for part in parts if part)
    per_rank = model.get("bytes_per_rank") or []
    if per_rank:
        text += "; per rank " + ", ".join(human_bytes(n) for n in per_rank)
    return text


def lora_text(lora) -> str:
    if isinstance(lora, dict):
        strength = lora.get("strength")
        return str(lora.get("path", lora.get("name", "?"))) + (f" × {strength:g}" if strength is not None else "")
    return str(lora)


def human_bytes(n: float) -> str:
    """Binary units, as nvidia-smi counts: 1.5 GiB, 12 MiB, 512 B."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}" if unit == "GiB" else f"{n / size:.0f} {unit}"
    return f"{n:.0f} B"


def device(rank: dict) -> str:
    """``cuda:0 = GPU 3 (NVIDIA H100 …, GPU-8f1…)``: the rank's local device and the physical GPU
    (nvidia-smi's number or CUDA_VISIBLE_DEVICES's entry) it is."""
    if rank.get("gpu") is None:
        return f"{rank['device']} ({rank['device_name']})"
    uuid = f", {rank['uuid']}" if rank.get("uuid") else ""
    return f"{rank['device']} = GPU {rank['gpu']} ({rank['device_name']}{uuid})"
