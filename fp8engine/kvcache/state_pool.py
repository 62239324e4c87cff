"""Slots of per-sequence state beside the paged KV cache, for hybrid models' linear-attention (GDN) layers.

A GDN layer keeps one fixed-size state per sequence (its last conv inputs and a float32 recurrent state), not one
entry per token, so it is not paged: a running sequence holds one slot, which the block manager hands out with its
first blocks and takes back with them (finish, preemption, a recompute after an update). A fresh slot is zeroed
before the next forward; a fork's slot is a copy of its parent's. The runner holds the tensors and applies both
(`take_pending`), copies first: a slot freed and handed out again in one schedule is still read as it was.

Snapshots make prefix caching work for these models. A state is valid at one position only, and is tens of MiB at
the released sizes, so one is kept where it pays: at block boundaries. The state at a prompt's last full block (the
deepest a resubmission of the prompt can hit: the n requests of a GRPO group) is cached at once. Besides, each
running sequence holds at most one, its latest boundary (`rolling`, replaced as it crosses the next one: one state
copy per block of tokens); when the sequence leaves (finished, aborted, preempted) that snapshot joins the cache
under the hash of the block that ends there (its last full block: the next turn of an episode, a resubmitted
aborted request, the recompute after a preemption).
A prefix hit is cut back to the deepest cached block with a snapshot; the new sequence's slot starts as a copy of it.
Cached snapshots are evicted least recently used first, and all of them go with the prefix cache when it is reset.
"""

from collections import OrderedDict


class StatePool:
    """spec_per_slot > 0 (speculative decoding): each running slot comes with that many more, where a verification
    step keeps the state after each of its tokens but the last, so that the state can be rolled back to the last
    accepted one (`spec_of`)."""

    def __init__(self, num_slots: int, num_snapshots: int = 0, spec_per_slot: int = 0):
        self.num_slots, self.num_snapshots, self.spec_per_slot = num_slots, num_snapshots, spec_per_slot
        total = num_slots + num_snapshots
        self.free = list(range(total - 1, -1, -1))  # physical slots, the lowest taken first
        self.spec_free = list(range(total + num_slots * spec_per_slot - 1, total - 1, -1))
        self.spec_of: dict[int, list[int]] = {}  # a running slot -> its verification slots
        self.num_running = 0  # slots held by sequences (at most num_slots)
        self.rolling: dict[int, tuple[int, int]] = {}  # seq_id -> (block index its snapshot ends, slot)
        self.cached: OrderedDict[int, int] = OrderedDict()  # block hash -> snapshot slot, least recently used first
        self.pending_copies: list[tuple[int, int]] = []
        self.pending_zeros: list[int] = []
        self.num_snapshots_taken = 0

    @property
    def num_free(self) -> int:
        """Slots a sequence may still take."""
        return self.num_slots - self.num_running

    def take(self, copy_of: int | None = None) -> int:
        """A sequence's slot: zeroed before the next forward, or a copy of slot copy_of (a fork, a prefix hit)."""
        self.num_running += 1
        slot = self.free.pop()
        if self.spec_per_slot:
            self.spec_of[slot] = [self.spec_free.pop() for _ in range(self.spec_per_slot)]
        if copy_of is None:
            self.pending_zeros.append(slot)
        else:
            self.pending_copies.append((copy_of, slot))
        return slot

    def give(self, slot: int) -> None:
        self.num_running -= 1
        self.free.append(slot)
        self.spec_free += self.spec_of.pop(slot, [])

    def roll_back(self, slot: int, num_tokens: int) -> None:
        """A verification's sequence keeps the state after its first num_tokens tokens of the step (copied from
        the verification slot that holds it before the next forward)."""
        self.pending_copies.append((self.spec_of[slot][num_tokens - 1], slot))

    # ------------------------------------------------------------------ snapshots
    def _snapshot_room(self) -> bool:
        """Whether a snapshot slot can be had, evicting the least recently used cached snapshot if need be."""
        if len(self.rolling) + len(self.cached) < self.num_snapshots:
            return True
        if not self.cached:
            return False
        self.free.append(self.cached.popitem(last=False)[1])
        return True

    def snapshot_slot(self, seq_id: int, block_index: int) -> int | None:
        """A slot for the state of seq_id after its block block_index (the forward writes it), replacing the
        sequence's previous snapshot; None when every snapshot slot holds another running sequence's."""
        old = self.rolling.pop(seq_id, None)
        if old is not None:
            self.free.append(old[1])
        elif not self._snapshot_room():
            return None
        slot = self.free.pop()
        self.rolling[seq_id] = (block_index, slot)
        self.num_snapshots_taken += 1
        return slot

    def cached_slot(self, key: int) -> int | None:
        """A slot for a snapshot cached at once under key (a prompt's last full block: its hash is known before the
        forward writes it); None when key is cached already or no slot can be had."""
        if key in self.cached or not self._snapshot_room():
            return None
        slot = self.cached[key] = self.free.pop()
        self.num_snapshots_taken += 1
        return slot

    def retire(self, seq_id: int, block_hash) -> None:
        """A leaving sequence's snapshot joins the cache under block_hash(its block index) (given as a function)."""
        rolling = self.rolling.pop(seq_id, None)
        if rolling is None:
            return
        key = block_hash(rolling[0])
        if key in self.cached:
            self.free.append(rolling[1])
            self.cached.move_to_end(key)
        else:
            self.cached[key] = rolling[1]

    def lookup(self, key: int) -> int | None:
        slot = self.cached.get(key)
        if slot is not None:
            self.cached.move_to_end(key)
        return slot

    def clear_snapshots(self) -> None:
        """Every snapshot dropped (the prefix cache reset: new weights make them stale)."""
        self.free += [slot for _, slot in self.rolling.values()] + list(self.cached.values())
        self.rolling.clear()
        self.cached.clear()

    def take_pending(self) -> tuple[list[tuple[int, int]], list[int]]:
        """(copies (source, destination), slots to zero) since the last call, to run in that order."""
        pending = self.pending_copies, self.pending_zeros
        self.pending_copies, self.pending_zeros = [], []
        return pending
