"""transformers models in every layout, against one plain-torch process on the same global batch.

The user code is `AutoModelForCausalLM.from_config(cfg)`, `engine.prepare(model, optimizer)` and
`engine.train_step(batch)` on HF dict batches (no loss function, no glue). Losses and weights must match the
single-process run within 1e-5 relative over 4 steps; a cell meshkit cannot run must be refused before
training, with a one-line reason (listed in `REFUSED` and the support matrix in docs/any-model.md).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.distributed import run_world
from tests.helpers.hf_layouts import GROUPS, REFUSED, reference_of, render_matrix, run_families
from tests.helpers.training import assert_close_relative, assert_state_close

pytestmark = pytest.mark.slow  # the family sweep (make test runs it; test-quick keeps the core layouts)

ANY_MODEL_PAGE = Path(__file__).resolve().parents[2] / "docs" / "any-model.md"
README = Path(__file__).resolve().parents[2] / "README.md"


# the suite's fixed sample: every layout on Llama, Qwen2, GPT-2, OPT, GPT-J, Falcon, Nemotron, Bloom; the other
# families run in `make test-full`
SWEPT = {"qwen3-gemma3-gemma2", "phi3-glm4", "olmo2-stablelm-granite"}


@pytest.mark.parametrize(
    "group", [pytest.param(group, marks=[pytest.mark.sweep] if group in SWEPT else []) for group in GROUPS]
)
def test_every_layout_trains_like_one_process(group: str) -> None:
    results = run_world(run_families, 4, GROUPS[group], timeout=400)
    for family, layouts in GROUPS[group].items():
        for layout in layouts:
            losses, state = reference_of(family, layout)
            for rank, by_cell in enumerate(results):
                got = by_cell[family, layout]
                where = f"{family} {layout} on rank {rank}"
                if (family, layout) in REFUSED:
                    assert REFUSED[family, layout] in got.get("refused", ""), f"{where}: {got}"
                    assert "\n" not in got["refused"]
                    continue
                assert "refused" not in got, f"{where} refused: {got['refused']}"
                assert_close_relative(got["losses"], losses, 1e-5)
                assert_state_close(got["state"], state, 1e-5)


@pytest.mark.parametrize("page", [ANY_MODEL_PAGE, README])
def test_the_support_matrix_shown_is_the_tested_one(page: Path) -> None:
    assert render_matrix() in page.read_text(), (
        f"regenerate the matrix in {page.name}: "
        "python -c 'from tests.helpers.hf_layouts import render_matrix; print(render_matrix())'"
    )
