"""The multi-node suite's training job: a small regression model trained with DDP over a fixed list of global
batches (each rank takes its slice), checkpointed and resumable by step, so a run at any world size over any
number of restarts should end at the one-process run's weights.

Usage: `job.py OUT_DIR` (under `meshkit launch`, or plain python for the one-process reference). Global rank 0
appends one JSON line per step to OUT_DIR/steps.jsonl and writes OUT_DIR/weights.safetensors at the end.
`JOB_KILL=node:rank_on_node:step` SIGKILLs that worker at that step of the first attempt (a crashed worker).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from meshkit import Engine

STEPS, GLOBAL_BATCH, FEATURES = 8, 8, 16


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(7)
    inputs = torch.randn(STEPS, GLOBAL_BATCH, FEATURES, generator=generator)
    return [(x, x.sum(dim=1, keepdim=True).sin()) for x in inputs]


def main(out: Path) -> None:
    engine = Engine(seed=0)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(FEATURES, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, optimizer = engine.prepare(model, optimizer, loss_fn=torch.nn.functional.mse_loss)
    engine.resume()
    world, rank = engine.num_processes, engine.process_index
    local = GLOBAL_BATCH // world
    kill = os.environ.get("JOB_KILL")
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    for step, (x, y) in enumerate(batches()):
        if step < engine.step:
            continue
        if kill and attempt == 0 and kill == f"{os.environ.get('GROUP_RANK')}:{engine.info.local_rank}:{step}":
            os.kill(os.getpid(), signal.SIGKILL)
        loss = engine.train_step((x[rank * local : (rank + 1) * local], y[rank * local : (rank + 1) * local]))
        loss = engine.reduce(loss).item()
        if engine.is_main_process:
            with (out / "steps.jsonl").open("a") as log:
                log.write(json.dumps({"step": step, "loss": loss, "world": world, "attempt": attempt}) + "\n")
        engine.save_checkpoint()
        time.sleep(float(os.environ.get("JOB_STEP_SLEEP", "0")))  # room for a test to act mid-run
    state = {name: tensor.detach().clone().contiguous() for name, tensor in engine.full_state_dict().items()}
    if engine.is_main_process:
        save_file(state, str(out / "weights.safetensors"))
    engine.end()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
