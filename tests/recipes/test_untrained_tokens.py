"""`fix_untrained_tokens`: rows never trained (zero in the embedding and the head) of tokens the data uses start at
the mean of the trained rows scaled by the token's frequency; rows of unused tokens stay; a list names tokens to
treat anyway; every layout starts from the same rows."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("peft", reason="the hf extra (peft) is not installed")

from tests.helpers.distributed import run_world  # noqa: E402
from tests.helpers.finetune_runs import lora_keys, run_finetune, write_config  # noqa: E402


@pytest.fixture
def zeroed_base(tmp_path, material, tokenizer):
    """The material's base with the rows of a token the alpaca data uses ("apple"'s first token) and of one no
    record uses set to zero in the embedding and the head, as reserved tokens ship."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(material["base"])
    from meshkit.data.formats import ALPACA_NO_INPUT, ALPACA_WITH_INPUT

    used = tokenizer("apple", add_special_tokens=False).input_ids[0]
    text = material["alpaca"].read_text() + ALPACA_WITH_INPUT + ALPACA_NO_INPUT
    seen = set(tokenizer(text).input_ids) | set(tokenizer.all_special_ids)
    unused = max(set(range(len(tokenizer))) - seen)  # (a token no record, template or special token holds)
    with torch.no_grad():
        for matrix in (model.get_input_embeddings().weight, model.get_output_embeddings().weight):
            matrix[[used, unused]] = 0.0
    out = tmp_path / "zeroed"
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out, used, unused


def test_untrained_rows_the_data_uses_start_at_the_scaled_mean_in_every_layout(tmp_path, material, zeroed_base):
    from transformers import AutoModelForCausalLM

    base, used, unused = zeroed_base
    keys = dict(lora_keys(lora_target_linear=False, lora_target_modules=["q_proj", "v_proj"]), base_model=str(base),
                fix_untrained_tokens=True)  # fmt: skip
    config = write_config(tmp_path / "c.yml", material, **keys)
    exported = {}
    for name, world, args in (("one", 1, ["micro_batch_size=4"]), ("zero3", 2, ["zero_stage=3"])):
        summary = run_world(run_finetune, world, str(config), [f"output_dir={tmp_path / name}", *args], timeout=240)[0]
        merged = AutoModelForCausalLM.from_pretrained(summary["outputs"]["merged"])
        exported[name] = (merged.get_input_embeddings().weight.detach(), merged.get_output_embeddings().weight.detach())
    original = AutoModelForCausalLM.from_pretrained(base)
    for matrix, before in zip(exported["one"], (original.get_input_embeddings().weight,
                                                 original.get_output_embeddings().weight), strict=True):  # fmt: skip
        assert torch.equal(matrix[unused], torch.zeros_like(matrix[unused]))  # not in the data: left as it was
        assert matrix[used].abs().max() > 0
        trained = [i for i in range(before.shape[0]) if i not in (used, unused)]
        mean = before[trained].detach().double().mean(dim=0)
        # scaled by the token's frequency against the data's most used token: the same direction as the mean
        cosine = torch.nn.functional.cosine_similarity(matrix[used].double(), mean, dim=0)
        assert cosine > 1 - 1e-6, cosine
    for one, zero3 in zip(exported["one"], exported["zero3"], strict=True):
        torch.testing.assert_close(zero3, one, rtol=0, atol=0)


def test_the_plan_scales_by_frequency_and_takes_listed_tokens(tmp_path) -> None:
    from safetensors.torch import save_file

    from meshkit.tuning.untrained_tokens import plan_fix, token_counts

    embedding = torch.tensor([[1.0, 2.0], [3.0, 4.0], [0.0, 0.0], [0.0, 0.0], [5.0, 6.0]])
    save_file({"embed.weight": embedding}, tmp_path / "model.safetensors")
    counts = token_counts([[0, 1, 1, 2], [1, 2]], 5)
    assert counts.tolist() == [1, 3, 2, 0, 0]
    fix = plan_fix(tmp_path / "model.safetensors", ["embed.weight"], counts)
    assert fix is not None and fix.ids == [2]  # token 3 is untrained too, but the data never uses it
    mean = np.array([3.0, 4.0])  # of rows 0, 1 and 4
    np.testing.assert_allclose(fix.rows["embed.weight"][0].numpy(), mean * 2 / 3)
    listed = plan_fix(tmp_path / "model.safetensors", ["embed.weight"], counts, requested=[3])
    assert listed is not None and listed.ids == [2, 3]


def run_summary(rank: int, config: str, assignments: list[str]) -> dict:
    from meshkit.recipes.finetune import finetune
    from meshkit.recipes.finetune_config import resolve_finetune

    summary = finetune(resolve_finetune(config, assignments))
    return {key: summary[key] for key in ("objective", "metrics", "outputs")}


def test_preference_training_fixes_the_rows_of_the_policy_and_of_its_reference(tmp_path, material, zeroed_base):
    """The key means the same under `rl:`: the listed row starts at the mean in the trained model, and the frozen
    copy DPO compares against starts from the same rows (at step 1 the policy is its reference: rewards 0)."""
    from transformers import AutoModelForCausalLM

    from tests.helpers.preference_runs import dpo_keys, write_preference_data

    base, _, unused = zeroed_base
    keys = dict(dpo_keys(write_preference_data(tmp_path)), base_model=str(base), fix_untrained_tokens=[unused])
    config = write_config(tmp_path / "dpo.yml", material, **keys)
    summary = run_world(run_summary, 1, str(config), ["micro_batch_size=4", "max_steps=2"], timeout=240)[0]
    assert summary["objective"] == "dpo"
    first = summary["metrics"][0]
    assert first["rewards/chosen"] == pytest.approx(0.0, abs=1e-6) and first["rewards/rejected"] == pytest.approx(
        0.0, abs=1e-6
    )
    merged = AutoModelForCausalLM.from_pretrained(summary["outputs"]["merged"])
    assert merged.get_output_embeddings().weight[unused].abs().max() > 0  # (listed: fixed though no record uses it)
