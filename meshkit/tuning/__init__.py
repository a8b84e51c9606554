"""What a fine-tune applies to a model beyond plain steps, usable from any Engine script: LoRA (its targets,
initialisations and continued adapters), ReLoRA's restarts, LISA's layer sampling, quantization-aware training,
Liger's kernels and the fix of untrained token rows."""
