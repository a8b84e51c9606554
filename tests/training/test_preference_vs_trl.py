"""Each preference objective equals TRL's trainer of the same name: losses and reward metrics within 1e-5 over
3 SGD steps on the same batches (each step: the whole 4-pair dataset; TRL in fp32, the same gradient clipping)."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
pytest.importorskip("trl", reason="TRL (a test dependency) is not installed")

from meshkit.training.preference import CPO, DPO, KTO, ORPO  # noqa: E402
from tests.helpers.preference_runs import kto_records, make_preference_base, meshkit_metrics, pair_records, trl_metrics  # noqa: E402,E501


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return make_preference_base(tmp_path_factory.mktemp("preference-base"))


@pytest.fixture(scope="module")
def base_without_bos(tmp_path_factory):
    """A tokenizer that defines BOS but does not add it: TRL's ORPO and CPO trainers put it before the prompt."""
    return make_preference_base(tmp_path_factory.mktemp("preference-base-no-bos"), adds_bos=False)


CASES = {
    "dpo-sigmoid": ("dpo", {"beta": 0.1}, DPO(beta=0.1)),
    "dpo-wpo": ("dpo", {"beta": 0.1, "use_weighting": True}, DPO(beta=0.1, use_weighting=True)),
    "ipo": ("dpo", {"beta": 0.1, "loss_type": ["ipo"]}, DPO(beta=0.1, loss_types=("ipo",))),
    "dpo-robust-rpo": (
        "dpo",
        {"beta": 0.2, "loss_type": ["robust", "sft"], "loss_weights": [1.0, 0.5], "label_smoothing": 0.1},
        DPO(beta=0.2, loss_types=("robust", "sft"), loss_weights=(1.0, 0.5), label_smoothing=0.1),
    ),
    "kto": ("kto", {"beta": 0.5, "desirable_weight": 0.8}, KTO(beta=0.5, desirable_weight=0.8)),
    "orpo": ("orpo", {"beta": 0.2}, ORPO(beta=0.2)),
    "simpo": (
        "cpo",
        {"beta": 2.0, "loss_type": "simpo", "simpo_gamma": 0.5, "cpo_alpha": 0.5},
        CPO(beta=2.0, loss_type="simpo", simpo_gamma=0.5, cpo_alpha=0.5),
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_objective_equals_trl_trainer(base, tmp_path, case) -> None:
    _equal_to_trl(base, tmp_path, case)


@pytest.mark.parametrize("case", ["dpo-sigmoid", "orpo", "simpo"])
def test_with_a_tokenizer_that_does_not_add_its_bos_each_objective_reads_trls_ids(base_without_bos, tmp_path, case):
    _equal_to_trl(base_without_bos, tmp_path, case)


def _equal_to_trl(base, tmp_path, case) -> None:
    method, options, loss = CASES[case]
    records = kto_records() if method == "kto" else pair_records()
    theirs = trl_metrics(method, base, tmp_path / "trl", records, **options)
    ours = meshkit_metrics(base, records, loss)
    assert len(theirs) == len(ours) == 3
    names = ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen")
    for step, (their, our) in enumerate(zip(theirs, ours, strict=True)):
        for name in names:
            if name in their:
                assert our[name] == pytest.approx(their[name], abs=1e-5, rel=1e-5), (case, step, name, their, our)
    assert ours[-1]["loss"] < ours[0]["loss"]  # (and it trains)
