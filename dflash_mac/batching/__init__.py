"""Continuous batching: batched DFlash cycles over rows with ragged caches (ragged.py) and the
scheduler that admits, prefills, decodes and retires requests (scheduler.py: `BatchEngine`).
Built on the one-request engine (engine/), whose loop runs a lone request."""
