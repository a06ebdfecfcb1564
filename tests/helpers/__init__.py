"""Helpers for the tests and the measurement scripts (not the product, not installed): tiny
random pairs, the oracle drafter, the lossy acceptance rule, a drafter's vocabulary subset."""
