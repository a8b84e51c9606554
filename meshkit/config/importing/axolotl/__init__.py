"""Axolotl configs as written: the table of every Axolotl key meshkit knows (`keys`), and the readers of the keys
that set several meshkit settings at once (`layout`: DeepSpeed and FSDP configs, the parallel sizes)."""
