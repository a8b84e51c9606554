"""Whether the kernel's out-of-memory killer ended a worker: its count of OOM kills in this process's memory cgroup
(cgroup v2 `memory.events`, v1 `memory.oom_control`), read when the job starts and when a rank dies by a SIGKILL
nobody in the job sent. The workers share the launcher's cgroup, so a rise is theirs (or a neighbour's in the same
cgroup: the line says "most likely")."""

from __future__ import annotations

from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


def oom_kill_count(root: Path = CGROUP_ROOT, membership: Path = Path("/proc/self/cgroup")) -> int | None:
    """The `oom_kill` count of this process's memory cgroup, None where no cgroup file says it."""
    for counters in _counter_files(root, membership):
        try:
            text = counters.read_text()
        except OSError:
            continue
        for line in text.splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill" and value.strip().isdigit():
                return int(value)
    return None


def _counter_files(root: Path, membership: Path) -> list[Path]:
    """Candidate counter files: this process's own cgroup first, then the mount's root (inside a container the
    cgroup namespace's root is the container's own cgroup)."""
    try:
        lines = membership.read_text().splitlines()
    except OSError:
        lines = []
    found: list[Path] = []
    for line in lines:
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        relative = path.strip().lstrip("/")
        if controllers == "":  # cgroup v2 (unified)
            found += [root / relative / "memory.events", root / "memory.events"]
        elif "memory" in controllers.split(","):
            found += [root / "memory" / relative / "memory.oom_control", root / "memory" / "memory.oom_control"]
    return found


def sigkill_hint(before: int | None, after: int | None) -> str:
    """What to add to 'rank N was killed by signal SIGKILL', given the OOM-kill counts at start and now."""
    if before is not None and after is not None and after > before:
        kills = after - before
        return (
            f" — most likely by the kernel's out-of-memory killer ({kills} OOM kill{'s' * (kills > 1)} in this "
            "job's memory cgroup since it started): lower micro_batch_size or sequence_len, shard more (zero_stage 3, "
            "cp, offload), or run fewer ranks per host (`meshkit estimate` says what a rank needs)"
        )
    return " (nobody in the job sent it; the kernel's out-of-memory killer is the usual sender: see `dmesg`)"
