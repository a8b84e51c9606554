"""The running world: the device mesh and its ranks, collectives, the hang doctor, preemption, host memory and
trackers. Strategies and the engine ask it rank questions; it knows nothing of models or strategies."""
