"""The first forward of each attention whose heads tensor parallel split, checked: code that still works with
the whole width (TrOCR reshapes its output to the width of its input) fails there with a shape error deep inside
the model; it stops instead in one line that names the attention and what to do. After one call that runs, the
module's own forward is back in place (no cost afterwards)."""

from __future__ import annotations

from typing import Any

from torch import nn

from meshkit.parallel.tensor.auto import TensorParallelError


class _FirstCall:
    def __init__(self, module: nn.Module, path: str, ranks: int) -> None:
        self.module, self.path, self.ranks = module, path, ranks
        self.forward = module.forward

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            output = self.forward(*args, **kwargs)
        except RuntimeError as error:
            line = str(error).strip().splitlines()[0][:160] if str(error).strip() else type(error).__name__
            raise TensorParallelError(
                f"tensor parallel: {self.path} ({type(self.module).__name__}) does not run on its rank's "
                f"1/{self.ranks} of the heads ({line}): use tp=1, or a tensor_parallel.plan that keeps it replicated"
            ) from error
        self.module.__dict__.pop("forward", None)  # (the class's forward from now on)
        return output


def check_first_call(module: nn.Module, path: str, ranks: int) -> None:
    """Turn a failure of `module`'s first forward (a split attention) into a one-line TensorParallelError."""
    module.forward = _FirstCall(module, path, ranks)
