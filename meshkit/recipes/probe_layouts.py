"""`meshkit plan CONFIG.yaml --probe`: the layouts `layout: auto` would try for this config's reference GPT,
each run for a few measured steps on this node's ranks; prints the table and the fastest layout's keys (for
`meshkit train CONFIG.yaml KEY=VALUE ...`). Nothing is trained.

Run by the launcher: `python -m meshkit.recipes.probe_layouts CONFIG.yaml [key=value ...]`.
"""

from __future__ import annotations

import sys

from meshkit.engine.engine import Engine
from meshkit.planning.layout_probe import choose, one_process_group, print_probe_table
from meshkit.recipes.train import probe_step, resolve_recipe


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        raise SystemExit("usage: python -m meshkit.recipes.probe_layouts CONFIG.yaml [key=value ...]")
    resolved = resolve_recipe(argv[0], argv[1:])
    with one_process_group(resolved.config) as info:
        chosen, probed = choose(resolved, probe_step, Engine)
        if info.rank == 0:
            print_probe_table(probed)
            best = min((c for c in probed if c.error is None and c.step_s), key=lambda c: c.step_s or 0.0)
            keys = " ".join(f"{k}={'null' if v is None else v}" for k, v in best.values.items())
            print(f"fastest: {best.description}; train in it with: meshkit train {argv[0]} {keys}", flush=True)


if __name__ == "__main__":
    main()
