"""The arithmetic of a training step that every layout shares: the loss, gradient accumulation, mixed precision."""
