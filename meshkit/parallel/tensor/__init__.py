"""Tensor and sequence parallel: Megatron splits of the reference GPT (`apply`), plans for any model (`auto`),
LoRA layers under a split (`lora`) and sequence parallel for block-structured models (`sequence`)."""
