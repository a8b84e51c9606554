"""Sharded optimizer states: ZeRO-1/2 (`optimizer`, `buckets`), the stage a run really gets (`sharding`), NVMe
offload and optimizers that step plain local shards. ZeRO-3 is FSDP (`parallel/fsdp.py`)."""

# ZeRO-2 reduction buckets alive at once during backward (one filling, one reducing). The estimator counts the same
# number (`planning/estimate.py`), so it is defined here, where the buckets are, without importing torch.
BUCKETS_IN_FLIGHT = 2
