"""The product-path matrix: each memory or speed feature (fused loss, tiled MLP, NEFTune, compile, recomputation,
8-bit and 4-bit optimizers, offload) on each recipe users run (`meshkit train`; `meshkit finetune` full, LoRA,
QLoRA, `rl: dpo`, `reward_model: true`), read back from the run's own record (`summary.json`'s `ran`): in
effect, with what the CPU measures of it (optimizer state bytes per trained element, graph breaks), or the run
said why not. Features are bundled two to a run per recipe so the matrix stays a few minutes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
pytest.importorskip("peft", reason="the hf extra (peft) is not installed")
pytest.importorskip("bitsandbytes", reason="the hf extra (bitsandbytes) is not installed")
pytest.importorskip("torchao", reason="the hf extra (torchao) is not installed")

from tests.helpers.distributed import run_world  # noqa: E402
from tests.helpers.finetune_runs import lora_keys, run_finetune, write_config  # noqa: E402
from tests.helpers.preference_runs import (  # noqa: E402
    bradley_terry_records,
    dpo_keys,
    make_reward_base,
    write_preference_data,
)

MEMORY = {  # recomputation, tiled MLPs, NEFTune, bitsandbytes' 8-bit AdamW, ZeRO-3 with offload=cpu asked
    "gradient_checkpointing": True,
    "tiled_mlp": True,
    "neftune_noise_alpha": 5.0,
    "optimizer": "adamw_8bit",
    "meshkit": {"zero_stage": 3, "sharding": {"offload": "cpu"}},  # (one rank: nothing to shard, said)
}
SPEED = {"torch_compile": True, "torch_compile_backend": "aot_eager", "optimizer": "adamw_torch_4bit"}


def _reward_keys(root: Path) -> dict[str, Any]:
    data = root / "bt.jsonl"
    data.write_text("".join(json.dumps(record) + "\n" for record in bradley_terry_records()))
    return {
        "base_model": str(make_reward_base(root)), "model_type": "AutoModelForSequenceClassification",
        "num_labels": 1, "reward_model": True, "chat_template": "tokenizer_default",
        "datasets": [{"path": str(data), "type": "bradley_terry.chat_template"}],
    }  # fmt: skip


RECIPES: dict[str, Any] = {
    "full": lambda root: {},
    "lora": lambda root: lora_keys(),
    "qlora": lambda root: lora_keys(adapter="qlora", load_in_4bit=True),
    "dpo": lambda root: dpo_keys(write_preference_data(root)),
    "reward": _reward_keys,
}
OBJECTIVES = {  # the run's record of what it trained toward: one set-up, the kind's objective
    "full": "sft: causal-LM cross-entropy",
    "lora": "sft: causal-LM cross-entropy",
    "qlora": "sft: causal-LM cross-entropy",
    "dpo": "dpo: DPO against a frozen copy laid out like the policy",
    "reward": "reward_model: BradleyTerry",
}
LOSS_WORDS = {
    "dpo": "fused per-token log-probs (chunks of",
    "reward": "from the scores of its classification head score (no vocabulary to chunk)",
}


def _ran(tmp_path: Path, material: dict[str, Path], recipe: str, bundle: str, features: dict[str, Any]) -> dict:
    keys = {**RECIPES[recipe](tmp_path), **features}
    path = write_config(tmp_path / f"{bundle}.yaml", material, output_dir=str(tmp_path / bundle), **keys)
    return run_world(run_finetune, 1, str(path), [], timeout=240)[0]["ran"]


def _state_bytes(optimizer_words: str) -> float:
    return float(optimizer_words.split(", ")[-1].split(" state bytes")[0])


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_memory_features_are_in_effect_on_every_finetune_recipe(tmp_path, material, recipe) -> None:
    ran = _ran(tmp_path, material, recipe, "memory", MEMORY)
    assert ran["objective"].startswith(OBJECTIVES[recipe]), ran["objective"]
    assert ran["loss"].startswith(LOSS_WORDS.get(recipe, "fused (chunks of")), ran["loss"]
    assert ran["recomputation"] == "full on 2 blocks"
    assert ran["tiled_mlp"] == "2 MLPs over slices of the sequence"
    assert ran["neftune"] == "noise alpha 5"
    assert ran["optimizer"].startswith("AdamW8bit (bitsandbytes), "), ran["optimizer"]
    if recipe in ("full", "dpo", "reward"):  # the embedding's states are 8-bit (bitsandbytes keeps small ones 32-bit)
        assert _state_bytes(ran["optimizer"]) < 7.0, ran["optimizer"]  # (AdamW's own: 8)
    assert ran["offload"].startswith("none: on a CPU-only host"), ran["offload"]
    assert ("quantized_base" in ran) == (recipe == "qlora")
    if recipe == "qlora":
        assert ran["quantized_base"] == "4-bit on 14 linear layers"


# (compile and the 4-bit optimizer on the causal LM, the preference objective and the reward head; on the LoRA
# recipes, whose compiled graph is the full one's with adapters, in `make test-full`)
@pytest.mark.parametrize(
    "recipe", [pytest.param(name, marks=[pytest.mark.sweep] if name in ("lora", "qlora") else []) for name in RECIPES]
)
def test_speed_features_are_in_effect_on_every_finetune_recipe(tmp_path, material, recipe) -> None:
    ran = _ran(tmp_path, material, recipe, "speed", SPEED)
    assert ran["loss"].startswith(LOSS_WORDS.get(recipe, "fused (chunks of")), ran["loss"]
    assert ran["compile"].startswith("whole model"), ran["compile"]
    assert ran["compile"].endswith(", 0 graph breaks"), ran["compile"]
    assert ran["optimizer"].startswith("AdamW4bit (torchao), "), ran["optimizer"]
    assert ran["recomputation"] == "none" and ran["tiled_mlp"] == "off" and ran["neftune"] == "off"


def test_nvme_offload_pages_the_optimizer_states_to_files(tmp_path, material) -> None:
    offload = {"zero_stage": 0, "sharding": {"offload": "nvme", "offload_dir": str(tmp_path / "nvme")}}
    ran = _ran(tmp_path, material, "full", "nvme", {"meshkit": offload})
    assert ran["offload"] == "optimizer states paged to files between steps (nvme)"
    assert _state_bytes(ran["optimizer"]) == pytest.approx(8.0, abs=0.1)  # AdamW's two fp32 moments, on disk
    assert str(tmp_path / "nvme") in ran["optimizer"]


def run_train(rank: int, run_dir: str, overrides: list[str]) -> dict[str, Any]:
    from meshkit.recipes.train import resolve_recipe, train
    from tests.cli.test_cli import SMALL

    return train(resolve_recipe(None, [*SMALL, *overrides, f"logging.dir={run_dir}"]))["ran"]


@pytest.mark.parametrize(
    "overrides",
    [
        ["activation_checkpointing.mode=full", "neftune_noise_alpha=5", "tiled_mlp=true", "zero_stage=3",
         "sharding.offload=cpu"],
        ["compile.enabled=true", "compile.backend=aot_eager", "compile.regional=false"],
    ],
    ids=["memory", "speed"],
)  # fmt: skip
def test_meshkit_train_records_what_ran(tmp_path, overrides) -> None:
    ran = run_world(run_train, 2, str(tmp_path / "run"), overrides, timeout=240)[0]
    assert ran["loss"].startswith("plain (whole logits): loss_fn=lm_loss"), ran["loss"]
    assert ran["optimizer"].startswith("AdamW (torch)") and _state_bytes(ran["optimizer"]) == pytest.approx(8.0)
    if "compile.enabled=true" in overrides:
        assert ran["compile"].startswith("whole model") and ran["compile"].endswith(", 0 graph breaks"), ran
        return
    assert ran["recomputation"] == "full on 2 blocks"
    assert ran["neftune"] == "noise alpha 5"
    assert ran["tiled_mlp"] == "2 MLPs over slices of the sequence"
    assert ran["offload"].startswith("none: on a CPU-only host")
    assert all(0.4 < share["share"] < 0.6 for share in ran["parameters"])  # ZeRO-3 over two ranks
