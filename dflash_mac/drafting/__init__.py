"""Drafts beside the drafter's chain: copies of what followed the same tokens earlier in the
prompt or answer (copies.py), the longest matching earlier answer (suffix.py), and a best-first
tree of the drafter's candidates verified in one pass (tree.py). The cycle (engine/cycle.py)
runs them; the block-size controller (sizing/) weighs what they cost and gain."""
