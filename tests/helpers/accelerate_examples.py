"""Accelerate's example scripts (its `examples/` and `examples/by_feature/`), in their own shape, on a tiny BERT and
MRPC-like synthetic data, offline. Each script takes the library it imports from: `accelerate` or `meshkit` — the
only line that differs, as for a user porting a script. `run_topics` runs the chosen scripts in one process of a
world and returns their numbers, so the test compares the two libraries run for run.

The train loaders do not shuffle: the two libraries deal shuffled samples to ranks differently, and the numbers are
compared where both are deterministic (the global batch of each step is the same set of samples in both).
"""

from __future__ import annotations

import contextlib
import importlib
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch.utils.data import DataLoader

from tests.helpers.distributed import leave_world

VOCAB, TRAIN, EVAL = 64, 64, 30


def imports(library: str) -> SimpleNamespace:
    """The names a script imports, from `library` ("accelerate" or "meshkit")."""
    module = importlib.import_module(library)
    names = SimpleNamespace(
        **{
            name: getattr(module, name)
            for name in (
                "Accelerator",
                "DistributedType",
                "DataLoaderConfiguration",
                "DistributedDataParallelKwargs",
                "DDPCommunicationHookType",
                "ProfileKwargs",
                "find_executable_batch_size",
            )
        }
    )
    names.ProjectConfiguration = (
        getattr(module, "ProjectConfiguration", None)
        or importlib.import_module(f"{library}.utils").ProjectConfiguration
    )
    return names


def mrpc_like(count: int, seed: int) -> list[dict[str, Any]]:
    """Sentence pairs as token ids of varying length; the label is whether the pair shares its first token."""
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for index in range(count):
        length = int(torch.randint(6, 14, (1,), generator=generator))
        ids = torch.randint(3, VOCAB, (length,), generator=generator)
        same = index % 2
        if same:
            ids[length // 2] = ids[1]
        rows.append({"input_ids": [1, *ids.tolist(), 2], "labels": same})
    return rows


def collate(examples: list[dict[str, Any]]) -> Any:
    """`tokenizer.pad(..., padding="longest", return_tensors="pt")`: a BatchEncoding, as the examples get."""
    from transformers import BatchEncoding

    longest = max(len(e["input_ids"]) for e in examples)
    ids = torch.zeros(len(examples), longest, dtype=torch.long)
    mask = torch.zeros(len(examples), longest, dtype=torch.long)
    for row, example in enumerate(examples):
        ids[row, : len(example["input_ids"])] = torch.tensor(example["input_ids"])
        mask[row, : len(example["input_ids"])] = 1
    labels = torch.tensor([e["labels"] for e in examples])
    return BatchEncoding({"input_ids": ids, "attention_mask": mask, "labels": labels})


def bert() -> torch.nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(42)
    config = BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=32,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        classifier_dropout=0.0,
    )
    return BertForSequenceClassification(config)


def get_dataloaders(batch_size: int = 16) -> tuple[DataLoader, DataLoader]:
    train = DataLoader(mrpc_like(TRAIN, 0), shuffle=False, collate_fn=collate, batch_size=batch_size)
    evaluation = DataLoader(mrpc_like(EVAL, 1), shuffle=False, collate_fn=collate, batch_size=8)
    return train, evaluation


def evaluate(accelerator: Any, model: Any, eval_dataloader: Any) -> dict[str, float]:
    """The examples' evaluation loop: gather_for_metrics of predictions and references, accuracy over them."""
    model.eval()
    predictions, references = [], []
    for batch in eval_dataloader:
        batch.to(accelerator.device)
        with torch.no_grad():
            outputs = model(**batch)
        found, wanted = accelerator.gather_for_metrics((outputs.logits.argmax(dim=-1), batch["labels"]))
        predictions.append(found)
        references.append(wanted)
    found, wanted = torch.cat(predictions), torch.cat(references)
    accuracy = float((found == wanted).float().mean())
    return {"accuracy": accuracy, "count": len(found), "references": wanted.tolist()}


def weights(accelerator: Any, model: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in accelerator.unwrap_model(model).state_dict().items()}


def train_epochs(accelerator: Any, objects: tuple, epochs: int, accumulate: bool = False, lrs: list | None = None):
    model, optimizer, train_dataloader, lr_scheduler = objects
    for _ in range(epochs):
        model.train()
        for batch in train_dataloader:
            batch.to(accelerator.device)
            context = accelerator.accumulate(model) if accumulate else contextlib.nullcontext()
            with context:
                loss = model(**batch).loss
                accelerator.backward(loss)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
            if lrs is not None:
                lrs.append(lr_scheduler.get_last_lr()[0])


def setup(accelerator: Any, batch_size: int = 16, lr: float = 2e-3, warmup: int = 4) -> tuple:
    from transformers import get_linear_schedule_with_warmup

    train_dataloader, eval_dataloader = get_dataloaders(batch_size)
    model = bert().to(accelerator.device)
    optimizer = torch.optim.AdamW(params=model.parameters(), lr=lr)
    lr_scheduler = get_linear_schedule_with_warmup(optimizer, num_warmup_steps=warmup, num_training_steps=40)
    return accelerator.prepare(model, optimizer, train_dataloader, eval_dataloader, lr_scheduler)


# ---------------------------------------------------------------------------------------------- the scripts
def nlp_example(lib: SimpleNamespace, out: Path) -> dict[str, Any]:
    accelerator = lib.Accelerator(cpu=True, mixed_precision="no")
    assert accelerator.distributed_type in (lib.DistributedType.MULTI_CPU, lib.DistributedType.NO)
    assert accelerator.distributed_type != lib.DistributedType.XLA and accelerator.mixed_precision == "no"
    with accelerator.main_process_first():
        pass
    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = setup(accelerator)
    lrs: list[float] = []
    train_epochs(accelerator, (model, optimizer, train_dataloader, lr_scheduler), 2, lrs=lrs)
    accelerator.print("epoch 1:", evaluate(accelerator, model, eval_dataloader))
    return {"metric": evaluate(accelerator, model, eval_dataloader), "lrs": lrs, "weights": weights(accelerator, model)}


def gradient_accumulation(lib: SimpleNamespace, out: Path) -> dict[str, Any]:
    accelerator = lib.Accelerator(cpu=True, gradient_accumulation_steps=2)
    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = setup(accelerator, batch_size=8)
    lrs: list[float] = []
    train_epochs(accelerator, (model, optimizer, train_dataloader, lr_scheduler), 2, accumulate=True, lrs=lrs)
    return {"metric": evaluate(accelerator, model, eval_dataloader), "lrs": lrs, "weights": weights(accelerator, model)}


def checkpointing(lib: SimpleNamespace, out: Path) -> dict[str, Any]:
    """complete_nlp_example / checkpointing.py: save_state each epoch; a second run resumes from epoch_0 (its
    model built again from scratch) and must end where the uninterrupted run ends."""
    results = {}
    for resume in (False, True):
        accelerator = lib.Accelerator(cpu=True, dataloader_config=lib.DataLoaderConfiguration())
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = setup(accelerator)
        starting_epoch = 0
        if resume:
            accelerator.print(f"Resumed from checkpoint: {out / 'epoch_0'}")
            accelerator.load_state(str(out / "epoch_0"))
            starting_epoch = 1
        for epoch in range(starting_epoch, 3):
            train_epochs(accelerator, (model, optimizer, train_dataloader, lr_scheduler), 1)
            if not resume:
                accelerator.save_state(str(out / f"epoch_{epoch}"))
        results["resumed" if resume else "straight"] = weights(accelerator, model)
        results[f"metric_{resume}"] = evaluate(accelerator, model, eval_dataloader)
        _reset(lib)
    return results


def early_stopping(lib: SimpleNamespace, out: Path) -> dict[str, Any]:
    accelerator = lib.Accelerator(cpu=True)
    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = setup(accelerator)
    stopped_at = None
    for step, batch in enumerate(train_dataloader):
        loss = model(**batch).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        if accelerator.process_index == 1 and step == 1:  # one rank decides; every rank sees it
            accelerator.set_trigger()
        if accelerator.check_trigger():
            stopped_at = step
            break
    return {"stopped_at": stopped_at}


def local_sgd(lib: SimpleNamespace, out: Path) -> dict[str, Any]:
    from accelerate.local_sgd import LocalSGD  # Accelerate's own helper, driving either Accelerator

    accelerator = lib.Accelerator(cpu=True, gradient_accumulation_steps=1)
    # (one sample per batch: both libraries then give each rank the same samples, which local steps depend on)
    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = setup(accelerator, batch_size=1)
    for _ in range(2):
        model.train()
        with LocalSGD(accelerator=accelerator, model=model, local_sgd_steps=2, enabled=True) as local:
            for batch in train_dataloader:
                with accelerator.accumulate(model):
                    accelerator.backward(model(**batch).loss)
                    optimizer.step()
                    lr_scheduler.step()
                    optimizer.zero_grad()
                    local.step()
    return {"metric": evaluate(accelerator, model, eval_dataloader), "weights": weights(accelerator, model)}


def ddp_comm_hook(lib: SimpleNamespace, out: Path) -> dict[str, Any]:
    handler = lib.DistributedDataParallelKwargs(comm_hook=lib.DDPCommunicationHookType.FP16)
    accelerator = lib.Accelerator(cpu=True, kwargs_handlers=[handler])
    # (one sample per batch: each rank's gradient, rounded to fp16 by the hook, is the same in both libraries)
    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = setup(accelerator, batch_size=1)
    train_epochs(accelerator, (model, optimizer, train_dataloader, lr_scheduler), 1)
    return {"weights": weights(accelerator, model)}


def memory(lib: SimpleNamespace, out: Path) -> dict[str, Any]:
    """memory.py / automatic_gradient_accumulation.py: find_executable_batch_size halves on out-of-memory, the
    accumulation steps follow the batch size, free_memory between attempts."""
    accelerator = lib.Accelerator(cpu=True)
    tried: list[int] = []

    @lib.find_executable_batch_size(starting_batch_size=32)
    def inner_training_loop(batch_size: int) -> dict[str, Any]:
        nonlocal accelerator
        tried.append(batch_size)
        accelerator.gradient_accumulation_steps = 32 // batch_size
        accelerator.free_memory()
        if batch_size > 8:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = setup(accelerator, batch_size=batch_size)
        train_epochs(accelerator, (model, optimizer, train_dataloader, lr_scheduler), 1, accumulate=True)
        return {"weights": weights(accelerator, model), "accum": accelerator.gradient_accumulation_steps}

    return {**inner_training_loop(), "tried": tried}


def tracking(lib: SimpleNamespace, out: Path) -> dict[str, Any]:
    accelerator = lib.Accelerator(cpu=True, log_with="tensorboard", project_dir=str(out / "logs"))
    accelerator.init_trackers("tracking", {"lr": 2e-3, "num_epochs": 1})
    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = setup(accelerator)
    train_epochs(accelerator, (model, optimizer, train_dataloader, lr_scheduler), 1)
    accelerator.log({"accuracy": evaluate(accelerator, model, eval_dataloader)["accuracy"]}, step=0)
    accelerator.log({"train_loss": 0.5})  # no step: the tracker's own
    accelerator.wait_for_everyone()
    events = [p for p in (out / "logs").rglob("*") if "tfevents" in p.name]
    return {"events": bool(events), "trackers": len(accelerator.trackers)}


def saving(lib: SimpleNamespace, out: Path) -> dict[str, Any]:
    """The two ways Accelerate scripts save the trained model, and `save` itself."""
    accelerator = lib.Accelerator(cpu=True)
    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = setup(accelerator)
    train_epochs(accelerator, (model, optimizer, train_dataloader, lr_scheduler), 1)
    accelerator.wait_for_everyone()
    unwrapped = accelerator.unwrap_model(model)
    unwrapped.save_pretrained(
        str(out / "pretrained"),
        is_main_process=accelerator.is_main_process,
        save_function=accelerator.save,
        state_dict=accelerator.get_state_dict(model),
    )
    accelerator.save_model(model, str(out / "save_model"))
    accelerator.save({"step": torch.tensor(3)}, str(out / "extra.safetensors"), safe_serialization=True)
    accelerator.wait_for_everyone()
    return {"weights": weights(accelerator, model)}


def profiler(lib: SimpleNamespace, out: Path) -> dict[str, Any]:
    profile_kwargs = lib.ProfileKwargs(activities=["cpu"], record_shapes=True, output_trace_dir=str(out / "trace"))
    accelerator = lib.Accelerator(cpu=True, kwargs_handlers=[profile_kwargs])
    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = setup(accelerator)
    with accelerator.profile() as prof:
        batch = next(iter(train_dataloader))
        accelerator.backward(model(**batch).loss)
    names = {event.key for event in prof.key_averages()}
    return {"traced": sorted((out / "trace").glob("profile_*.json")) != [], "linear": "aten::linear" in names}


def schedule_free(lib: SimpleNamespace, out: Path) -> dict[str, Any]:
    """schedule_free.py calls optimizer.train() / optimizer.eval() on the prepared optimizer."""

    class ModalSGD(torch.optim.SGD):  # a schedule-free optimizer's interface: train() / eval() switch modes
        mode = "train"

        def train(self) -> None:
            self.mode = "train"

        def eval(self) -> None:
            self.mode = "eval"

    accelerator = lib.Accelerator(cpu=True)
    model = bert()
    optimizer = accelerator.prepare(ModalSGD(model.parameters(), lr=0.1))
    optimizer.eval()
    seen = [optimizer.mode if hasattr(optimizer, "mode") else optimizer.optimizer.mode]
    optimizer.train()
    return {"modes": [*seen, optimizer.optimizer.mode]}


SCRIPTS = {
    f.__name__: f
    for f in (
        nlp_example,
        gradient_accumulation,
        checkpointing,
        early_stopping,
        local_sgd,
        ddp_comm_hook,
        memory,
        tracking,
        saving,
        profiler,
        schedule_free,
    )
}


def _reset(lib: SimpleNamespace) -> None:
    """A new Accelerator in the same process: Accelerate keeps its state in singletons that must be reset."""
    if lib.Accelerator.__module__.startswith("accelerate"):
        from accelerate.state import AcceleratorState, GradientState

        AcceleratorState._reset_state(reset_partial_state=False)
        GradientState._reset_state()


def run_topics(
    rank: int, library: str, topics: list[str], out_dir: str, scripts: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Every topic's script (from `scripts`, these examples by default) in turn, in this rank of a world; the
    process group stays up between them."""
    scripts = SCRIPTS if scripts is None else scripts
    lib = imports(library)
    os.environ.setdefault("ACCELERATE_USE_CPU", "true")
    results = {}
    for topic in topics:
        out = Path(out_dir) / library / topic
        out.mkdir(parents=True, exist_ok=True)
        results[topic] = scripts[topic](lib, out)
        _reset(lib)
    leave_world()
    return results
