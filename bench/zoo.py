"""Every decoder-only causal LM of the installed transformers, in every layout, against one process.

For each model type of `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES` (encoders with a causal head and encoder-decoders left
out) a tiny random model is built from its default config by the generic shrinker (`bench/tiny_models.py`; a type
whose tiny config or model cannot be built is listed with why) and trained 4 steps in DDP, ZeRO-3, tp 2, tp 2 + SP,
cp 2 and pp 2 (and ep 2 for mixture-of-experts types), each in a world of 2 gloo ranks, against the same 4 steps
of the plain loop in one process (`model(**batch).loss`, backward, SGD step). A cell is ✓ when losses and weights
agree within 1e-5 (relative), a mismatch otherwise, a refusal when meshkit stops in one line (its reason kept), a
crash for any other error, and a hang when the world does not finish.

    python bench/zoo.py [--only REGEX] [--layouts tp2,pp2] [--out bench/results/zoo.json] [--timeout 300]

Results merge into the JSON cell by cell (a later run of some types or layouts keeps the others); `--render`
writes the table into docs/any-model.md from the JSON alone.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))
STEPS, GLOBAL_BATCH, SEQ, VOCAB, TOLERANCE, NORM_FLOOR = 4, 4, 16, 64, 1e-5, 5e-2
ROUNDING, NOISE_MARGIN, NOISE_RUNS = 1e-7, 10.0, 4  # a gradient change the size of fp32 rounding; how far above
LAYOUTS: dict[str, dict[str, Any]] = {
    "ddp2": {},
    "zero3_2": {"zero_stage": 3},
    "tp2": {"tp": 2},
    "tp2_sp": {"tp": 2, "sequence_parallel": True},
    "cp2": {"cp": 2},
    "pp2": {"pp": 2, "schedule": "1f1b"},
    "ep2": {"ep": 2},  # mixture-of-experts types only
}


def decoder_types() -> list[str]:
    """Causal-LM model types that are decoders only (no encoder-decoder, no masked-LM encoder with a causal head)."""
    from transformers import CONFIG_MAPPING
    from transformers.models.auto import modeling_auto

    encoders = set(modeling_auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES)
    out = []
    for kind in sorted(modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        try:
            pair = getattr(CONFIG_MAPPING[kind](), "is_encoder_decoder", False)
        except Exception:  # noqa: BLE001 - a default config that does not build: the sweep says why, later
            pair = False
        if kind not in encoders and not pair:
            out.append(kind)
    return out


def build(model_type: str) -> Any:
    """The tiny random model of `model_type` (seeded: every process builds the same weights)."""
    import torch
    from tiny_models import tiny_config
    from transformers import AutoModelForCausalLM

    config = tiny_config(model_type, VOCAB)
    if getattr(config, "is_encoder_decoder", False):
        raise TypeError("an encoder-decoder config")
    for part in {id(config): config, id(config.get_text_config()): config.get_text_config()}.values():
        for name, value in (("pad_token_id", 0), ("bos_token_id", 1), ("eos_token_id", 2)):
            if hasattr(part, name):
                setattr(part, name, value)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def batches() -> list[dict[str, Any]]:
    import torch

    generator = torch.Generator().manual_seed(123)
    out = []
    for _ in range(STEPS):
        start = torch.randint(3, 40, (GLOBAL_BATCH, 1), generator=generator)
        stride = torch.randint(1, 3, (GLOBAL_BATCH, 1), generator=generator)
        ids = (start + stride * torch.arange(SEQ)) % (VOCAB - 4) + 3
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


def optimizer_of(model: Any) -> Any:
    import torch

    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


Expected = tuple[list[float], dict[str, Any], float]  # (losses, weights, this type's tolerance)


def reference(model_type: str) -> Expected:
    """The plain loop in one process, and the tolerance a layout gets on this type: 1e-5, or ten times the most
    that a rounding-sized change of every linear layer's output and every gradient does to the same loop (over a
    few draws) where the model amplifies it — a ReLU unit that flips, a chaotic tiny model: a cell must be as
    close as the model's own conditioning lets any other summation order be; a real error is far above."""
    losses, state = _plain_loop(model_type, noise_seed=None)
    noise = 0.0
    for seed in range(NOISE_RUNS):
        noisy_losses, noisy_state = _plain_loop(model_type, noise_seed=seed)
        noise = max(noise, _loss_error(noisy_losses, losses), _weight_errors(noisy_state, state)[1])
    return losses, state, max(TOLERANCE, NOISE_MARGIN * noise)


def _plain_loop(model_type: str, noise_seed: int | None) -> tuple[list[float], dict[str, Any]]:
    """model(**batch).loss, backward, step; with `noise_seed`, each linear layer's output and each gradient times
    (1 + 1e-7 · noise): what summing in another order does to a forward (a row split's partial sums, ring
    attention's blocks) and to the gradients' reduction."""
    import torch

    model = build(model_type)
    optimizer = optimizer_of(model)
    perturbed, generator = noise_seed is not None, torch.Generator().manual_seed(noise_seed or 0)

    def rounding(module: Any, args: Any, output: Any) -> Any:
        if not isinstance(output, torch.Tensor) or not output.is_floating_point():
            return None
        noise = torch.randn(output.shape, generator=generator, dtype=output.dtype)
        return output * (1 + ROUNDING * noise)

    for module in model.modules() if perturbed else ():
        if isinstance(module, torch.nn.Linear):
            module.register_forward_hook(rounding)
    losses = []
    for batch in batches():
        loss = model(**batch, use_cache=False).loss
        loss.backward()
        for param in model.parameters() if perturbed else ():
            if param.grad is not None:
                noise = torch.randn(param.grad.shape, generator=generator, dtype=param.grad.dtype)
                param.grad.mul_(1 + ROUNDING * noise)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, {name: value.detach().clone() for name, value in model.state_dict().items()}


def _last_line(error: BaseException) -> str:
    return f"{type(error).__name__}: {str(error).strip().splitlines()[-1] if str(error).strip() else ''}"[:300]


def _loss_error(losses: list[float], want: list[float]) -> float:
    return max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, want, strict=True))


def _weight_errors(state: dict[str, Any], want: dict[str, Any]) -> tuple[str, float]:
    """(the parameter farthest from `want`, its relative error) — with a floor under the norm: a key bias, whose
    gradient is zero up to rounding, stays near 0."""
    errors = {
        name: ((state[name].float() - value.float()).norm() / value.float().norm().clamp_min(NORM_FLOOR)).item()
        for name, value in want.items()
        if name in state and value.is_floating_point()
    }
    worst = max(errors, key=errors.__getitem__)
    return worst, errors[worst]


def run_cell(model_type: str, layout: str, expected: Expected | None) -> dict[str, Any]:
    """One layout on this rank: its result (rank 0 compares with `expected`)."""
    from meshkit import Engine
    from meshkit.core.errors import MeshkitError
    from meshkit.models.structure import describe

    settings = dict(LAYOUTS[layout])
    model = build(model_type)
    if describe(model).moe:
        settings["router_aux_loss"] = "global_batch"  # (the balancing loss over the whole batch, as one process)
    engine = Engine(seed=0, **settings)
    try:
        try:
            model, _ = engine.prepare(model, optimizer_of(model))
            local = GLOBAL_BATCH // engine.dp_size
            losses = []
            for batch in batches():
                part = {k: v[engine.dp_rank * local : (engine.dp_rank + 1) * local] for k, v in batch.items()}
                losses.append(engine.train_step(part).item())
            state = engine.full_state_dict()
            applied = applied_words(engine)
        except MeshkitError as error:
            return {"status": "refused", "reason": str(error).strip().splitlines()[0][:300]}
    finally:
        engine.end()
    if expected is None:
        return {"status": "done", "applied": applied}
    want_losses, want_state, tolerance = expected
    loss_error = _loss_error(losses, want_losses)
    missing = sorted(set(want_state) ^ set(state))
    worst, weight_error = _weight_errors(state, want_state)
    ok = not missing and loss_error <= tolerance and weight_error <= tolerance
    result = {"status": "ok" if ok else "mismatch", "loss_error": loss_error, "weight_error": weight_error,
              "worst": worst, "tolerance": tolerance, "applied": applied}  # fmt: skip
    if missing:
        result["reason"] = f"state dict keys differ: {missing[:3]}"
    if ok and "NOT the" in applied:  # (the numbers match, but the layout asked for is not what ran)
        result["status"], result["reason"] = "not applied", applied
    return result


def applied_words(engine: Any) -> str:
    """What the run's own record says was applied: tp's split (each rank's share of the split layers, and their
    share of the model), the sequence a block saw (SP, cp), and each rank's share of the parameters."""
    from meshkit.engine.what_ran import what_ran

    ran = what_ran(engine)
    held = ran["parameters"][0]
    words = [f"rank holds {held['share']:.0%} of the parameters"]
    if "tp_split" in held:
        split, model = held["tp_held"] / held["tp_split"], held["tp_split"] / held["whole"]
        words.append(f"tp: {split:.0%} of the split layers ({model:.0%} of the model)")
    if "sequence" in ran:
        words.append(ran["sequence"])
    return "; ".join(words)


def worker(model_type: str, layouts: list[str], rank: int, port: int, out: Path) -> int:
    """One rank of a 2-rank world: each layout in turn, a JSON line per cell (rank 0: compared)."""
    import torch
    import torch.distributed as dist

    from meshkit.runtime.mesh import stop_process_group

    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))  # fmt: skip
    torch.set_num_threads(1)
    expected = reference(model_type) if rank == 0 else None
    dist.init_process_group("gloo")
    for layout in layouts:
        try:
            result = run_cell(model_type, layout, expected)
        except Exception as error:  # noqa: BLE001 - a crash is a result; the world may be broken after it
            result = {"status": "crash", "reason": _last_line(error), "trace": traceback.format_exc()[-2000:]}
            _append(out, rank, layout, result)
            return 1
        _append(out, rank, layout, result)
    stop_process_group(wait_for_peers=True)  # (together: a rank that left early breaks a peer still setting up)
    return 0


def _append(out: Path, rank: int, layout: str, result: dict[str, Any]) -> None:
    with (out / f"rank{rank}.jsonl").open("a") as handle:
        handle.write(json.dumps({"layout": layout, **result}) + "\n")


def _read(folder: Path, rank: int) -> dict[str, dict[str, Any]]:
    path = folder / f"rank{rank}.jsonl"
    if not path.exists():
        return {}
    return {(entry := json.loads(line))["layout"]: entry for line in path.read_text().splitlines() if line}


# Imported once by the fork server the ranks start from, not by every rank (~7 s a rank): 300 types, 2 ranks each
PRELOADED = ["torch", "torch.distributed", "meshkit.engine", "transformers", "transformers.models.auto.modeling_auto"]


def _rank(model_type: str, layouts: list[str], rank: int, port: int, scratch: Path, log: Path) -> None:
    """A rank forked from the server: its stderr into `log`, stdout dropped, then `worker`."""
    import warnings

    with log.open("w") as err, open(os.devnull, "w") as out:
        os.dup2(err.fileno(), 2)
        os.dup2(out.fileno(), 1)
    os.environ["OMP_NUM_THREADS"] = "1"
    warnings.simplefilter("ignore")
    sys.exit(worker(model_type, layouts, rank, port, scratch))


def _world(model_type: str, layouts: list[str], timeout: float) -> tuple[list[dict[str, Any]], bool, str]:
    """One 2-rank world over `layouts`: each rank's cell results, whether it hung, rank 0's last error line."""
    import multiprocessing

    from meshkit.launching.interfaces import quiet_port

    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOADED)  # (where the server already runs, as it was started)
    with tempfile.TemporaryDirectory() as scratch:
        port, logs = quiet_port(), [Path(scratch) / f"stderr{rank}" for rank in range(2)]
        procs = [context.Process(target=_rank, args=(model_type, layouts, rank, port, Path(scratch), logs[rank]))
                 for rank in range(2)]  # fmt: skip
        for proc in procs:
            proc.start()
        hung, done, last_progress = False, -1, time.monotonic()
        while any(proc.is_alive() for proc in procs):  # (a hang: no cell finished within `timeout` seconds)
            finished = sum(len(_read(Path(scratch), rank)) for rank in range(2))
            if finished != done:
                done, last_progress = finished, time.monotonic()
            if time.monotonic() - last_progress > timeout:
                hung = True
                for proc in procs:
                    proc.kill()
                break
            time.sleep(0.5)
        for proc in procs:
            proc.join(10)
        lines = [line for line in logs[0].read_text().splitlines() if line.strip()] if logs[0].exists() else []
        return [_read(Path(scratch), rank) for rank in range(2)], hung, lines[-1][:300] if lines else ""


def run_type(model_type: str, layouts: list[str], timeout: float) -> dict[str, dict[str, Any]]:
    """Every layout of one type: one world for all of them; after a crash or hang, a new world for the rest."""
    results: dict[str, dict[str, Any]] = {}
    remaining = list(layouts)
    while remaining:
        ranks, hung, last_error = _world(model_type, remaining, timeout)
        for layout in list(remaining):
            remaining.remove(layout)
            crash = next((r[layout] for r in ranks if r.get(layout, {}).get("status") == "crash"), None)
            if crash is None and layout not in ranks[0]:  # the world ended or hung inside this cell
                results[layout] = {"status": "hang" if hung else "crash", "reason": last_error or "no result"}
                break
            results[layout] = crash or ranks[0][layout]
            if crash is not None:
                break
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default=None, help="regular expression over model types")
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument("--start", default="", help="only model types from this one on (alphabetically)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "zoo.json")
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds per cell before a world counts as hung")
    parser.add_argument("--render", action="store_true", help="write docs/any-model.md's zoo table from --out")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--scratch", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args.worker, args.layouts.split(","), args.rank, args.port, args.scratch)
    import zoo_table

    data = json.loads(args.out.read_text()) if args.out.exists() else {"types": {}}
    if args.render:
        zoo_table.write_docs(data, ROOT / "docs" / "any-model.md")
        return 0
    import transformers

    data["transformers"] = transformers.__version__
    asked = args.layouts.split(",")
    for model_type in decoder_types():
        if (args.only and not re.search(args.only, model_type)) or model_type < args.start:
            continue
        entry = data["types"].setdefault(model_type, {"cells": {}})
        try:
            moe = _is_moe(model_type)
        except Exception as error:  # noqa: BLE001 - a type whose tiny model cannot be built is a result
            data["types"][model_type] = {"builds": False, "reason": _last_line(error), "cells": {}}
            print(f"{model_type:28} no tiny model: {_last_line(error)}", flush=True)
            _save(args.out, data)
            continue
        entry.update(builds=True, moe=moe)
        layouts = [name for name in asked if name != "ep2" or moe]
        started = time.monotonic()
        entry["cells"].update(run_type(model_type, layouts, args.timeout))
        shown = " ".join(f"{name}:{entry['cells'][name]['status']}" for name in layouts)
        print(f"{model_type:28} {shown}  ({time.monotonic() - started:.0f}s)", flush=True)
        _save(args.out, data)
    print(zoo_table.summary(data))
    return 0


def _is_moe(model_type: str) -> bool:
    """Whether the tiny model has mixture-of-experts blocks; raises when it does not build or does not run one
    forward with a loss in one process (then no layout is tried: it is listed with why)."""
    from meshkit.models.structure import describe

    model = build(model_type)
    try:
        model(**batches()[0], use_cache=False).loss.backward()
    except Exception as error:
        raise RuntimeError(f"the tiny model does not train in one process: {_last_line(error)}") from error
    return bool(describe(model).moe)


def _save(out: Path, data: dict[str, Any]) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    temporary = out.with_suffix(".tmp")
    temporary.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    temporary.replace(out)


if __name__ == "__main__":
    raise SystemExit(main())
