"""Build pipeline of the bundled default pair (tiny qwen3 target + DFlash drafter).

``python -m dflash_mac.bundle.build --help``; see ``models/bundled/MODEL_CARD.md``.
"""
