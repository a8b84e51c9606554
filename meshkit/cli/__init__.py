"""The `meshkit` command: launch, train, finetune, config, env, estimate, plan, export, bench."""

from meshkit.cli.main import app, main

__all__ = ["app", "main"]
