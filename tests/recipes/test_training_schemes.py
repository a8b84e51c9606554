"""Axolotl's training schemes honoured: jagged learning-rate restarts, LISA (blocks sampled to train) and ReLoRA
(adapters merged into the base and restarted) — each as Axolotl defines it, and the same in every layout."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from meshkit.engine.engine import Engine
from meshkit.training.schedules import build_schedule, jagged_restarts

TIMEOUT = 240


def _lrs(schedule, optimizer, steps: int) -> list[float]:
    out = []
    for _ in range(steps):
        out.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
    return out


def test_jagged_restarts_scale_the_schedule_as_axolotl_defines_them() -> None:
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    inner = build_schedule("constant", optimizer, warmup=0, total=20)
    schedule = jagged_restarts(inner, every=6, warmup=2, anneal=2, floor=0.1)
    # steps < every - anneal: untouched; then each window of 6 rises over 2 steps from the floor and falls over
    # the last 2 (into > every - anneal): (6 - into) / 2
    rise = [0.1, 0.1 + 0.9 * 0.5, 1.0, 1.0, 1.0, 0.1 + 0.9 * 0.5]
    expected = [1.0, 1.0, 1.0, 1.0, 1.0, 0.1 + 0.9 * 0.5] + rise + rise
    torch.testing.assert_close(torch.tensor(_lrs(schedule, optimizer, 18)), torch.tensor(expected))
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    cosine = build_schedule("cosine", optimizer, warmup=0, total=10)
    reference = [0.5 * (1 + torch.cos(torch.tensor(torch.pi * step / 10))).item() for step in range(10)]
    jagged = jagged_restarts(cosine, every=4, warmup=None, anneal=None, floor=None)  # (10, 1, 0.001)
    # a warm-up longer than the window: each window only rises (into / 10), from step every - anneal = 3 on
    factors = [1.0, 1.0, 1.0] + [0.001 + 0.999 * into / 10 for into in (3, 0, 1, 2, 3, 0, 1)]
    expected = [lr * factor for lr, factor in zip(reference, factors, strict=True)]
    torch.testing.assert_close(torch.tensor(_lrs(jagged, optimizer, 10)), torch.tensor(expected))


def _stack() -> torch.nn.Sequential:
    torch.manual_seed(3)
    return torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Linear(6, 6), torch.nn.Linear(6, 2))


def test_parameters_left_out_of_steps_move_as_if_frozen() -> None:
    """The engine's mechanism under LISA against Axolotl's (requires_grad off): AdamW with weight decay and a
    clip norm, three steps, the resting layer changing after the first — equal to the last bit or two (the clip
    norm is summed in another order on some CPUs: 6e-8 seen)."""
    frozen_way = _stack()
    batches = [torch.randn(4, 6, generator=torch.Generator().manual_seed(step)) for step in range(3)]
    resting = [1, 0, 0]  # the layer left out at each step
    reference_opt = torch.optim.AdamW(frozen_way.parameters(), lr=0.1, weight_decay=0.1)
    for step, batch in enumerate(batches):
        for index in (0, 1):
            frozen_way[index].requires_grad_(index != resting[step])
        frozen_way(batch).pow(2).mean().backward()
        torch.nn.utils.clip_grad_norm_([p for p in frozen_way.parameters() if p.grad is not None], 0.05)
        reference_opt.step()
        reference_opt.zero_grad()
    with Engine(max_grad_norm=0.05) as engine:
        model = _stack()
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.1)
        model, optimizer = engine.prepare(model, optimizer)
        for step, batch in enumerate(batches):
            engine.leave_out_of_steps(list(model[resting[step]].parameters()))
            engine.backward(model(batch).pow(2).mean())
            engine.clip_grad_norm_(0.05)
            optimizer.step()
            optimizer.zero_grad()
    for (name, mine), theirs in zip(model.named_parameters(), frozen_way.parameters(), strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-6, atol=1e-7, msg=name)


def test_a_relora_restart_merges_restarts_and_prunes_without_changing_the_function() -> None:
    peft = pytest.importorskip("peft", reason="the hf extra (peft) is not installed")
    from meshkit.tuning.relora import AdapterRestarts

    torch.manual_seed(0)
    inner = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["0", "2"], init_lora_weights="gaussian")
    probe = torch.randn(5, 16, generator=torch.Generator().manual_seed(9))
    with Engine(seed=7) as engine:
        model, optimizer = engine.prepare(
            lora := peft.get_peft_model(inner, config), torch.optim.AdamW(lora.parameters(), lr=0.05)
        )
        for step in range(2):
            engine.backward(model(torch.randn(8, 16, generator=torch.Generator().manual_seed(step))).pow(2).mean())
            optimizer.step()
            optimizer.zero_grad()
        layer = lora.base_model.model[0]
        before = model(probe).detach()
        base = layer.base_layer.weight.detach().clone()
        update = (layer.lora_B["default"].weight @ layer.lora_A["default"].weight).detach() * layer.scaling["default"]
        moment = optimizer.optimizer.state[layer.lora_A["default"].weight]["exp_avg"].clone()
        restarts = AdapterRestarts(engine, every=2, method="magnitude", ratio=0.75)
        restarts.before_step(1)  # not a restart step: nothing changes
        assert torch.equal(layer.base_layer.weight, base)
        restarts.before_step(2)
        torch.testing.assert_close(model(probe), before, rtol=1e-5, atol=1e-6)  # the function is kept
        torch.testing.assert_close(layer.base_layer.weight, base + update)
        assert not layer.lora_B["default"].weight.any()
        a = layer.lora_A["default"].weight
        assert a.abs().max() <= 1 / 16**0.5 and a.std() > 0.1  # peft's start: kaiming-uniform, bound 1/sqrt(fan_in)
        pruned = optimizer.optimizer.state[layer.lora_A["default"].weight]["exp_avg"]
        kept = moment.abs() > torch.quantile(moment.abs().flatten(), 0.75)
        assert torch.equal(pruned, moment * kept) and 0 < int(kept.sum()) <= moment.numel() // 4
        first_a = a.detach().clone()
    with Engine(seed=7) as engine:  # the same draw in another process (or rank): seeded by seed, restart, layer
        torch.manual_seed(0)
        again = peft.get_peft_model(
            torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4)), config
        )
        model, optimizer = engine.prepare(again, torch.optim.AdamW(again.parameters(), lr=0.05))
        engine.backward(model(probe).pow(2).mean())
        optimizer.step()
        AdapterRestarts(engine, every=2, method="reset", ratio=0.999).before_step(2)
        assert torch.equal(again.base_model.model[0].lora_A["default"].weight, first_a)


def _run(tmp_path: Path, config: Path, name: str, world: int, *args: str) -> dict:
    from tests.helpers.distributed import run_world
    from tests.helpers.finetune_runs import run_finetune

    assignments = [f"output_dir={tmp_path / name}", *args]
    return run_world(run_finetune, world, str(config), assignments, timeout=TIMEOUT)[0]


def _merged(summary: dict) -> dict[str, torch.Tensor]:
    return load_file(Path(summary["outputs"]["merged"]) / "model.safetensors")


def test_lisa_trains_only_the_drawn_blocks_and_zero3_equals_one_process(tmp_path, material) -> None:
    pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
    from tests.helpers.finetune_runs import write_config

    config = write_config(
        tmp_path / "c.yml", material, lisa_n_layers=1, lisa_step_interval=4, weight_decay=0.1, max_grad_norm=1.0
    )
    one = _run(tmp_path, config, "one", 1, "micro_batch_size=4")
    base, trained = load_file(Path(material["base"]) / "model.safetensors"), _merged(one)
    moved = {
        index
        for index in (0, 1)
        for name, tensor in base.items()
        if name.startswith(f"model.layers.{index}.") and not torch.equal(tensor, trained[name])
    }
    assert len(moved) == 1  # one block of two trained; the other is the base's, bit for bit
    assert not torch.equal(base["model.embed_tokens.weight"], trained["model.embed_tokens.weight"])
    zero3 = _run(tmp_path, config, "zero3", 2, "zero_stage=3")
    torch.testing.assert_close(torch.tensor(zero3["losses"]), torch.tensor(one["losses"]), rtol=1e-5, atol=0)
    for name, tensor in _merged(zero3).items():  # (AdamW turns a gradient's last-bit rounding into ~lr·1e-4)
        torch.testing.assert_close(tensor, trained[name], rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("full", [False, pytest.param(True, marks=pytest.mark.sweep)])  # (tp, pp too: test-full)
def test_relora_restarts_in_zero3_tp_and_pp_equal_one_process_and_resume(tmp_path, material, full) -> None:
    pytest.importorskip("peft", reason="the hf extra (peft) is not installed")
    from tests.helpers.finetune_runs import lora_keys, write_config

    config = write_config(
        tmp_path / "c.yml", material, **lora_keys(), relora=True, jagged_restart_steps=2,
        jagged_restart_warmup_steps=1, save_steps=2, lr_scheduler="constant",
    )  # fmt: skip
    one = _run(tmp_path, config, "one", 1, "micro_batch_size=4")
    assert "adapter" not in one["outputs"]  # (an adapter of the last restart means nothing without its base)
    base, merged = load_file(Path(material["base"]) / "model.safetensors"), _merged(one)
    assert not torch.equal(
        base["model.layers.0.self_attn.q_proj.weight"], merged["model.layers.0.self_attn.q_proj.weight"]
    )
    runs = {}
    layouts = (
        ("zero3", ("zero_stage=3",)),
        ("tp", ("tp=2", "micro_batch_size=4")),
        ("pp", ("pp=2", "micro_batch_size=4")),
    )
    for name, args in layouts[: 3 if full else 1]:
        runs[name] = _run(tmp_path, config, name, 2, *args)
        torch.testing.assert_close(torch.tensor(runs[name]["losses"]), torch.tensor(one["losses"]), rtol=1e-5, atol=0)
        for key, tensor in _merged(runs[name]).items():
            torch.testing.assert_close(tensor, merged[key], rtol=1e-4, atol=1e-6, msg=f"{name}: {key}")
    import shutil

    shutil.rmtree(tmp_path / "zero3" / "checkpoints" / "step-000004")  # resumed from step 2: the restart comes next
    resumed = _run(tmp_path, config, "zero3", 2, "zero_stage=3", "auto_resume_from_checkpoints=true")
    assert resumed["resumed_at_step"] == 2
    torch.testing.assert_close(
        torch.tensor(resumed["losses"]), torch.tensor(runs["zero3"]["losses"]), rtol=1e-6, atol=0
    )


def test_relora_over_a_4bit_base_merges_through_peft_keeps_the_function_and_resumes(tmp_path, material) -> None:
    pytest.importorskip("bitsandbytes", reason="the hf extra (bitsandbytes) is not installed")
    from tests.helpers.finetune_runs import lora_keys, write_config

    keys = {**lora_keys(adapter="qlora"), "load_in_4bit": True, "lr_scheduler": "constant"}
    plain = _run(tmp_path, write_config(tmp_path / "p.yml", material, **keys), "plain", 1)["losses"]
    config = write_config(
        tmp_path / "r.yml", material, **keys, relora=True, jagged_restart_steps=2, jagged_restart_warmup_steps=1,
        save_steps=3,
    )  # fmt: skip
    restarted = _run(tmp_path, config, "relora", 1)["losses"]
    # the restart at step 2 merges the adapters into the requantized base and zeroes B: the model's function is
    # kept up to 4-bit rounding (step 2's loss), while the steps after it train fresh adapters
    assert restarted[:2] == plain[:2]
    torch.testing.assert_close(torch.tensor(restarted[2]), torch.tensor(plain[2]), rtol=5e-4, atol=0)
    assert restarted[3] != plain[3]
    # a checkpoint after the restart holds the requantized weights and their quantization state: resumed = straight
    import shutil

    shutil.rmtree(tmp_path / "relora" / "checkpoints" / "step-000004")
    resumed = _run(tmp_path, config, "relora", 1, "auto_resume_from_checkpoints=true")
    assert resumed["resumed_at_step"] == 3 and resumed["losses"] == restarted


def test_what_lisa_and_relora_need_of_the_layout_is_one_line(tmp_path, material) -> None:
    from meshkit.recipes.finetune_config import resolve_finetune
    from meshkit.recipes.schemes import refusal
    from tests.helpers.finetune_runs import lora_keys, write_config

    def settings(**keys):
        return resolve_finetune(str(write_config(tmp_path / "s.yml", material, **keys)), [], env={}).settings

    lisa = settings(lisa_n_layers=1, lisa_step_interval=2)
    relora = settings(**lora_keys(), relora=True, jagged_restart_steps=2)
    qlora = settings(**lora_keys(adapter="qlora"), relora=True, jagged_restart_steps=2)
    assert refusal(0, 1, lisa) is None and refusal(3, 2, lisa) is None and refusal(3, 2, relora) is None
    assert refusal(0, 1, qlora) is None
    cases = [
        (refusal(2, 1, lisa), "LISA leaves resting blocks out of each step, which zero_stage 2 steps as flat"),
        (refusal(0, 1, settings(**lora_keys(), lisa_n_layers=1, lisa_step_interval=2)), "drop adapter"),
        (refusal(1, 1, relora), "zero_stage 1 keeps in flat chunks of many parameters: use zero_stage 0 or 3"),
        (refusal(3, 1, qlora), "relora over a 4/8-bit base merges into whole quantized weights"),
        (refusal(0, 1, settings(relora=True, jagged_restart_steps=2)), "set adapter: lora"),
    ]
    for line, expected in cases:
        assert line is not None and expected in line and "\n" not in line, line


def test_eaft_weighs_each_tokens_loss_as_axolotl_defines_it() -> None:
    from meshkit.training.loss import IGNORE_INDEX, token_loss_sum
    from meshkit.training.token_weights import entropy_weights

    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 11, generator=generator, requires_grad=True)
    targets = torch.randint(0, 11, (2, 5), generator=generator)
    targets[0, :2] = IGNORE_INDEX
    mine = token_loss_sum(logits, targets, entropy_weights(alpha=0.5, k=4))
    # Axolotl's eaft_loss, written out: the counted rows' top-4 logits -> softmax -> entropy ** alpha, no gradient
    flat, flat_targets = logits.view(-1, 11), targets.view(-1)
    counted = flat_targets != IGNORE_INDEX
    with torch.no_grad():
        top = torch.softmax(torch.topk(flat[counted], k=4, dim=-1).values, dim=-1)
        weight = (-(top * torch.log(top + 1e-10)).sum(-1)) ** 0.5
    theirs = (torch.nn.functional.cross_entropy(flat[counted], flat_targets[counted], reduction="none") * weight).sum()
    torch.testing.assert_close(mine, theirs)
    (mine_grad,) = torch.autograd.grad(mine, logits)
    (their_grad,) = torch.autograd.grad(theirs, logits)
    torch.testing.assert_close(mine_grad, their_grad)
    plain = token_loss_sum(logits, targets)
    assert not torch.allclose(mine, plain)


@pytest.mark.parametrize("layout", ["tp=2", pytest.param("pp=2", marks=pytest.mark.sweep)])  # (pp: test-full)
def test_eaft_under_tp_and_pp_equals_one_process(tmp_path, material, layout) -> None:
    pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
    from tests.helpers.finetune_runs import write_config

    config = write_config(tmp_path / "c.yml", material, use_eaft=True, eaft_alpha=1.0, eaft_k=5)
    plain = _run(tmp_path, write_config(tmp_path / "p.yml", material), "plain", 1, "micro_batch_size=4")
    one = _run(tmp_path, config, "one", 1, "micro_batch_size=4")
    assert one["losses"][0] != pytest.approx(plain["losses"][0], rel=1e-3)  # the weights apply
    losses = _run(tmp_path, config, "two", 2, layout, "micro_batch_size=4")["losses"]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(one["losses"]), rtol=1e-5, atol=0)
