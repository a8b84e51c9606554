"""Import-time warnings of optional libraries that say nothing about the run, dropped by message.

torchao (imported by peft and transformers whenever it is installed) logs one warning per CUDA kernel library it
cannot load on this host, and registering its enums makes torch log a deprecation warning for each — on every rank,
before a single step, on hosts where those kernels are of no use; bitsandbytes (imported by peft) warns when a
hub-hosted CPU kernel cannot be fetched. Only those messages are dropped: anything else
the two loggers say still reaches the user.
"""

from __future__ import annotations

import logging

_NOISE = {
    "torchao": ("Failed to load ",),
    "torch.utils._pytree": ("is an Enum subclass and is now natively supported by torch.compile",),
    # bitsandbytes offers a CPU kernel fetched from the Hugging Face hub at import; its own kernels run without it
    "bitsandbytes.backends.cpu.ops": ("from kernels-community",),
}


class _DropMessages(logging.Filter):
    def __init__(self, fragments: tuple[str, ...]) -> None:
        super().__init__()
        self.fragments = fragments

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(fragment in message for fragment in self.fragments)


def drop_import_noise() -> None:
    """Install the filters (once per logger)."""
    for name, fragments in _NOISE.items():
        logger = logging.getLogger(name)
        if not any(isinstance(existing, _DropMessages) for existing in logger.filters):
            logger.addFilter(_DropMessages(fragments))
