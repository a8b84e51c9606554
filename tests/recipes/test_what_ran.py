"""What a config asks for is what runs, read back from the run's own record (`summary.json`'s `ran`): each memory
or speed feature on the recipes users run (`meshkit finetune` full, LoRA, DPO on a saved model and config) is in
effect — with the numbers of the plain path — or the run says why not."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
pytest.importorskip("peft", reason="the hf extra (peft) is not installed")

from tests.helpers.distributed import run_world  # noqa: E402
from tests.helpers.finetune_runs import lora_keys, run_finetune, write_config  # noqa: E402
from tests.helpers.preference_runs import dpo_keys, write_preference_data  # noqa: E402

RECIPES: dict[str, Any] = {
    "full": lambda data: {},
    "lora": lambda data: lora_keys(),
    "dpo": lambda data: dpo_keys(data),
    "dpo_lora": lambda data: {**dpo_keys(data), **lora_keys()},
}


def _run(tmp_path: Path, material: dict[str, Path], name: str, world: int = 1, **keys: Any) -> dict[str, Any]:
    path = write_config(tmp_path / f"{name}.yaml", material, output_dir=str(tmp_path / name), **keys)
    return run_world(run_finetune, world, str(path), [], timeout=240)[0]


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_the_default_loss_is_fused_on_meshkit_finetune_and_trains_as_the_plain_loss(tmp_path, material, recipe) -> None:
    keys = RECIPES[recipe](write_preference_data(tmp_path))
    fused = _run(tmp_path, material, f"{recipe}-auto", **keys)
    plain = _run(tmp_path, material, f"{recipe}-off", fused_loss="off", **keys)
    words = "fused per-token log-probs" if recipe.startswith("dpo") else "fused (chunks of"
    assert fused["ran"]["loss"].startswith(words), fused["ran"]["loss"]
    assert plain["ran"]["loss"] == "plain (whole logits): fused_loss: off"
    assert fused["losses"] == pytest.approx(plain["losses"], rel=1e-5)


def test_axolotls_cut_cross_entropy_keys_run_the_fused_loss(tmp_path, material) -> None:
    plugin = "axolotl.integrations.cut_cross_entropy.CutCrossEntropyPlugin"
    ran = _run(tmp_path, material, "cce", cut_cross_entropy=True, plugins=[plugin])["ran"]
    assert ran["loss"].startswith("fused (chunks of")


def test_the_record_names_recomputation_tiled_mlps_neftune_and_each_ranks_parameter_share(tmp_path, material) -> None:
    keys = {"gradient_checkpointing": True, "tiled_mlp": True, "neftune_noise_alpha": 5.0}
    ran = _run(tmp_path, material, "features", world=2, meshkit={"zero_stage": 3}, **keys)["ran"]
    assert ran["recomputation"] == "full on 2 blocks"
    assert ran["tiled_mlp"] == "2 MLPs over slices of the sequence"
    assert ran["neftune"] == "noise alpha 5"
    assert ran["allocator"]
    shares = ran["parameters"]
    assert len(shares) == 2 and all(0.4 < share["share"] < 0.6 for share in shares)  # (ZeRO-3: about half each)
    assert sum(share["held"] for share in shares) >= shares[0]["whole"]


def test_a_compiled_finetune_with_the_fused_loss_breaks_no_graph(tmp_path, material) -> None:
    keys = {"torch_compile": True, "torch_compile_backend": "aot_eager"}
    compiled = _run(tmp_path, material, "compiled", **keys)
    eager = _run(tmp_path, material, "eager")
    assert compiled["ran"]["loss"].startswith("fused (chunks of")
    words = compiled["ran"]["compile"]
    assert words.startswith("whole model but its head") and words.endswith(", 0 graph breaks"), words
    assert compiled["losses"] == pytest.approx(eager["losses"], rel=1e-5)
