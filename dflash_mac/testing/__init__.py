"""Helpers for tests and measurements (not the product): tiny random pairs, the oracle drafter,
the rollback-strategy benchmark."""
