"""Bad configs, flags and environment values: one line, exit code 2, no traceback, no worker started."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from meshkit.cli import app
from tests.helpers.cli import meshkit
from tests.helpers.distributed import free_port

BOMB = (
    "seed: [&a [l,l,l,l,l,l,l,l,l],&b [*a,*a,*a,*a,*a,*a,*a,*a,*a],&c [*b,*b,*b,*b,*b,*b,*b,*b,*b],"
    "&d [*c,*c,*c,*c,*c,*c,*c,*c,*c],&e [*d,*d,*d,*d,*d,*d,*d,*d,*d],&f [*e,*e,*e,*e,*e,*e,*e,*e,*e],*f]\n"
)


def in_process(*args: str, env: dict[str, str] | None = None) -> SimpleNamespace:
    """`meshkit ARGS` in this process: for errors raised before any worker or thread starts."""
    result = CliRunner().invoke(app, list(args), env=env)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return SimpleNamespace(returncode=result.exit_code, stderr=result.stderr)


def _one_line_error(proc, *needles: str) -> str:
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and len(lines[0]) < 700, proc.stderr[:2000]
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        (BOMB, "aliases expand the document past"),
        ("seed: &a [*a]\n", "refers to a node that contains it"),
        ("seed: " + "x" * 100_000 + "\n", "invalid value 'xxxx"),
    ],
)
@pytest.mark.timeout(120)  # an unguarded alias bomb expands for ever: the hang fails the test
def test_hostile_config_files_give_a_short_error(tmp_path, text, needle) -> None:
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    _one_line_error(in_process("config", "show", "--config-file", str(path)), needle)


@pytest.mark.parametrize(
    ("args", "env", "needle"),
    [
        (["--set", "collective_timeout_s=inf"], {}, "collective_timeout_s"),
        (["--set", "collective_timeout_s=1e300"], {}, "collective_timeout_s"),
        (["--rdzv-timeout", "inf"], {}, "launch.rdzv_timeout_s"),
        (["-m", "nosuch.sub"], {}, "module 'nosuch.sub' was not found"),
        (["--set", "tp=3"], {}, "tp=3 does not divide world size 2"),
        (["--set", "checkpoint.resume=/no/such/ckpt"], {}, "checkpoint.resume=/no/such/ckpt: no such checkpoint"),
        (["--nnodes", "2", "--master-addr", "no-such-host.invalid"], {}, "does not resolve"),
        (["--nnodes", "2", "--node-rank", "1", "--master-addr", "no-such-host.invalid"], {}, "does not resolve"),
        (["--nnodes", "2", "--master-addr", "192.0.2.1", "--master-port", "0"], {}, "is not an address of this host"),
    ],
)
def test_bad_values_and_launch_time_errors_are_one_line_before_any_worker(tmp_path, args, env, needle) -> None:
    marker = tmp_path / "ran"
    script = tmp_path / "job.py"
    script.write_text(f"open({str(marker)!r}, 'w').write('a worker ran')\n")
    target = [] if "-m" in args else [str(script)]
    _one_line_error(in_process("launch", "--nproc-per-node", "2", *args, *target, env=env), needle)
    assert not marker.exists()


def test_a_corrupt_launch_flags_variable_is_named(tmp_path) -> None:
    config = tmp_path / "run.yaml"
    config.write_text("train: {steps: 1}\n")
    proc = in_process("train", str(config), env={"MESHKIT_LAUNCH_FLAGS": "{bad"})
    _one_line_error(proc, "MESHKIT_LAUNCH_FLAGS='{bad' is not what `meshkit launch` writes")


def test_the_recipe_checks_heads_against_tp_before_launching(tmp_path) -> None:
    config = tmp_path / "run.yaml"
    config.write_text("launch: {nproc_per_node: 2}\nparallel: {tp: 2}\nmodel: {dim: 48, n_heads: 3}\n")
    _one_line_error(
        in_process("train", str(config)), "tp=2 does not divide the attention's head counts (heads=3, kv_heads=3)"
    )


def test_a_meshkit_error_inside_the_workers_prints_no_traceback(tmp_path) -> None:
    script = tmp_path / "job.py"
    script.write_text("from meshkit import Engine\nEngine(tp=3)\n")  # only the code knows: no preflight
    proc = meshkit("launch", "--nproc-per-node", "2", str(script), timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "tp=3 does not divide world size 2" in proc.stderr.strip().splitlines()[-1]


def test_an_unreachable_node_0_is_one_line_without_native_traces(tmp_path) -> None:
    script = tmp_path / "job.py"
    script.write_text("print('never runs')\n")
    args = ["--nnodes", "2", "--node-rank", "1", "--master-port", str(free_port()), "--rdzv-timeout", "3"]
    proc = meshkit("launch", *args, str(script), timeout=60)  # a hang fails here
    line = _one_line_error(proc, "could not reach node 0 at 127.0.0.1")
    assert "frame #" not in proc.stderr and "within 3s" in line


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (["train.dataset=missing.txt"], "train.dataset=missing.txt: no such file"),
        (["logging.dir=/etc/hostname/run"], "logging.dir=/etc/hostname/run: /etc/hostname is not a directory"),
        (["checkpoint.dir=/etc/hostname/ckpt"], "checkpoint.dir=/etc/hostname/ckpt: /etc/hostname is not a directory"),
    ],
)
def test_meshkit_train_checks_its_data_and_output_directories_before_any_worker(tmp_path, overrides, needle) -> None:
    config = tmp_path / "run.yaml"
    config.write_text("launch: {nproc_per_node: 2}\nmodel: {dim: 32, n_heads: 2, n_layers: 1}\n")
    _one_line_error(in_process("train", str(config), *overrides), needle)


def test_meshkit_finetune_checks_its_datasets_before_any_worker(tmp_path, material) -> None:
    pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
    from tests.helpers.finetune_runs import write_config

    def config(path: str) -> str:
        written = write_config(tmp_path / "ft.yaml", material, datasets=[{"path": path, "type": "alpaca"}],
                               meshkit={"launch": {"nproc_per_node": 2}})  # fmt: skip
        return str(written)

    _one_line_error(in_process("finetune", config(str(tmp_path / "missing.jsonl"))), "missing.jsonl' does not exist")
    offline = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    _one_line_error(
        in_process("finetune", config("someone/not-cached-anywhere"), env=offline),
        "dataset 'someone/not-cached-anywhere' is not a local path",
    )


def test_a_dataset_that_disappears_before_a_worker_reads_it_is_one_line_there_too(tmp_path) -> None:
    from meshkit.core.errors import MeshkitError
    from meshkit.data.text import load_text

    with pytest.raises(MeshkitError, match="is not a file"):
        load_text(str(tmp_path / "gone.txt"))
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(MeshkitError, match="is not UTF-8 text"):
        load_text(str(tmp_path / "latin1.txt"))
