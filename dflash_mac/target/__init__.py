"""How the engine reaches into an mlx-lm target: where its parts are (structure.py), per-instance
hooks on its layers (hooks.py), capturing their outputs for the drafter (capture.py), and
rolling its caches back after a partial acceptance (rollback.py: KV trims, the rotating window of
kvwindow.py, the GatedDeltaNet replay of hybrid.py). Imports nothing of ours above `models`."""
