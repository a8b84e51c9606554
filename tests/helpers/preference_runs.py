"""Preference-training test material: a tiny Llama base with a tokenizer trained on the pairs, pair and KTO records,
and the runs of TRL's trainers and of meshkit's objectives on the same batches.

Batches are aligned by giving each step the whole dataset (4 pairs, micro-batch 4): whatever order a sampler
draws, every step sees the same examples, and the losses and metrics are means over them."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch

WORDS = ["apple", "river", "stone", "cloud", "garden", "silver", "window", "forest"]
METRICS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen")
LR, STEPS, MAX_GRAD_NORM = 0.05, 3, 1.0


def pair_records(count: int = 4) -> list[dict[str, str]]:
    """Prompts end on a token boundary (":") and replies start with a space, so every trainer's tokenizing agrees."""
    return [{"prompt": f"Shout {w}:", "chosen": f" {w.upper()}", "rejected": f" {w}"} for w in WORDS[:count]]


def kto_records(count: int = 4) -> list[dict[str, Any]]:
    pairs = pair_records(count)
    return [
        {"prompt": p["prompt"], "completion": p["chosen"] if i % 2 == 0 else p["rejected"], "label": i % 2 == 0}
        for i, p in enumerate(pairs)
    ]


def make_preference_base(root: Path, adds_bos: bool = True) -> Path:
    """The tiny base; `adds_bos=False`: its tokenizer defines BOS without adding it (as GPT-2's does)."""
    from meshkit.recipes.tiny_model import make_tiny_base_model

    texts = [p["prompt"] + p["chosen"] + p["rejected"] for p in pair_records(len(WORDS))] * 5
    base = make_tiny_base_model(root / "base", texts, vocab_size=300, hidden_size=32, layers=2, heads=4, kv_heads=2)
    if adds_bos:
        return base
    from tokenizers import processors
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(base)
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(single="$A", pair="$A $B")
    assert tokenizer("Shout")["input_ids"][0] != tokenizer.bos_token_id and tokenizer.bos_token_id is not None
    tokenizer.save_pretrained(base)
    return base


def _trl_trainer(method: str, base: Path, out: Path, records: list[dict[str, Any]], **options: Any) -> Any:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, attn_implementation="eager")
    common = {
        "output_dir": str(out), "per_device_train_batch_size": len(records), "max_steps": STEPS, "learning_rate": LR,
        "lr_scheduler_type": "constant", "optim": "sgd", "logging_steps": 1, "report_to": [], "use_cpu": True,
        "bf16": False, "seed": 0, "save_strategy": "no", "max_length": 64, "max_grad_norm": MAX_GRAD_NORM,
    }  # fmt: skip
    if method == "dpo":
        from trl import DPOConfig, DPOTrainer

        args, trainer = DPOConfig(**common, **options), DPOTrainer
    elif method == "kto":
        from trl import KTOConfig, KTOTrainer

        args, trainer = KTOConfig(**common, **options), KTOTrainer
    elif method == "orpo":
        from trl.experimental.orpo import ORPOConfig, ORPOTrainer

        args, trainer = ORPOConfig(**common, **options), ORPOTrainer
    else:
        from trl.experimental.cpo import CPOConfig, CPOTrainer

        args, trainer = CPOConfig(**common, **options), CPOTrainer
    return trainer(model=model, args=args, train_dataset=Dataset.from_list(records), processing_class=tokenizer)


def trl_metrics(method: str, base: Path, out: Path, records: list[dict[str, Any]], **options: Any) -> list[dict]:
    """TRL's logged metrics of each step."""
    trainer = _trl_trainer(method, base, out, records, **options)
    trainer.train()
    return [entry for entry in trainer.state.log_history if "loss" in entry and "train_runtime" not in entry]


def meshkit_metrics(base: Path, records: list[dict[str, Any]], loss: Any, reference: str = "copy") -> list[dict]:
    """meshkit's metrics of each step: the objective over the same records (one process, SGD, the same lr)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from meshkit.data.preference_formats import PairText, UnpairedText
    from meshkit.data.preference_tokens import PreferenceCollate, PreferenceTokenizer, with_kl_completions
    from meshkit.engine.engine import Engine
    from meshkit.recipes.preference import PairedObjective, PreferenceWindow, Reference, UnpairedObjective

    tokenizer = AutoTokenizer.from_pretrained(base)
    tokens = PreferenceTokenizer(tokenizer, bos_first=type(loss).__name__ in ("ORPO", "CPO"))  # (as TRL's trainers)
    paired = loss.paired
    rows = [
        tokens.pair(PairText(**r))
        if paired
        else tokens.unpaired(UnpairedText(r["prompt"], r["completion"], r["label"]))
        for r in records
    ]  # noqa: E501
    if not paired:
        from datasets import Dataset

        rows = list(with_kl_completions(Dataset.from_list(rows), len(rows)))
    batch = PreferenceCollate(tokenizer.pad_token_id, 64, paired=paired)(rows)
    steps = []
    with Engine(seed=0, max_grad_norm=MAX_GRAD_NORM) as engine:
        policy = AutoModelForCausalLM.from_pretrained(base, attn_implementation="eager")
        frozen = copy.deepcopy(policy).eval().requires_grad_(False)
        optimizer = torch.optim.SGD(policy.parameters(), lr=LR)
        policy, optimizer = engine.prepare(policy, optimizer)
        ref = Reference(model=frozen) if reference == "copy" else None
        objective = PairedObjective(loss, ref) if paired else UnpairedObjective(loss, ref, engine)
        window = PreferenceWindow(engine, objective)
        for _ in range(STEPS):
            window.step(batch)
            steps.append({"loss": window.mean(), **window.metrics()})
    return steps


def write_preference_data(root: Path, count: int = 16) -> dict[str, Path]:
    """Pairs as Axolotl's chat_template.default reads them (a conversation, a chosen and a rejected reply), and
    KTO records as chatml.prompt_pairs reads them; the chosen reply shouts the word back."""
    import json

    pairs, kto = [], []
    for index in range(count):
        word = WORDS[index % len(WORDS)]
        pairs.append({
            "conversation": [{"role": "user", "content": f"Shout {word}"}],
            "chosen": {"role": "assistant", "content": word.upper()},
            "rejected": {"role": "assistant", "content": word},
        })  # fmt: skip
        kto.append(
            {"prompt": f"Shout {word}", "completion": word.upper() if index % 2 else word, "label": bool(index % 2)}
        )
    out = {"pairs": root / "pairs.jsonl", "kto": root / "kto.jsonl"}
    out["pairs"].write_text("".join(json.dumps(r) + "\n" for r in pairs))
    out["kto"].write_text("".join(json.dumps(r) + "\n" for r in kto))
    return out


def dpo_keys(data: dict[str, Path], method: str = "dpo", **extra: Any) -> dict[str, Any]:
    """Recipe keys of a preference run on the tiny base (`write_config` adds the base and the step count)."""
    if method == "kto":
        datasets = [{"path": str(data["kto"]), "type": "chatml.prompt_pairs"}]
    else:
        datasets = [{"path": str(data["pairs"]), "type": "chat_template.default", "field_messages": "conversation"}]
    return {
        "rl": method,
        "chat_template": "chatml",
        "datasets": datasets,
        "rl_beta": 0.5,
        "learning_rate": 0.01,
        **extra,
    }


def bradley_terry_records(count: int = 4) -> list[dict[str, str]]:
    return [{"input": f"Shout {w}", "chosen": w.upper(), "rejected": w} for w in WORDS[:count]]


def make_reward_base(root: Path) -> Path:
    """The tiny base as a sequence-classification model with one label (its score head seeded), saved whole."""
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    base = make_preference_base(root)
    config = AutoConfig.from_pretrained(base)
    config.num_labels = 1
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(base, config=config)
    out = root / "reward-base"
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(base).save_pretrained(out)
    return out


def trl_reward_metrics(base: Path, out: Path, records: list[dict[str, str]], lora: dict | None = None) -> list[dict]:
    """TRL's RewardTrainer on the same pairs as conversations (its chat template renders them). `lora`: peft's
    LoraConfig arguments of a SEQ_CLS adapter, started as meshkit starts one (seeded by the run seed, 0, and each
    layer's name), handed to TRL as the model."""
    from datasets import Dataset
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    from trl import RewardConfig, RewardTrainer

    tokenizer = AutoTokenizer.from_pretrained(base)
    model = AutoModelForSequenceClassification.from_pretrained(base, num_labels=1, attn_implementation="eager")
    model.config.pad_token_id = tokenizer.pad_token_id
    if lora is not None:
        from peft import LoraConfig, get_peft_model

        from meshkit.parallel.materialize import reset_adapters

        model = get_peft_model(model, LoraConfig(task_type="SEQ_CLS", **lora))
        torch.manual_seed(0)
        reset_adapters(model.get_base_model())
    conversations = [
        {
            "chosen": [{"role": "user", "content": r["input"]}, {"role": "assistant", "content": r["chosen"]}],
            "rejected": [{"role": "user", "content": r["input"]}, {"role": "assistant", "content": r["rejected"]}],
        }
        for r in records
    ]
    args = RewardConfig(
        output_dir=str(out), per_device_train_batch_size=len(records), max_steps=STEPS, learning_rate=LR,
        lr_scheduler_type="constant", optim="sgd", logging_steps=1, report_to=[], use_cpu=True, bf16=False, seed=0,
        save_strategy="no", max_length=64, max_grad_norm=MAX_GRAD_NORM,
    )  # fmt: skip
    trainer = RewardTrainer(
        model=model, args=args, train_dataset=Dataset.from_list(conversations), processing_class=tokenizer
    )  # noqa: E501
    trainer.train()
    return [entry for entry in trainer.state.log_history if "loss" in entry and "train_runtime" not in entry]
