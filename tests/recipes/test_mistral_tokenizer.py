"""`tokenizer_use_mistral_common: true`: Mistral's own tokenizer (a tiny `tekken.json` written here) encodes each
conversation itself; the answers of assistant turns (with their end of sequence) train, the rest does not; a
fine-tune runs with it and exports a model and the tokenizer file that load again."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("mistral_common", reason="mistral-common (in the hf extra) is not installed")
pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")

from meshkit.data.dataset_entry import DatasetEntry  # noqa: E402
from meshkit.data.formats import Formatter  # noqa: E402
from meshkit.recipes.mistral_tokenizer import mistral_common_tokenizer  # noqa: E402
from meshkit.recipes.tiny_model import write_tiny_tekken  # noqa: E402
from meshkit.training.loss import IGNORE_INDEX  # noqa: E402
from tests.helpers.distributed import run_world  # noqa: E402
from tests.helpers.finetune_runs import lora_keys, run_finetune, write_config  # noqa: E402

RECORD = {"messages": [
    {"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
    {"role": "assistant", "content": "hello"}, {"role": "user", "content": "2+2"},
    {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3+3?"},
]}  # fmt: skip


@pytest.fixture(scope="module")
def mistral_base(tmp_path_factory) -> Path:
    from transformers import MistralConfig, MistralForCausalLM

    out = tmp_path_factory.mktemp("mistral-base")
    size = write_tiny_tekken(out)
    config = MistralConfig(vocab_size=size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, bos_token_id=1, eos_token_id=2,
                           pad_token_id=11)  # fmt: skip
    torch.manual_seed(0)
    MistralForCausalLM(config).save_pretrained(out)
    return out


def test_the_answers_and_their_ends_train_and_nothing_else(mistral_base) -> None:
    tokenizer = mistral_common_tokenizer(mistral_base)
    sample = Formatter(tokenizer, False, DatasetEntry(path="x", type="chat_template")).chat_template(RECORD, "rec 1")
    # (the last user turn has no answer: fine-tuning mode encodes conversations that end with one)
    assert list(sample.input_ids) == tokenizer.apply_chat_template(RECORD["messages"][:5], return_dict=False)
    trained = [label for label in sample.labels if label != IGNORE_INDEX]
    encode = tokenizer.encode
    eos = tokenizer.eos_token_id
    assert trained == [*encode("hello", add_special_tokens=False), eos, *encode("4", add_special_tokens=False), eos]
    every = Formatter(tokenizer, True, DatasetEntry(path="x", type="chat_template")).chat_template(RECORD, "rec 1")
    assert every.labels == every.input_ids  # train_on_inputs: every token


def test_a_fine_tune_with_mistrals_tokenizer_runs_and_exports_what_loads(tmp_path, material, mistral_base) -> None:
    from transformers import AutoModelForCausalLM

    # (eot_tokens: Axolotl's Voxtral example names one, which Mistral's tokenizer does not read)
    keys = dict(lora_keys(), base_model=str(mistral_base), tokenizer_use_mistral_common=True,
                datasets=[{"path": str(material["chat"]), "type": "chat_template"}],
                eot_tokens=["<end_of_turn>"])  # fmt: skip
    config = write_config(tmp_path / "c.yml", material, **keys)
    summary = run_world(run_finetune, 1, str(config), [f"output_dir={tmp_path / 'out'}"], timeout=240)[0]
    assert len(summary["losses"]) == 4 and all(loss == loss for loss in summary["losses"])
    merged = Path(summary["outputs"]["merged"])
    assert (merged / "tekken.json").is_file()
    assert len(mistral_common_tokenizer(merged)) == 276
    assert AutoModelForCausalLM.from_pretrained(merged).config.vocab_size == 276


def test_magistrals_thinking_chunks_train_with_the_answer(tmp_path) -> None:
    """Axolotl's Magistral/Ministral think examples: an assistant turn's content as chunks, a `thinking` one before
    the text; mistral-common (a v13 tokenizer) writes it between [THINK] and [/THINK], and it trains with the answer."""
    write_tiny_tekken(tmp_path, thinking=True)
    tokenizer = mistral_common_tokenizer(tmp_path)
    record = {"messages": [
        {"role": "user", "content": [{"type": "text", "text": "15% of 240?"}]},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "0.15 x 240"},
                                          {"type": "text", "text": "36"}]},
    ]}  # fmt: skip
    sample = Formatter(tokenizer, False, DatasetEntry(path="x", type="chat_template")).chat_template(record, "rec 1")
    trained = [label for label in sample.labels if label != IGNORE_INDEX]
    assert tokenizer.decode(trained) == "[THINK]0.15 x 240[/THINK]36</s>"
    assert tokenizer.decode(list(sample.input_ids)).startswith("<s>[INST]15% of 240?[/INST]")
