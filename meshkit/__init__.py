"""meshkit: train PyTorch models on many processes, devices and machines with any parallelism."""

from meshkit.config import RunConfig
from meshkit.engine import Engine
from meshkit.seed import set_seed

__all__ = ["Engine", "RunConfig", "set_seed"]
__version__ = "0.1.0"
