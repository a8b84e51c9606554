"""The Engine is composed of components it owns; its public verbs are theirs, unchanged from the mixin days."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import meshkit
from meshkit.engine import Engine
from meshkit.engine.checkpointing import Checkpoints
from meshkit.engine.delegation import Attribute, Verb
from meshkit.engine.processes import Processes

# The Engine's own names (a user's loop may call any of them); each means one thing.
ENGINE_API = [
    "accumulate",
    "activation_report",
    "backward",
    "clip_grad_norm_",
    "config",
    "dp_rank",
    "dp_size",
    "end",
    "eval_token_loss",
    "full_state_dict",
    "gather",
    "gather_for_metrics",
    "gradient_state",
    "is_local_main_process",
    "is_main_process",
    "is_main_worker",
    "is_worker",
    "leave_out_of_steps",
    "load_full_state_dict",
    "load_state",
    "log",
    "loss_parallel",
    "main_process_first",
    "main_process_work",
    "memory_report",
    "mesh",
    "num_processes",
    "objective_step",
    "placement",
    "prepare",
    "prepare_frozen",
    "print",
    "process_index",
    "reduce",
    "register_for_checkpointing",
    "resume",
    "save_checkpoint",
    "save_model",
    "save_state",
    "scaler",
    "shard_sequence",
    "start_trackers",
    "step",
    "sync_gradients",
    "train_step",
    "unwrap_model",
    "wait_for_checkpoint",
    "wait_for_everyone",
    "weigh_token_losses",
    "zero_stage",
]
# Accelerate's verbs: `meshkit.Accelerator`'s (it has an Engine), not the Engine's.
ACCELERATE_ONLY = [
    "autocast",
    "check_trigger",
    "clear",
    "end_training",
    "free_memory",
    "get_state_dict",
    "get_tracker",
    "gradient_accumulation_steps",
    "init_trackers",
    "is_last_process",
    "local_main_process_first",
    "local_process_index",
    "mixed_precision",
    "on_last_process",
    "on_local_main_process",
    "on_local_process",
    "on_main_process",
    "on_process",
    "pad_across_processes",
    "prepare_data_loader",
    "prepare_model",
    "prepare_optimizer",
    "prepare_scheduler",
    "set_trigger",
    "skip_first_batches",
    "split_between_processes",
    "use_distributed",
]


def test_the_engine_keeps_every_public_name() -> None:
    missing = [name for name in ENGINE_API if not hasattr(Engine, name)]
    assert not missing, missing


def test_accelerates_surface_is_the_accelerators_over_an_engine_it_holds() -> None:
    from meshkit import Accelerator

    assert not issubclass(Accelerator, Engine)
    assert [name for name in ACCELERATE_ONLY if hasattr(Engine, name)] == []
    assert [name for name in ACCELERATE_ONLY if not hasattr(Accelerator, name)] == []
    public = sorted(name for name in dir(Engine) if not name.startswith("_"))
    assert set(public) == set(ENGINE_API), set(public) ^ set(ENGINE_API)


def test_a_delegated_verb_is_the_components_own_with_its_docstring() -> None:
    assert Engine.save_state is Checkpoints.save_state
    assert Engine.gather.__doc__ == Processes.gather.__doc__ and "dp rank" in Engine.gather.__doc__
    assert isinstance(Engine.__dict__["save_state"], Verb)
    assert Engine.__dict__["process_index"].__doc__ == Processes.process_index.__doc__


def test_every_delegated_name_carries_its_type() -> None:
    # a Verb takes the component's typed method; an Attribute is declared with its type, Attribute[int](...)
    delegated = {name: d for name, d in vars(Engine).items() if isinstance(d, (Verb, Attribute))}
    assert len(delegated) > 40
    untyped = [
        name
        for name, d in delegated.items()
        if isinstance(d, Attribute) and not getattr(getattr(d, "__orig_class__", None), "__args__", None)
    ]
    assert not untyped, f"Attribute without its type: {untyped}"
    assert vars(Engine)["process_index"].__orig_class__.__args__ == (int,)


def _broken(make) -> str:
    with pytest.raises((TypeError, RuntimeError)) as caught:  # (Python 3.11 wraps __set_name__'s error)
        make()
    error = caught.value if isinstance(caught.value, TypeError) else caught.value.__cause__
    return str(error)


def test_delegating_a_name_the_component_lacks_fails_when_the_class_is_made() -> None:
    def attribute() -> None:
        class Broken:
            save_everything = Attribute[int]("processes", Processes)

    def verb() -> None:
        class Broken:
            save_everything = Verb("processes", Processes.gather)

    assert "Processes has no 'save_everything'" in _broken(attribute)
    assert "delegates to a method named 'gather'" in _broken(verb)


def test_the_engine_is_built_from_components_not_mixins() -> None:
    assert Engine.__bases__ == (object,)
    package = Path(meshkit.__file__).parent / "engine"
    for path in package.rglob("*.py"):
        source = path.read_text()
        assert "type: ignore[attr-defined]" not in source, path
        classes = [node.name for node in ast.walk(ast.parse(source)) if isinstance(node, ast.ClassDef)]
        assert not [name for name in classes if name.endswith("Mixin")], path


def test_a_one_process_engine_answers_through_its_components(tmp_path) -> None:
    import torch

    engine = Engine(logging={"dir": str(tmp_path)})
    try:
        model = torch.nn.Linear(4, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model, optimizer = engine.prepare(model, optimizer)
        assert engine.process_index == 0 and engine.num_processes == 1 and engine.is_main_process
        assert engine.step == 0 and engine.unwrap_model() is engine.weights.unwrap_model()
        loss = model(torch.ones(3, 4)).sum()
        engine.backward(loss)
        optimizer.step()
        assert engine.step == 1 == engine.checkpoints.step
        saved = engine.save_state(tmp_path / "state")
        assert (saved / "meta.json").is_file() or any(saved.iterdir())
    finally:
        engine.end()
