"""Where pairs come from and how they load: the pair registry (registry.py), model sources (the
package's folder, local folders, the Hub, pinned PyPI wheels: sources.py), GGUF targets
(gguf.py), loading and checking a target + drafter pair (loader.py), and random-weight pairs of
the right shapes (random_pair.py). Reaches nothing of the decode loop (tests/test_layout.py);
registry.py and sources.py import no MLX, so `dflash-mac models` starts at once."""
