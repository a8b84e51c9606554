"""Worker bootstrap (`python -m meshkit.worker [-m] PROGRAM ARGS...`), started by `meshkit launch`.

Runs the user's script or module as `__main__`. An exception is written, with its traceback, to the error
file the elastic agent hands each worker, so the launcher can say which rank failed and why.
"""

from __future__ import annotations

import os
import runpy
import sys

from torch.distributed.elastic.multiprocessing.errors import record


def main(argv: list[str]) -> None:
    if not argv or argv == ["-m"]:
        raise SystemExit("usage: python -m meshkit.worker [-m] PROGRAM [ARGS...]")
    if argv[0] == "-m":
        module, args = argv[1], argv[2:]
        sys.argv = [module, *args]
        record(lambda: runpy.run_module(module, run_name="__main__", alter_sys=True))()
    else:
        script, args = argv[0], argv[1:]
        sys.argv = [script, *args]
        sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
        record(lambda: runpy.run_path(script, run_name="__main__"))()


if __name__ == "__main__":
    main(sys.argv[1:])
