"""A script in the shape of transformers' `examples/pytorch/*/run_*_no_trainer.py` (its training loop, checkpointing
by step, `--resume_from_checkpoint step_N` / `epoch_N`, Accelerate's logger, `gather_for_metrics` perplexity and
`save_pretrained(save_function=accelerator.save)`), on a tiny Llama and synthetic tokens, offline. The library is
the first argument (`accelerate` or `meshkit`): the only line a user changes."""

from __future__ import annotations

import json
import logging
import math
import os
import sys
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

LIBRARY, OUT, RESUME, STOP_AFTER = sys.argv[1], Path(sys.argv[2]), sys.argv[3], int(sys.argv[4])
TASK = sys.argv[5] if len(sys.argv) > 5 else "clm"  # clm, mlm, cls, ner, swag: run_clm/mlm/glue/ner/swag's shapes
READS_PREDICTIONS = TASK in ("cls", "ner", "swag")  # accuracy from gathered predictions; else perplexity
if LIBRARY == "meshkit":
    from meshkit import Accelerator
else:
    from accelerate import Accelerator
from accelerate import DistributedType  # noqa: E402
from accelerate.logging import get_logger  # noqa: E402 - as the scripts import it, before the Accelerator exists
from accelerate.utils import set_seed  # noqa: E402
from transformers import (  # noqa: E402
    BertConfig,
    BertForMaskedLM,
    BertForMultipleChoice,
    DataCollatorForLanguageModeling,
    LlamaConfig,
    LlamaForCausalLM,
    LlamaForSequenceClassification,
    LlamaForTokenClassification,
    PreTrainedTokenizerFast,
    get_scheduler,
)

logger = get_logger(__name__)
EPOCHS, CHECKPOINTING_STEPS, ACCUMULATION = 2, 2, 1
FACTS = ("num_processes", "process_index", "local_process_index", "is_main_process", "is_local_main_process",
         "use_distributed", "mixed_precision", "gradient_accumulation_steps", "sync_gradients")  # fmt: skip


def rows(count: int, seed: int) -> list[dict[str, Any]]:
    """Token rows; for `cls` a label each: whether the row's first token is below the vocabulary's middle; for
    `mlm` ids only (the collator masks them and makes the labels); for `ner` a label per token (rows of 6 to 16
    tokens, so batches differ in length across processes); for `swag` four choices, the answer the one whose first
    token is smallest."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 64, (count, 16), generator=generator)
    if TASK == "cls":
        return [{"input_ids": row, "labels": (row[0] < 32).long()} for row in ids]
    if TASK == "mlm":
        return [{"input_ids": row.tolist()} for row in ids]
    if TASK == "ner":
        lengths = torch.randint(6, 17, (count,), generator=generator).tolist()
        return [{"input_ids": row[:n], "labels": (row[:n] < 32).long()} for row, n in zip(ids, lengths, strict=True)]
    if TASK == "swag":
        choices = torch.randint(5, 64, (count, 4, 8), generator=generator)
        return [{"input_ids": row, "labels": row[:, 0].argmin()} for row in choices]
    return [{"input_ids": row, "labels": row.clone()} for row in ids]


def padding_collator(examples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """DataCollatorForTokenClassification's padding: ids with 0, labels with -100, to the batch's longest row."""
    longest = max(len(e["input_ids"]) for e in examples)
    ids = torch.zeros(len(examples), longest, dtype=torch.long)
    labels = torch.full((len(examples), longest), -100)
    for row, example in enumerate(examples):
        ids[row, : len(example["input_ids"])] = example["input_ids"]
        labels[row, : len(example["labels"])] = example["labels"]
    return {"input_ids": ids, "attention_mask": (labels != -100).long(), "labels": labels}


def masking_collator() -> DataCollatorForLanguageModeling:
    """run_mlm_no_trainer's collator (15 % of the tokens masked at random, from the process's torch generator)
    over a word-level tokenizer of 64 ids built here."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit

    specials = ["[PAD]", "[UNK]", "[MASK]", "[CLS]", "[SEP]"]
    vocab = {token: i for i, token in enumerate(specials + [f"w{i}" for i in range(5, 64)])}
    words = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    words.pre_tokenizer = WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, pad_token="[PAD]", unk_token="[UNK]",
                                        mask_token="[MASK]", cls_token="[CLS]", sep_token="[SEP]")  # fmt: skip
    return DataCollatorForLanguageModeling(tokenizer, mlm_probability=0.15)


def model_for_task() -> torch.nn.Module:
    if TASK in ("mlm", "swag"):
        bert = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                          intermediate_size=64, max_position_embeddings=32, hidden_dropout_prob=0.0,
                          attention_probs_dropout_prob=0.0)  # fmt: skip
        return BertForMaskedLM(bert) if TASK == "mlm" else BertForMultipleChoice(bert)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32, num_labels=2,
                         pad_token_id=0)  # fmt: skip
    kinds = {"cls": LlamaForSequenceClassification, "ner": LlamaForTokenClassification}
    return kinds.get(TASK, LlamaForCausalLM)(config)


def metric(model: torch.nn.Module, evaluation: DataLoader, accelerator: Accelerator) -> float:
    """Perplexity from the gathered, repeated per-batch losses (clm, mlm: as the scripts compute it, over rows that
    are not the batch's own), or accuracy from gathered predictions and references (cls, swag; ner per labelled
    token, its batches padded across processes first, as run_ner_no_trainer does)."""
    losses, correct, seen = [], 0, 0
    for batch in evaluation:
        with torch.no_grad():
            outputs = model(**batch)
        if not READS_PREDICTIONS:
            losses.append(accelerator.gather_for_metrics(outputs.loss.repeat(2)))
            continue
        predictions, references = outputs.logits.argmax(-1), batch["labels"]
        if TASK == "ner":
            predictions = accelerator.pad_across_processes(predictions, dim=1, pad_index=-100)
            references = accelerator.pad_across_processes(references, dim=1, pad_index=-100)
        predictions, references = accelerator.gather_for_metrics((predictions, references))
        counted = references != -100
        correct += int((predictions[counted] == references[counted]).sum())
        seen += int(counted.sum())
    return correct / seen if READS_PREDICTIONS else math.exp(torch.mean(torch.cat(losses)))


def main() -> None:
    logging.basicConfig(format="%(message)s", level=logging.INFO)
    accelerator = Accelerator(gradient_accumulation_steps=ACCUMULATION, cpu=True)
    logger.info(accelerator.state, main_process_only=False)
    if RESUME == "none":  # the facts such scripts branch on, to compare with Accelerate's for the same world
        facts = {
            "distributed_type": str(accelerator.distributed_type),
            "is_multi_cpu": accelerator.distributed_type == DistributedType.MULTI_CPU,
            "state_type": str(accelerator.state.distributed_type),
            **{name: getattr(accelerator, name) for name in FACTS},
            "device_type": accelerator.device.type,  # (Accelerate names it `cpu:0` at world 2; a tensor's: `cpu`)
        }
        (OUT / f"facts-{accelerator.process_index}.json").write_text(json.dumps(facts))
    set_seed(0)
    model = model_for_task()
    collate = masking_collator() if TASK == "mlm" else padding_collator if TASK == "ner" else None
    train = DataLoader(rows(16, 1), shuffle=False, batch_size=2, collate_fn=collate)  # 4 batches per rank per epoch
    # 7 rows: the last batch padded, then cut by gather_for_metrics
    evaluation = DataLoader(rows(7, 2), shuffle=False, batch_size=2, collate_fn=collate)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    steps_per_epoch = math.ceil(len(train) / ACCUMULATION / accelerator.num_processes)
    # (as the scripts do: the prepared scheduler steps once per process per optimizer step)
    total = EPOCHS * steps_per_epoch * accelerator.num_processes
    scheduler = get_scheduler("linear", optimizer, num_warmup_steps=0, num_training_steps=total)
    model, optimizer, train, evaluation, scheduler = accelerator.prepare(model, optimizer, train, evaluation, scheduler)
    steps_per_epoch = math.ceil(len(train) / ACCUMULATION)
    completed_steps, starting_epoch, resume_step = 0, 0, None
    if RESUME != "none":
        accelerator.load_state(str(OUT / RESUME))
        difference = RESUME
        if "epoch" in difference:
            starting_epoch = int(difference.replace("epoch_", "")) + 1
            completed_steps = starting_epoch * steps_per_epoch
        else:
            resume_step = int(difference.replace("step_", "")) * ACCUMULATION
            starting_epoch = resume_step // len(train)
            completed_steps = resume_step // ACCUMULATION
            resume_step -= starting_epoch * len(train)
    metrics = []
    for epoch in range(starting_epoch, EPOCHS):
        model.train()
        if RESUME != "none" and epoch == starting_epoch and resume_step is not None:
            active = accelerator.skip_first_batches(train, resume_step)
        else:
            active = train
        for batch in active:
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                completed_steps += 1
                if completed_steps % CHECKPOINTING_STEPS == 0:
                    accelerator.save_state(str(OUT / f"step_{completed_steps}"))
                if completed_steps == STOP_AFTER:
                    return
        model.eval()
        value = metric(model, evaluation, accelerator)
        logger.info(f"epoch {epoch}: {'accuracy' if READS_PREDICTIONS else 'perplexity'}: {value}")
        metrics.append({"epoch": epoch, "metric": value, "steps": completed_steps})
        accelerator.save_state(str(OUT / f"epoch_{epoch}"))
    accelerator.wait_for_everyone()
    unwrapped = accelerator.unwrap_model(model)
    unwrapped.save_pretrained(
        str(OUT / f"final-{RESUME}"), is_main_process=accelerator.is_main_process, save_function=accelerator.save
    )
    if accelerator.is_main_process:
        (OUT / f"metrics-{RESUME}.json").write_text(json.dumps(metrics))
    accelerator.end_training()


if __name__ == "__main__":
    os.environ.setdefault("ACCELERATE_USE_CPU", "true")
    main()
