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

import torch
from torch.utils.data import DataLoader

LIBRARY, OUT, RESUME, STOP_AFTER = sys.argv[1], Path(sys.argv[2]), sys.argv[3], int(sys.argv[4])
TASK = sys.argv[5] if len(sys.argv) > 5 else "clm"  # clm: run_clm_no_trainer's shape; cls: run_glue_no_trainer's
if LIBRARY == "meshkit":
    from meshkit import Accelerator
else:
    from accelerate import Accelerator
from accelerate.logging import get_logger  # noqa: E402 - as the scripts import it, before the Accelerator exists
from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification, get_scheduler  # noqa: E402

logger = get_logger(__name__)
EPOCHS, CHECKPOINTING_STEPS, ACCUMULATION = 2, 2, 1


def rows(count: int, seed: int) -> list[dict[str, torch.Tensor]]:
    """Token rows; for `cls` a label each: whether the row's first token is below the vocabulary's middle."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 64, (count, 16), generator=generator)
    if TASK == "cls":
        return [{"input_ids": row, "labels": (row[0] < 32).long()} for row in ids]
    return [{"input_ids": row, "labels": row.clone()} for row in ids]


def metric(model: torch.nn.Module, evaluation: DataLoader, accelerator: Accelerator) -> float:
    """Perplexity from the gathered losses (clm), or accuracy from gathered predictions and references (cls)."""
    losses, correct, seen = [], 0, 0
    for batch in evaluation:
        with torch.no_grad():
            outputs = model(**batch)
        if TASK == "cls":
            predictions, references = accelerator.gather_for_metrics((outputs.logits.argmax(-1), batch["labels"]))
            correct, seen = correct + int((predictions == references).sum()), seen + len(references)
        else:
            losses.append(accelerator.gather_for_metrics(outputs.loss.repeat(2)))
    return correct / seen if TASK == "cls" else math.exp(torch.mean(torch.cat(losses)))


def main() -> None:
    logging.basicConfig(format="%(message)s", level=logging.INFO)
    accelerator = Accelerator(gradient_accumulation_steps=ACCUMULATION, cpu=True)
    logger.info(accelerator.state, main_process_only=False)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32, num_labels=2,
                         pad_token_id=0)  # fmt: skip
    model = LlamaForSequenceClassification(config) if TASK == "cls" else LlamaForCausalLM(config)
    train = DataLoader(rows(16, 1), shuffle=False, batch_size=2)  # 4 batches per rank per epoch at world 2
    # cls: 7 rows, the last batch padded, then trimmed by gather_for_metrics; clm: 6 (its metric is per batch, and
    # meshkit deals samples to ranks where Accelerate deals batches: padded batches would hold other rows)
    evaluation = DataLoader(rows(7 if TASK == "cls" else 6, 2), shuffle=False, batch_size=2)
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
        logger.info(f"epoch {epoch}: {'accuracy' if TASK == 'cls' else 'perplexity'}: {value}")
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
