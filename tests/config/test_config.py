"""Config precedence (default < file < env < flags < code), sources, conflicts and bad input."""

from __future__ import annotations

import warnings

import pytest

from meshkit import Engine, RunConfig
from meshkit.config.resolve import ConfigError, launch_flags_to_env, parse_assignments, resolve
from meshkit.engine import ConfigConflictWarning


@pytest.fixture
def config_file(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(
        "precision: bf16\ngrad_accum_steps: 2\nparallel:\n  tp: 1\nseed: 5\ncompile:\n  mode: max-autotune\n"
    )
    return path


def test_each_layer_overrides_the_one_below(config_file) -> None:
    env = {"MESHKIT_GRAD_ACCUM_STEPS": "3", "MESHKIT_SEED": "6", "MESHKIT_COMPILE__BACKEND": "aot_eager"}
    resolved = resolve(
        code={"seed": 8},
        flags={"seed": "7", "grad_accum_steps": "4"},
        flag_labels={"seed": "flag --set seed"},
        env=env,
        file=config_file,
    )
    cfg = resolved.config
    assert cfg.precision == "bf16" and resolved.sources["precision"] == f"file {config_file}"
    assert cfg.compile.mode == "max-autotune" and resolved.sources["compile.mode"].startswith("file")
    assert cfg.compile.backend == "aot_eager" and resolved.sources["compile.backend"] == "env MESHKIT_COMPILE__BACKEND"
    assert cfg.grad_accum_steps == 4 and resolved.sources["grad_accum_steps"] == "flag grad_accum_steps"
    assert cfg.seed == 8 and resolved.sources["seed"] == "code"
    assert cfg.threads_per_process is None and resolved.sources["threads_per_process"] == "default"
    rows = {key: (value, source) for key, value, source in resolved.rows()}
    assert rows["seed"] == ("8", "code")
    assert len(rows) == len(resolved.sources)


def test_code_beats_a_conflicting_flag_with_one_warning(monkeypatch) -> None:
    monkeypatch.setenv(
        "MESHKIT_LAUNCH_FLAGS", launch_flags_to_env({"precision": "fp16"}, {"precision": "flag --precision"})
    )
    resolved = resolve(code={"precision": "bf16"})
    assert resolved.config.precision == "bf16"
    assert len(resolved.conflicts) == 1
    message = resolved.conflicts[0].message()
    assert "'bf16'" in message and "'fp16'" in message and "flag --precision" in message
    with pytest.warns(ConfigConflictWarning, match="flag --precision sets 'fp16'"):
        Engine(precision="bf16").end()


def test_equal_code_and_flag_values_do_not_warn(monkeypatch) -> None:
    monkeypatch.setenv("MESHKIT_LAUNCH_FLAGS", launch_flags_to_env({"grad_accum_steps": "2"}, {}))
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConfigConflictWarning)
        Engine(grad_accum_steps=2).end()


def test_config_object_and_nested_sections_are_code(config_file) -> None:
    resolved = resolve(code={"compile": True, "parallel": {"dp_replicate": 1}}, env={}, file=config_file)
    assert resolved.config.compile.enabled and resolved.sources["compile.enabled"] == "code"
    engine = Engine(RunConfig(precision="fp16"), seed=3)
    assert engine.config.precision == "fp16" and engine.config.seed == 3
    assert engine.resolved.sources["precision"] == "code"
    engine.end()


def test_default_file_in_the_user_config_dir_is_read(tmp_path) -> None:
    (tmp_path / "xdg" / "meshkit").mkdir(parents=True)
    (tmp_path / "xdg" / "meshkit" / "config.yaml").write_text("seed: 42\n")
    resolved = resolve(env={"XDG_CONFIG_HOME": str(tmp_path / "xdg")})
    assert resolved.config.seed == 42
    assert resolved.sources["seed"].endswith("config.yaml")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"code": {"paralel": {"tp": 2}}}, "unknown config key 'paralel' (code argument): did you mean 'parallel.tp'?"),
        ({"code": {"precison": "bf16"}}, "did you mean 'precision'?"),
        ({"env": {"MESHKIT_GRAD_ACUM_STEPS": "2"}}, "environment variable MESHKIT_GRAD_ACUM_STEPS"),
        ({"code": {"tp": "two"}}, "invalid value 'two' for 'parallel.tp' (code)"),
        ({"flags": {"precision": "fp8"}}, "invalid value 'fp8' for 'precision' (flag precision)"),
        ({"code": {"tp": -1, "pp": -1}}, "only one size may be -1"),
        ({"code": {"grad_accum_steps": 0}}, "'grad_accum_steps'"),
        ({"code": {"launch": {"nnodes": 2, "node_rank": 2}}}, "node_rank=2 must be below nnodes=2"),
    ],
)
def test_bad_input_is_one_clear_line(kwargs, message) -> None:
    kwargs.setdefault("env", {})
    with pytest.raises(ConfigError) as err:
        resolve(**kwargs)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_bad_files(tmp_path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        resolve(env={}, file=tmp_path / "missing.yaml")
    broken = tmp_path / "broken.yaml"
    broken.write_text("precision: [bf16\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        resolve(env={}, file=broken)
    listing = tmp_path / "list.yaml"
    listing.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        resolve(env={}, file=listing)


def test_text_values_and_yaml_quirks(tmp_path) -> None:
    path = tmp_path / "quirks.yaml"
    path.write_text("precision: no\nlogging:\n  trackers: jsonl\n")  # YAML reads a bare `no` as False
    resolved = resolve(env={"MESHKIT_MAX_GRAD_NORM": "none", "MESHKIT_TP": "-1"}, file=path)
    assert resolved.config.precision == "no"
    assert resolved.config.max_grad_norm is None
    assert resolved.config.parallel.tp == -1 and resolved.config.parallel.dp_replicate == 1
    assert parse_assignments(["tp=2", "compile.mode=max-autotune"]) == {
        "parallel.tp": "2",
        "compile.mode": "max-autotune",
    }
    with pytest.raises(ConfigError, match="is not KEY=VALUE"):
        parse_assignments(["tp"])


def test_none_on_the_command_line_is_the_none_choice_where_there_is_one() -> None:
    from meshkit.config.resolve import parse_assignments

    flags = parse_assignments(
        ["activation_checkpointing.mode=none", "sharding.offload=none", "pipeline.microbatches=none"]
    )
    config = resolve(flags=flags, env={}).config
    assert (config.activation_checkpointing.mode, config.sharding.offload) == ("none", "none")
    assert config.pipeline.microbatches is None  # an optional number: null


def test_omp_num_threads_is_the_thread_count_below_meshkit_own_variable() -> None:
    """The user's OMP_NUM_THREADS sets threads_per_process (shown with its source); MESHKIT_* still wins."""
    resolved = resolve(env={"OMP_NUM_THREADS": "3"}, file=None)
    assert resolved.config.threads_per_process == 3
    assert resolved.sources["threads_per_process"] == "env OMP_NUM_THREADS"
    assert resolve(env={"OMP_NUM_THREADS": "4,2"}).config.threads_per_process == 4  # OpenMP's nested form
    both = resolve(env={"OMP_NUM_THREADS": "3", "MESHKIT_THREADS_PER_PROCESS": "2"})
    assert both.config.threads_per_process == 2 and both.sources["threads_per_process"].endswith("PER_PROCESS")
    assert resolve(env={"OMP_NUM_THREADS": "3"}, code={"threads_per_process": 1}).config.threads_per_process == 1
    with pytest.raises(ConfigError, match=r"OMP_NUM_THREADS='lots' is not a thread count"):
        resolve(env={"OMP_NUM_THREADS": "lots"})


def test_a_thread_count_the_launcher_chose_stays_the_default() -> None:
    launched = resolve(env={"OMP_NUM_THREADS": "2", "MESHKIT_LAUNCHER_SET_OMP_NUM_THREADS": "2"})
    assert launched.config.threads_per_process is None and launched.sources["threads_per_process"] == "default"
