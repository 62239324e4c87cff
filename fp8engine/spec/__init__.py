"""Speculative decoding without a draft model: drafts looked up in token histories (drafter.py), verified by the
target's own seeded samples (the output processor), so that every emitted token is the one plain decoding emits."""
