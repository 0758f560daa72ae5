"""What this machine's CPU is, as a key: DeepSpeed's JIT-built ops (`launch.deepspeed.engine`)
and the measured CPU GEMM peak (`launch.metrics`) are kept per CPU type."""

from __future__ import annotations

import hashlib
import platform
import re
from pathlib import Path


def read_cpuinfo() -> str:
    """/proc/cpuinfo, or a line naming the machine where there is none."""
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return f"model name: {platform.machine()} {platform.processor()}"


def cpu_key(cpuinfo: str) -> str:
    """A name for this CPU type, from /proc/cpuinfo's first processor: its model name, readable,
    and a hash of what `-march=native` compiles for (the instruction-set flags, vendor, family
    and model; on ARM the features, implementer and part). Two node types may share a model name
    but not the flags their hypervisor exposes."""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        key, colon, value = line.partition(":")
        if not colon:
            if fields:
                break  # the blank line after the first processor
            continue
        fields.setdefault(key.strip(), value.strip())
    name = re.sub(
        r"[^a-z0-9]+", "-", fields.get("model name", fields.get("CPU part", "unknown")).lower()
    ).strip("-")
    keys = (
        "vendor_id",
        "cpu family",
        "model",
        "flags",
        "CPU implementer",
        "CPU architecture",
        "CPU part",
        "Features",
    )
    identity = "\n".join(f"{key}={' '.join(sorted(fields.get(key, '').split()))}" for key in keys)
    return f"{name or 'unknown'}-{hashlib.sha256(identity.encode()).hexdigest()[:12]}"
