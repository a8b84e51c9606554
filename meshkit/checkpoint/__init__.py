"""Checkpoints: the layout-free training state, atomic sharded saves and loads (DCP), and safetensors export."""
