"""Axolotl's learning-rate keys: schedules (one_cycle with `lr_div_factor`; cosine with a floor reached early and
held, `cosine_constant_lr_ratio`, or a quadratic warm-up, `lr_quadratic_warmup`) and param groups (`embedding_lr`,
`embedding_lr_scale`, `lr_groups`), the groups trained alike under ZeRO-2 at world 2 as in one process."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")

from meshkit.training.optimizers import axolotl_groups  # noqa: E402
from meshkit.training.schedules import build_schedule  # noqa: E402
from tests.helpers.distributed import run_world  # noqa: E402
from tests.helpers.finetune_runs import run_finetune, write_config  # noqa: E402


def _rates(steps: int, **options) -> list[float]:
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    schedule = build_schedule(optimizer=optimizer, total=steps, **options)
    rates = []
    for _ in range(steps):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
    return rates


def test_cosine_reaches_its_floor_at_the_constant_ratio_and_holds_it() -> None:
    rates = _rates(20, name="cosine", warmup=2, min_lr_ratio=0.1, constant_lr_ratio=0.5)
    assert rates[:3] == pytest.approx([0.0, 0.5, 1.0])
    assert rates[10:] == pytest.approx([0.1] * 10)  # from step 20 × 0.5 on: the floor
    halfway = (6 - 2) / (10 - 2)  # a half cosine between the warm-up's end and step 10
    assert rates[6] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * halfway)))
    assert all(a >= b for a, b in zip(rates[2:], rates[3:], strict=False))


def test_quadratic_warmup_then_cosine_to_zero() -> None:
    rates = _rates(12, name="cosine", warmup=4, quadratic_warmup=True, min_lr_ratio=0.1)  # (quadratic wins)
    assert rates[:5] == pytest.approx([0.0, 1 / 16, 4 / 16, 9 / 16, 1.0])
    assert rates[8] == pytest.approx(0.5 * (1 + math.cos(math.pi * 4 / 8)))


def test_one_cycle_starts_at_the_lr_over_its_div_factor() -> None:
    assert _rates(10, name="one_cycle", warmup=3, div_factor=10.0)[0] == pytest.approx(0.1)
    assert _rates(10, name="one_cycle", warmup=3)[0] == pytest.approx(1 / 25)  # torch's default


def test_the_embedding_and_named_groups_take_their_own_rates() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1))  # fmt: skip
    embeddings = {id(p) for m in (model.get_input_embeddings(), model.get_output_embeddings()) for p in m.parameters()}
    groups = axolotl_groups(
        list(model.named_parameters()), embeddings, lr=1e-3, weight_decay=0.1, embedding_lr_scale=0.5,
        lr_groups=[{"name": "attention", "modules": ["self_attn"], "lr": 5e-4}],
    )  # fmt: skip
    rates = [(group["lr"], group["weight_decay"], len(group["params"])) for group in groups]
    # matrices; embedding + head; norms; the attention group (q, k, v, o of 2 layers)
    assert rates == [(1e-3, 0.1, 6), (5e-4, 0.0, 2), (1e-3, 0.0, 5), (5e-4, 0.1, 8)]
    assert sum(len(group["params"]) for group in groups) == len(list(model.parameters()))


def test_param_groups_under_zero2_equal_one_process(tmp_path, material) -> None:
    keys = {"embedding_lr": 0.05, "lr_groups": [{"name": "mlp", "modules": ["mlp"], "lr": 0.002}]}
    config = write_config(tmp_path / "g.yml", material, **keys)
    one = run_world(run_finetune, 1, str(config), [f"output_dir={tmp_path / 'one'}", "micro_batch_size=4"], timeout=180)
    two = run_world(run_finetune, 2, str(config), [f"output_dir={tmp_path / 'two'}", "zero_stage=2"], timeout=180)
    torch.testing.assert_close(torch.tensor(two[0]["losses"]), torch.tensor(one[0]["losses"]), rtol=1e-5, atol=0)
    plain = run_world(run_finetune, 1, str(write_config(tmp_path / "p.yml", material)),
                      [f"output_dir={tmp_path / 'plain'}", "micro_batch_size=4"], timeout=180)  # fmt: skip
    assert abs(plain[0]["losses"][-1] - one[0]["losses"][-1]) > 1e-4  # the groups' rates changed the run
