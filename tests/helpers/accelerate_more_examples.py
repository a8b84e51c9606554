"""The rest of Accelerate's CPU-runnable examples, in their shape (see accelerate_examples.py for the first ones):
cross_validation (folds, free_memory, test logits averaged over folds), cv_example / complete_cv_example (an image
classifier with a frozen backbone, dict batches, OneCycleLR stepped per process, and the
complete form's per-epoch save_state and resume) and gradient_accumulation_for_autoregressive_models (a causal LM,
DDP's own no_sync, token counts gathered, clip_grad_norm_ on the parameters)."""

from __future__ import annotations

import contextlib
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from tests.helpers.accelerate_examples import _reset, bert, collate, evaluate, mrpc_like, run_topics, weights


def cross_validation(lib: SimpleNamespace, out: Path) -> dict[str, Any]:
    from transformers import get_linear_schedule_with_warmup

    accelerator = lib.Accelerator(cpu=True)
    data, test = mrpc_like(48, 0), mrpc_like(20, 1)
    folds = [(list(range(16, 48)), list(range(0, 16))), (list(range(0, 32)), list(range(32, 48)))]
    test_predictions, test_references = [], None
    for train_idxs, valid_idxs in folds:
        train = DataLoader([data[i] for i in train_idxs], shuffle=False, collate_fn=collate, batch_size=8)
        valid = DataLoader([data[i] for i in valid_idxs], shuffle=False, collate_fn=collate, batch_size=8)
        test_loader = DataLoader(test, shuffle=False, collate_fn=collate, batch_size=8)
        model = bert().to(accelerator.device)
        optimizer = torch.optim.AdamW(params=model.parameters(), lr=2e-3)
        scheduler = get_linear_schedule_with_warmup(optimizer, num_warmup_steps=2, num_training_steps=20)
        model, optimizer, train, valid, scheduler = accelerator.prepare(model, optimizer, train, valid, scheduler)
        model.train()
        for batch in train:
            accelerator.backward(model(**batch).loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        evaluate(accelerator, model, valid)
        model.eval()
        logits, references = [], []
        for batch in test_loader:  # (not prepared, as in the example: every process reads the whole test set)
            batch.to(accelerator.device)
            with torch.no_grad():
                found, wanted = accelerator.gather_for_metrics((model(**batch).logits, batch["labels"]))
            logits.append(found.cpu())
            references.append(wanted.cpu())
        test_predictions.append(torch.cat(logits))
        test_references = torch.cat(references)
        model, optimizer = accelerator.free_memory(model, optimizer)
    averaged = torch.stack(test_predictions).sum(dim=0).div(len(folds))
    return {"logits": {"averaged": averaged}, "predictions": averaged.argmax(dim=-1).tolist(),
            "references": test_references.tolist()}  # fmt: skip


class Images(Dataset):
    """Pets-like images as tensors: the label is which colour channel is brightest."""

    def __init__(self, count: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.images = torch.rand(count, 3, 16, 16, generator=generator)
        self.labels = torch.arange(count) % 3
        for index, label in enumerate(self.labels):
            self.images[index, label] += 0.5

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"image": self.images[index], "label": self.labels[index]}


def tiny_cnn() -> nn.Module:
    torch.manual_seed(7)
    backbone = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(2), nn.Flatten())
    return nn.Sequential(backbone, nn.Linear(32, 3))


def cv_setup(accelerator: Any, epochs: int) -> tuple:
    # (the example reads with num_workers=4; a test rank is a daemon process, which cannot start workers)
    train = DataLoader(Images(48, 0), shuffle=False, batch_size=8)
    evaluation = DataLoader(Images(20, 1), shuffle=False, batch_size=8)
    model = tiny_cnn().to(accelerator.device)
    for param in model[0].parameters():  # the pretrained backbone stays frozen; the classifier learns
        param.requires_grad = False
    optimizer = torch.optim.Adam(params=model.parameters(), lr=0.1 / 25)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, epochs=epochs, steps_per_epoch=len(train))
    return accelerator.prepare(model, optimizer, train, evaluation, scheduler)


def cv_epoch(accelerator: Any, objects: tuple, lrs: list[float]) -> float:
    model, optimizer, train, evaluation, scheduler = objects
    model.train()
    for batch in train:
        batch = {k: v.to(accelerator.device) for k, v in batch.items()}
        loss = nn.functional.cross_entropy(model(batch["image"]), batch["label"])
        accelerator.backward(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        lrs.append(scheduler.get_last_lr()[0])
    model.eval()
    accurate = elements = 0
    for batch in evaluation:
        with torch.no_grad():
            predictions = model(batch["image"]).argmax(dim=-1)
        predictions, references = accelerator.gather_for_metrics((predictions, batch["label"]))
        accurate += int((predictions == references).sum())
        elements += len(predictions)
    return accurate / elements


def cv_example(lib: SimpleNamespace, out: Path) -> dict[str, Any]:
    accelerator = lib.Accelerator(cpu=True, mixed_precision="no")
    objects = cv_setup(accelerator, epochs=2)
    lrs: list[float] = []
    metrics = [cv_epoch(accelerator, objects, lrs) for _ in range(2)]
    return {"metrics": metrics, "lrs": lrs, "weights": weights(accelerator, objects[0])}


def complete_cv_example(lib: SimpleNamespace, out: Path) -> dict[str, Any]:
    """complete_cv_example: save_state each epoch, then a fresh run resumes after epoch 0."""
    results: dict[str, Any] = {}
    for resume in (False, True):
        accelerator = lib.Accelerator(cpu=True, project_dir=str(out / "project"))
        objects = cv_setup(accelerator, epochs=2)
        start = 0
        if resume:
            accelerator.load_state(str(out / "epoch_0"))
            start = 1
        lrs: list[float] = []
        for epoch in range(start, 2):
            cv_epoch(accelerator, objects, lrs)
            if not resume:
                accelerator.save_state(str(out / f"epoch_{epoch}"))
        results["resumed" if resume else "straight"] = weights(accelerator, objects[0])
        _reset(lib)
    return results


EVAL_BATCH_SIZE = 32


def autoregressive(lib: SimpleNamespace, out: Path) -> dict[str, Any]:
    """gradient_accumulation_for_autoregressive_models: the token-weighted loss over a window of micro-batches."""
    from transformers import LlamaConfig, LlamaForCausalLM, get_constant_schedule

    accumulation, max_grad_norm = 2, 1.0
    accelerator = lib.Accelerator(cpu=True, gradient_accumulation_steps=accumulation)
    rows = [{"input_ids": r["input_ids"]} for r in mrpc_like(32, 2)]

    def pad(examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        longest = max(len(e["input_ids"]) for e in examples)
        ids = torch.zeros(len(examples), longest, dtype=torch.long)
        labels = torch.full_like(ids, -100)
        for row, example in enumerate(examples):
            ids[row, : len(example["input_ids"])] = labels[row, : len(example["input_ids"])] = torch.tensor(
                example["input_ids"]
            )
        return {"input_ids": ids, "labels": labels}

    torch.manual_seed(3)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
    model = LlamaForCausalLM(config).to(accelerator.device)
    optimizer = torch.optim.AdamW(params=model.parameters(), lr=1e-2)
    loader = DataLoader(rows, shuffle=False, batch_size=2, collate_fn=pad)
    held_out = [{"input_ids": r["input_ids"]} for r in mrpc_like(45, 4)]
    evaluation = DataLoader(held_out, shuffle=False, batch_size=EVAL_BATCH_SIZE, collate_fn=pad)
    model, optimizer, loader, evaluation, scheduler = accelerator.prepare(
        model, optimizer, loader, evaluation, get_constant_schedule(optimizer)
    )
    per_epoch = len(loader)
    remainder = per_epoch % accumulation or accumulation
    updates = math.ceil(per_epoch / accumulation)
    norms, losses = [], []
    model.train()
    iterator = iter(loader)
    for update in range(updates):
        batches = [next(iterator) for _ in range(accumulation if update != updates - 1 else remainder)]
        local_items = sum((batch["labels"].ne(-100)).sum() for batch in batches)
        items = accelerator.gather(local_items).sum().item()
        step_losses = []
        for index, batch in enumerate(batches):
            last = index == len(batches) - 1
            context = model.no_sync if (not last and accelerator.num_processes > 1) else contextlib.nullcontext
            with context():
                loss = model(**batch, use_cache=False, num_items_in_batch=items).loss
                loss = loss * accumulation * accelerator.num_processes
                accelerator.backward(loss)
                step_losses.append(loss.detach())
        norm = accelerator.clip_grad_norm_(model.parameters(), max_grad_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        norms.append(float(norm))
        losses.append(accelerator.gather(sum(step_losses)).sum().item() / (accelerator.num_processes * accumulation))
    # The example's evaluation, as written: it gathers the last *training* loss, repeated to the evaluation batch,
    # once per evaluation batch (45 rows in one round of 32 per process: the second process's batch half padding)
    model.eval()
    gathered = []
    for batch in evaluation:
        with torch.no_grad():
            model(**batch, use_cache=False)
        gathered.append(accelerator.gather_for_metrics(loss.repeat(EVAL_BATCH_SIZE)))
    perplexity = math.exp(torch.mean(torch.cat(gathered)))
    return {"norms": norms, "losses": losses, "perplexity": perplexity, "weights": weights(accelerator, model)}


SCRIPTS = {f.__name__: f for f in (cross_validation, cv_example, complete_cv_example, autoregressive)}


def run_more_topics(rank: int, library: str, topics: list[str], out_dir: str) -> dict[str, Any]:
    return run_topics(rank, library, topics, out_dir, SCRIPTS)
