"""The DFlash decode loop (decode.py) and how one cycle runs (cycle.py: draft, verify, accept,
roll back), lossless verification (verify.py), structured output (constraints.py), decode
statistics (stats.py) and committed tokens to text (textstream.py, think.py). It asks sizing/
for each block's size, drafting/ for drafts beside the drafter's, and target/ for the target's
captures and rollback; batching/ and prefix/ build on it."""
