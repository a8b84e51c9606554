"""`meshkit finetune` on a mixture of experts: an Axolotl config with expert_parallel_size trains like one
process, alone, with ZeRO-2 (Axolotl's stock DeepSpeed file) and with ZeRO-3, and its merged output loads with
from_pretrained."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")

from safetensors.torch import load_file  # noqa: E402

from meshkit.checkpoint.model_export import export_checkpoint  # noqa: E402
from tests.helpers.distributed import run_world  # noqa: E402
from tests.helpers.finetune_runs import make_moe_base, run_finetune, write_config  # noqa: E402


@pytest.fixture(scope="module")
def moe(tmp_path_factory, material):
    root = tmp_path_factory.mktemp("moe")
    material = {**material, "base": make_moe_base(root, material)}
    config = write_config(root / "reference.yaml", material, micro_batch_size=4)
    reference = run_world(run_finetune, 1, str(config), [f"output_dir={root / 'reference'}"], timeout=180)[0]
    return material, reference


@pytest.mark.parametrize("zero_stage", [0, 2, 3])
def test_expert_parallel_fine_tune_equals_one_process_and_exports(tmp_path, moe, zero_stage: int) -> None:
    from transformers import AutoModelForCausalLM

    material, reference = moe
    # ZeRO-2 as Axolotl's MoE examples write it: its stock DeepSpeed file, by name
    stage = {"deepspeed": "deepspeed_configs/zero2.json"} if zero_stage == 2 else {}
    config = write_config(tmp_path / "ft.yaml", material, expert_parallel_size=2, save_steps=4, **stage)
    arguments = [f"output_dir={tmp_path / 'out'}"] + ([] if stage else [f"zero_stage={zero_stage}"])
    summary = run_world(run_finetune, 2, str(config), arguments, timeout=180)[0]
    torch.testing.assert_close(torch.tensor(summary["losses"]), torch.tensor(reference["losses"]), rtol=1e-5, atol=0)
    assert summary["layout_description"].endswith("experts over ep2") and summary["zero_stage"] == zero_stage
    trained = load_file(
        export_checkpoint(tmp_path / "out" / "checkpoints", tmp_path / "ckpt").parent / "model.safetensors"
    )
    exported = load_file(tmp_path / "out" / "merged" / "model.safetensors")
    assert trained.keys() == exported.keys() and all(torch.equal(trained[k], exported[k]) for k in trained)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "merged")
    bank = model.model.layers[0].mlp.experts.gate_up_proj
    assert bank.shape[0] == 4 and torch.equal(bank.detach(), exported["model.layers.0.mlp.experts.gate_up_proj"])


LORA_ON_EXPERTS = {"adapter": "lora", "lora_r": 4, "lora_alpha": 8, "lora_target_modules": ["q_proj", "v_proj"],
                   "lora_target_parameters": ["experts.gate_up_proj", "experts.down_proj"]}  # fmt: skip


@pytest.fixture(scope="module")
def lora_reference(tmp_path_factory, moe):
    material, _ = moe
    root = tmp_path_factory.mktemp("moe-lora")
    config = write_config(root / "reference.yaml", material, micro_batch_size=4, **LORA_ON_EXPERTS)
    return run_world(run_finetune, 1, str(config), [f"output_dir={root / 'out'}"], timeout=180)[0]


@pytest.mark.parametrize(
    ("zero_stage", "ep"), [(0, 1), (3, 1), (0, 2), (3, 2)], ids=["ddp", "zero3", "ep2", "ep2_zero3"]
)
def test_lora_on_the_expert_banks_equals_one_process_and_merges(tmp_path, moe, lora_reference, zero_stage, ep) -> None:
    """Under ep each rank adds its own experts' low-rank updates to its piece of the bank; the adapters stay
    whole on every rank (their gradients: each expert's from the rank holding it, summed over the ranks)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    material, _ = moe
    config = write_config(tmp_path / "ft.yaml", material, expert_parallel_size=ep, **LORA_ON_EXPERTS)
    summary = run_world(run_finetune, 2, str(config), [f"output_dir={tmp_path / 'out'}", f"zero_stage={zero_stage}"],
                        timeout=180)[0]  # fmt: skip
    got, expected = torch.tensor(summary["losses"]), torch.tensor(lora_reference["losses"])
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=0)
    assert summary["trainable_parameters"] == lora_reference["trainable_parameters"]
    ids = torch.randint(4, 300, (2, 16))
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "merged")
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(material["base"]), tmp_path / "out")
    base = AutoModelForCausalLM.from_pretrained(material["base"])
    with torch.no_grad():
        merged_logits, adapted_logits = merged(input_ids=ids).logits, adapted(input_ids=ids).logits
        assert (merged_logits - base(input_ids=ids).logits).abs().max() > 1e-4  # the adapters changed the model
    torch.testing.assert_close(merged_logits, adapted_logits, rtol=1e-5, atol=1e-5)


def test_lora_target_linear_leaves_the_expert_banks_alone() -> None:
    """Axolotl's Mixtral LoRA (lora_target_linear, lora_dropout 0.05) runs: adapters on the Linear layers only —
    expert banks get adapters through lora_target_parameters alone (peft's "all-linear" wraps them too, and then
    refuses lora_dropout)."""
    from types import SimpleNamespace

    from meshkit.tuning.lora import apply_lora
    from tests.helpers.moe_models import moe_causal_lm

    model = moe_causal_lm("mixtral")
    settings = SimpleNamespace(
        lora_model_dir=None, lora_target_parameters=None, lora_target_linear=True, lora_target_modules=None,
        lora_r=4, lora_alpha=8, lora_dropout=0.05, base_model="base",
    )  # fmt: skip
    adapted = apply_lora(model, settings)
    wrapped = {
        name.split(".lora_A")[0].rsplit(".", 1)[-1] for name, _ in adapted.named_parameters() if "lora_A" in name
    }
    assert wrapped == {"q_proj", "k_proj", "v_proj", "o_proj"}


def test_dpo_on_a_mixture_of_experts_under_expert_parallel_equals_one_process(tmp_path, moe) -> None:
    """Preference training on an MoE base: each rank runs its own experts for the chosen and rejected rows of
    every pair (one forward), the reference is the base with the experts' adapters off."""
    from tests.helpers.preference_runs import dpo_keys, write_preference_data

    material, _ = moe
    (tmp_path / "data").mkdir()
    keys = {**dpo_keys(write_preference_data(tmp_path / "data")), **LORA_ON_EXPERTS, "max_steps": 3}
    one = run_world(
        run_finetune, 1, str(write_config(tmp_path / "one.yaml", material, micro_batch_size=4, **keys)),
        [f"output_dir={tmp_path / 'one'}"], timeout=180,
    )[0]  # fmt: skip
    config = write_config(tmp_path / "ep.yaml", material, expert_parallel_size=2, **keys)
    ep = run_world(run_finetune, 2, str(config), [f"output_dir={tmp_path / 'ep'}"], timeout=180)[0]
    assert ep["layout_description"].endswith("experts over ep2")
    torch.testing.assert_close(torch.tensor(ep["losses"]), torch.tensor(one["losses"]), rtol=1e-5, atol=1e-6)
    assert one["losses"][-1] < one["losses"][0]


def test_projection_names_peft_moves_onto_expert_banks_train_with_dropout_on_the_linear_layers() -> None:
    """For the MoE types transformers 5 fused (Qwen3-MoE, DeepSeek, OLMoE, AFMoE, ...) peft maps the projection
    names of transformers 4 (gate_proj, up_proj, down_proj, the router's gate) onto the fused banks — at training as
    at loading, so meshkit follows it. Those adapters take no dropout (peft cannot apply it inside a bank): the
    Linear layers' adapters get lora_dropout, the banks' none, said in one line."""
    from types import SimpleNamespace

    from peft.tuners.lora.layer import ParamWrapper

    from meshkit.tuning.lora import apply_lora, bank_dropout_note
    from tests.helpers.moe_models import moe_causal_lm

    settings = SimpleNamespace(
        lora_model_dir=None, lora_target_parameters=None, lora_target_linear=False,
        lora_target_modules=["q_proj", "v_proj", "down_proj"], lora_r=4, lora_alpha=8, lora_dropout=0.05,
        base_model="base",
    )  # fmt: skip
    adapted = apply_lora(moe_causal_lm("qwen3_moe"), settings)
    banks = [m for m in adapted.modules() if isinstance(m, ParamWrapper)]
    linear = [m for name, m in adapted.named_modules() if name.endswith(("q_proj", "v_proj")) and hasattr(m, "lora_A")]
    assert banks and linear
    assert all(m.lora_dropout["default"].p == 0.05 for m in linear)
    assert all(isinstance(m.lora_dropout["default"], torch.nn.Identity) for m in banks)
    note = bank_dropout_note(adapted, settings)
    assert note is not None and "take none" in note and "\n" not in note
    assert adapted.peft_config["default"].lora_dropout == 0.0  # (what peft can load again)
    plain = SimpleNamespace(**{**vars(settings), "lora_target_modules": ["q_proj"]})
    assert bank_dropout_note(apply_lora(moe_causal_lm("qwen3_moe"), plain), plain) is None
