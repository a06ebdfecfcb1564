"""The prompt cache: every request reuses the longest prefix an earlier one cached (cache.py), in
a radix tree of token spans (tree.py) holding the caches' rows (rows.py), with a disk tier that
survives restarts (disk.py) whose files `dflash-mac cache` reads without MLX (files.py)."""
