"""Slots of per-sequence state beside the paged KV cache, for hybrid models' linear-attention (GDN) layers.

A GDN layer keeps one fixed-size state per sequence (its last conv inputs and a float32 recurrent state), not one
entry per token, so it is not paged: a running sequence holds one slot, which the block manager hands out with its
first blocks and takes back with them (finish, preemption, a recompute after an update). A fresh slot is zeroed
before the next forward; a fork's slot is a copy of its parent's. The runner holds the tensors and applies both
(`take_pending`), copies first: a slot freed and handed out again in one schedule is still read as it was.
"""


class StatePool:
    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self.free = list(range(num_slots - 1, -1, -1))  # taken from the end: the lowest slot first
        self.pending_copies: list[tuple[int, int]] = []
        self.pending_zeros: list[int] = []

    @property
    def num_free(self) -> int:
        return len(self.free)

    def take(self, copy_of: int | None = None) -> int:
        """A free slot: zeroed before the next forward, or a copy of slot copy_of (a fork)."""
        slot = self.free.pop()
        if copy_of is None:
            self.pending_zeros.append(slot)
        else:
            self.pending_copies.append((copy_of, slot))
        return slot

    def give(self, slot: int) -> None:
        self.free.append(slot)

    def take_pending(self) -> tuple[list[tuple[int, int]], list[int]]:
        """(copies (source, destination), slots to zero) since the last call, to run in that order."""
        pending = self.pending_copies, self.pending_zeros
        self.pending_copies, self.pending_zeros = [], []
        return pending
