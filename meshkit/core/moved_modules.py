"""Module paths from before the package layout keep importing, with a deprecation warning.

`meshkit.estimate` is now `meshkit.planning.estimate`, `meshkit.mesh` is `meshkit.runtime.mesh`, and so on. An
import of an old path gets the new module itself (one module object, not a copy), and a `DeprecationWarning`
names where it lives now. `meshkit.config`, `meshkit.engine` and `meshkit.cli` kept their names as packages and
export what the modules did.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType

MOVED_MODULES: dict[str, str] = {
    "meshkit.errors": "meshkit.core.errors",
    "meshkit.tree": "meshkit.core.tree",
    "meshkit.seed": "meshkit.core.seed",
    "meshkit.export": "meshkit.core.io",
    "meshkit.config_base": "meshkit.config.section",
    "meshkit.config_train": "meshkit.config.train",
    "meshkit.yaml_text": "meshkit.config.yaml_text",
    "meshkit.resolve": "meshkit.config.resolve",
    "meshkit.questionnaire": "meshkit.config.questionnaire",
    "meshkit.importing": "meshkit.config.importing",
    "meshkit.recipes.axolotl": "meshkit.config.importing.axolotl",
    "meshkit.mesh": "meshkit.runtime.mesh",
    "meshkit.collectives": "meshkit.runtime.collectives",
    "meshkit.hang_doctor": "meshkit.runtime.hang_doctor",
    "meshkit.preemption": "meshkit.runtime.preemption",
    "meshkit.host_memory": "meshkit.runtime.host_memory",
    "meshkit.memory": "meshkit.runtime.memory",
    "meshkit.tracking": "meshkit.runtime.tracking",
    "meshkit.loss": "meshkit.training.loss",
    "meshkit.accumulation": "meshkit.training.accumulation",
    "meshkit.precision": "meshkit.training.precision",
    "meshkit.parallel.zero_buckets": "meshkit.parallel.zero.buckets",
    "meshkit.parallel.sharding": "meshkit.parallel.zero.sharding",
    "meshkit.parallel.local_shards": "meshkit.parallel.zero.local_shards",
    "meshkit.parallel.nvme": "meshkit.parallel.zero.nvme",
    "meshkit.parallel.wrapped_optimizer": "meshkit.parallel.zero.wrapped_optimizer",
    "meshkit.parallel.tensor_auto": "meshkit.parallel.tensor.auto",
    "meshkit.parallel.tensor_lora": "meshkit.parallel.tensor.lora",
    "meshkit.parallel.sequence": "meshkit.parallel.tensor.sequence",
    "meshkit.parallel.context_hf": "meshkit.parallel.context.hf",
    "meshkit.parallel.ring_attention": "meshkit.parallel.context.ring_attention",
    "meshkit.parallel.pipeline_hf": "meshkit.parallel.pipeline.hf_stage",
    "meshkit.parallel.pipeline_schedule": "meshkit.parallel.pipeline.schedule",
    "meshkit.parallel.pipeline_tied": "meshkit.parallel.pipeline.tied",
    "meshkit.plan": "meshkit.planning.plan",
    "meshkit.estimate": "meshkit.planning.estimate",
    "meshkit.estimate_ps": "meshkit.planning.estimate_ps",
    "meshkit.perf_model": "meshkit.planning.perf_model",
    "meshkit.hardware": "meshkit.planning.hardware",
    "meshkit.probe": "meshkit.planning.probe",
    "meshkit.workload_probe": "meshkit.planning.workload_probe",
    "meshkit.layout_probe": "meshkit.planning.layout_probe",
    "meshkit.published_runs": "meshkit.planning.published_runs",
    "meshkit.activation_report": "meshkit.planning.activation_report",
    "meshkit.commbench": "meshkit.planning.commbench",
    "meshkit.engine_auto": "meshkit.engine.layout_auto",
    "meshkit.engine_data": "meshkit.engine.data",
    "meshkit.engine_weights": "meshkit.engine.weights",
    "meshkit.evaluation": "meshkit.engine.evaluation",
    "meshkit.gradients": "meshkit.engine.gradients",
    "meshkit.processes": "meshkit.engine.processes",
    "meshkit.checkpoint.engine_mixin": "meshkit.engine.checkpointing",
    "meshkit.accelerate_verbs": "meshkit.engine.accelerate.verbs",
    "meshkit.accelerate_loop_verbs": "meshkit.engine.accelerate.loop_verbs",
    "meshkit.accelerator": "meshkit.engine.accelerate.accelerator",
    "meshkit.estimate_cli": "meshkit.cli.estimate",
    "meshkit.plan_cli": "meshkit.cli.plan",
    "meshkit.envinfo": "meshkit.cli.env",
}


class MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old module path and loads the module that now lives at the new one."""

    def find_spec(
        self, fullname: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MOVED_MODULES:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return None

    def exec_module(self, module: ModuleType) -> None:
        new_path = MOVED_MODULES[module.__name__]
        # stacklevel 2 names the importing line: the warnings module skips the import system's own frames.
        warnings.warn(
            f"{module.__name__} moved to {new_path}: import it from there (the old path will be removed)",
            DeprecationWarning,
            stacklevel=2,
        )
        # The import system returns what sys.modules holds under the name once the module has run: the new module.
        sys.modules[module.__name__] = importlib.import_module(new_path)


def install_moved_module_finder() -> None:
    """Adds the finder after the regular ones (idempotent): it only answers for paths no file serves any more."""
    if not any(isinstance(finder, MovedModuleFinder) for finder in sys.meta_path):
        sys.meta_path.append(MovedModuleFinder())
