"""Quantization-aware training (`qat:`, Axolotl's block) through torchao: the run's first steps before
`fake_quant_after_n_steps` equal a plain fine-tune, later ones differ (the rounding is on); two ranks equal one in
each layout; merged/ holds full-precision weights a plain `from_pretrained` loads; combinations torchao does not
have are one line."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
pytest.importorskip("torchao", reason="the hf extra (torchao) is not installed")

from meshkit.tuning.qat import QATError, QATSettings, prepare_for_qat  # noqa: E402
from tests.helpers.distributed import run_world  # noqa: E402
from tests.helpers.finetune_runs import run_finetune, write_config  # noqa: E402

TIMEOUT = 240
QAT = {"weight_dtype": "int4", "activation_dtype": "int8", "group_size": 32, "fake_quant_after_n_steps": 2}


def _run(tmp_path, material, name: str, world: int, assignments=(), **keys) -> dict:
    folder = tmp_path / name
    folder.mkdir()
    config = write_config(folder / "c.yaml", material, max_steps=4, learning_rate=0.05, **keys)
    return run_world(run_finetune, world, str(config), list(assignments), timeout=TIMEOUT)[0]


@pytest.fixture(scope="module")
def references(material, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("qat")
    return {"plain": _run(root, material, "plain", 1), "qat": _run(root, material, "qat", 1, qat=QAT)}


def test_fake_quantization_starts_at_its_step_and_the_export_is_full_precision(references) -> None:
    from transformers import AutoModelForCausalLM

    plain, qat = references["plain"]["losses"], references["qat"]["losses"]
    assert qat[:2] == pytest.approx(plain[:2], rel=1e-6)  # (steps 0 and 1: fake quantization off)
    assert abs(qat[2] - plain[2]) > 1e-4  # on from step 2
    model = AutoModelForCausalLM.from_pretrained(references["qat"]["outputs"]["merged"])
    assert getattr(model.config, "quantization_config", None) is None
    assert all(type(m).__name__ in ("Linear",) for n, m in model.named_modules() if n.endswith("_proj"))


@pytest.mark.parametrize("layout", [pytest.param("zero_stage=3", marks=pytest.mark.sweep), "pp=2"])
def test_two_ranks_equal_one_process(tmp_path, material, references, layout) -> None:
    two = _run(tmp_path, material, "two", 2, [layout], qat=QAT, micro_batch_size=1 if "zero" in layout else 2)
    # (the rounding is a step function: a last-bit difference in a weight, from another summation order, may move
    # one value to the next int4 level — so layouts agree to the rounding's resolution, not to float precision)
    torch.testing.assert_close(
        torch.tensor(two["losses"]), torch.tensor(references["qat"]["losses"]), rtol=5e-4, atol=5e-4
    )
    assert two["losses"][:2] == pytest.approx(references["plain"]["losses"][:2], rel=1e-5)


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        ({"weight_dtype": "int8"}, "int8 weights are not a torchao QAT configuration"),
        ({"weight_dtype": "int4", "activation_dtype": "int4"}, "int4 activations with int4 weights"),
        ({"weight_dtype": "nvfp4", "activation_dtype": "nvfp4", "group_size": 32}, "nvfp4 scales blocks of 16"),
        ({"weight_dtype": "mxfp4", "activation_dtype": "mxfp4", "quantize_embedding": True}, "not mxfp4"),
        ({"weight_dtype": "fp8", "activation_dtype": "int8"}, "float8 weights go with float8 activations"),
    ],
)
def test_combinations_torchao_does_not_have_are_one_line(keys, message) -> None:
    with pytest.raises(QATError, match=message) as caught:
        prepare_for_qat(torch.nn.Linear(64, 64), QATSettings(**keys), torch.device("cpu"))
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize(
    ("weights", "activations", "kind"),
    [("int4", None, "FakeQuantizedLinear"), ("fp8", "fp8", "FakeQuantizedLinear"),
     ("mxfp4", "mxfp4", "MXFakeQuantizedLinear"), ("int4", "float8", "FakeQuantizedLinear")],
)  # fmt: skip
def test_each_combination_rounds_in_the_forward_and_passes_the_gradient(weights, activations, kind) -> None:
    torch.manual_seed(0)
    plain = torch.nn.Linear(64, 32)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32))
    model[0].load_state_dict(plain.state_dict())
    prepare_for_qat(model, QATSettings(weight_dtype=weights, activation_dtype=activations), torch.device("cpu"))
    x = torch.randn(4, 64)
    out = model(x)
    out.sum().backward()
    assert type(model[0]).__name__ == kind and not torch.allclose(out, plain(x))
    assert model[0].weight.grad is not None and sorted(model.state_dict()) == ["0.bias", "0.weight"]


def test_tensor_parallel_is_refused_in_one_line(tmp_path, material) -> None:
    from meshkit.config.layout import Layout
    from meshkit.recipes.finetune import FinetuneError, check_layout
    from meshkit.recipes.finetune_config import resolve_finetune

    job = resolve_finetune(str(write_config(tmp_path / "c.yaml", material, qat=QAT)), [])
    with pytest.raises(FinetuneError, match="qat: torchao's fake-quantized layers do not split over tensor parallel"):
        check_layout(job.resolved.config, Layout(tp=2), job)


@pytest.mark.parametrize(("weights", "activations"), [("int4", "int8"), ("mxfp4", "mxfp4"), ("fp8", "fp8")])
def test_each_combination_runs_under_autocast(weights, activations) -> None:
    """meshkit's bf16 is autocast over float32 weights: torchao's MX layer (which wants its input and weight in one
    dtype) runs in the autocast dtype, as under a bf16 model."""
    model = torch.nn.Sequential(torch.nn.Linear(64, 32))
    prepare_for_qat(model, QATSettings(weight_dtype=weights, activation_dtype=activations), torch.device("cpu"))
    with torch.autocast("cpu", torch.bfloat16):
        out = model(torch.randn(4, 64))
    out.float().sum().backward()
    assert out.dtype == torch.bfloat16 and bool(model[0].weight.grad.abs().sum() > 0)


def test_nvfp4_off_a_blackwell_gpu_rounds_as_torchao_and_passes_its_gradient() -> None:
    """torchao's NVFP4 QAT layer multiplies in NVFP4 on a Blackwell GPU only; elsewhere its rounding (torchao's own
    quantizer) is applied to input and weight and the product taken in the layer's dtype, with torchao's backward:
    grad input = grad out @ rounded weight, grad weight = grad out^T @ rounded input."""
    from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, per_tensor_amax_to_scale

    def rounded(t: torch.Tensor) -> torch.Tensor:
        scale = per_tensor_amax_to_scale(t.abs().max())
        return NVFP4Tensor.to_nvfp4(t, per_tensor_scale=scale, is_swizzled_scales=False).dequantize(t.dtype)

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32))
    settings = QATSettings(weight_dtype="nvfp4", activation_dtype="nvfp4", group_size=16)
    prepare_for_qat(model, settings, torch.device("cpu"))
    assert type(model[0]).__name__ == "NVFP4FakeQuantizedLinear" and "no NVFP4 matmul" in settings.describe()
    x = torch.randn(2, 3, 64, requires_grad=True)
    out = model(x)
    flat, weight = x.detach().reshape(-1, 64), model[0].weight.detach()
    expected = torch.nn.functional.linear(rounded(flat), rounded(weight), model[0].bias.detach())
    torch.testing.assert_close(out.reshape(-1, 32), expected)
    grad = torch.randn_like(out)
    out.backward(grad)
    torch.testing.assert_close(x.grad.reshape(-1, 64), grad.reshape(-1, 32) @ rounded(weight))
    torch.testing.assert_close(model[0].weight.grad, grad.reshape(-1, 32).T @ rounded(flat))


def test_a_head_tied_to_the_embedding_stays_tied_when_swapped_on_the_meta_device() -> None:
    """meshkit swaps the layers before the weights stream in (on the meta device), where torchao's new layer gets a
    weight of its own: a tied head (Gemma 3, Llama 3.2) is tied again, so the checkpoint's one tensor fills both."""
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Embedding(64, 32), torch.nn.Linear(32, 64, bias=False))
    model[1].weight = model[0].weight
    prepare_for_qat(model, QATSettings(weight_dtype="int4", group_size=32), torch.device("cpu"))
    assert type(model[1]).__name__ == "FakeQuantizedLinear" and model[1].weight is model[0].weight
