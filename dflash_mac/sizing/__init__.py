"""How wide each cycle's block is. The policy (choice.py: a request's fixed size or `auto`'s
cap), `auto`'s online controller (controller.py) from what cycles cost (cost.py) and commit
(acceptance.py), what it keeps between requests (tuning.py), one block size for a batch
(batch_rule.py), the interfaces the loops ask of them (sizer.py), and their files in the data
directory (files.py). Decisions from numbers: no module here imports MLX itself (choice.py
and files.py take the `Pair` they are handed) and none reaches the engine, which consults it
(tests/test_layout.py); the calibration that times the cost curve runs the engine and lives
above both (dflash_mac/calibrate.py)."""
