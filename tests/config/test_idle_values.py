"""A value a person set that changes nothing in this run is one notice line; defaults and schedulers pass."""

from __future__ import annotations

import pytest

from meshkit import Engine
from meshkit.config.idle import RULES, idle_values
from meshkit.config.resolve import leaf_keys, resolve


def test_every_rule_names_real_keys() -> None:
    assert {key for rule in RULES for key in rule.keys} <= set(leaf_keys())


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        ({"pipeline.microbatches": 4}, ["pipeline.microbatches=4 (flag x) has no effect with parallel.pp=1"]),
        ({"tensor_parallel.sequence_parallel": True}, ["tensor_parallel.sequence_parallel=True (flag x) has no"]),
        ({"sharding.offload_dir": "/tmp/x"}, ["sharding.offload_dir=/tmp/x (flag x) has no effect without sharding"]),
        ({"compile.mode": "max-autotune"}, ["compile.mode=max-autotune (flag x) has no effect with compile.enabled"]),
        ({"ps.mode": "async"}, ["ps.mode=async (flag x) has no effect without strategy=parameter_server"]),
        ({"pipeline.microbatches": 4, "parallel.pp": 2}, []),
        ({"compile.mode": "max-autotune", "compile.enabled": True}, []),
        ({"sharding.offload_dir": "/tmp/x", "sharding.offload": "nvme"}, []),
    ],
)
def test_idle_values_are_named_with_their_source_and_why(flags, expected) -> None:
    resolved = resolve(flags=flags, flag_labels={key: "flag x" for key in flags})
    notes = idle_values(resolved.config, dict(resolved.sources))
    assert len(notes) == len(expected)
    for note, start in zip(notes, expected, strict=True):
        assert note.startswith(start) and "\n" not in note


def test_defaults_and_a_schedulers_values_pass_silently() -> None:
    assert idle_values(resolve().config, dict(resolve().sources)) == []
    cluster = ({"launch.master_addr": "10.0.0.9"}, {"launch.master_addr": "env SLURM_JOB_NODELIST (SLURM)"})
    resolved = resolve(cluster=cluster)
    assert resolved.config.launch.master_addr == "10.0.0.9" and idle_values(resolved.config, resolved.sources) == []


def test_under_a_launcher_the_engine_names_only_what_came_from_code(monkeypatch, capsys) -> None:
    monkeypatch.setenv("MESHKIT_PIPELINE__MICROBATCHES", "4")
    engine = Engine(tensor_parallel={"sequence_parallel": True})
    engine.end()
    out = capsys.readouterr().out
    assert "meshkit: tensor_parallel.sequence_parallel=True (code) has no effect with parallel.tp=1" in out
    assert "pipeline.microbatches=4 (env MESHKIT_PIPELINE__MICROBATCHES) has no effect" in out  # no launcher here

    monkeypatch.setenv("MESHKIT_LAUNCHER_PID", "1")  # as under meshkit launch: it named the env value already
    engine = Engine(tensor_parallel={"sequence_parallel": True})
    engine.end()
    out = capsys.readouterr().out
    assert "sequence_parallel=True (code)" in out and "pipeline.microbatches" not in out
