"""Answers before a run: memory estimates, the strategy planner and its performance model, hardware facts, probes
of real steps, published runs to check the model against, and the communication benchmark. Nothing that runs a
training step imports this package; the engine's `layout: auto` and the CLI do."""
