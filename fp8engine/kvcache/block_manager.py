"""KV block manager: paging with reference counts and prefix caching.

A full block's hash chains the previous block's hash with its token ids; a hit also compares the
tokens. Blocks whose last user is gone stay cached in the free list and are evicted least recently
used first (blocks holding no reusable content go to the front of that list).
"""

from collections import OrderedDict

from fp8engine.kvcache.state_pool import StatePool
from fp8engine.request import Sequence


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash: int | None = None
        self.token_ids: tuple[int, ...] = ()


class BlockManager:
    """num_state_slots > 0 (a hybrid model): every sequence holding blocks also holds a state slot (states)."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool, num_state_slots: int = 0,
                 num_state_snapshots: int = 0, spec_states_per_slot: int = 0):
        self.block_size = block_size
        snapshots = num_state_snapshots if enable_prefix_caching else 0
        self.states = StatePool(num_state_slots, snapshots, spec_states_per_slot) if num_state_slots else None
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[int, int] = {}
        self.pending_copies: list[tuple[int, int]] = []
        self.num_prefix_queries = 0
        self.num_prefix_hits = 0

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        return max(0, -(-num_tokens // self.block_size) - len(seq.block_table))

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks holding a prefix of seq's tokens, leaving at least one token to compute. With state slots
        (a hybrid model) cut back to the deepest one with a state snapshot after it, which seq's slot will start
        from (seq.state_restore)."""
        seq.state_restore = None
        if not self.enable_prefix_caching or seq.needs_prompt_logprobs:
            return []
        max_blocks = (seq.num_tokens - 1) // self.block_size
        hits = []
        for i in range(max_blocks):
            block_hash = self.block_hash(seq, i)
            block_id = self.cached.get(block_hash)
            if block_id is None or self.blocks[block_id].token_ids != seq.block_tokens(i, self.block_size):
                break
            hits.append(block_id)
        if self.states is not None:
            while hits and (slot := self.states.lookup(self.block_hash(seq, len(hits) - 1))) is None:
                hits.pop()
            seq.state_restore = slot if hits else None
        self.num_prefix_queries += max_blocks
        self.num_prefix_hits += len(hits)
        return hits

    def can_allocate(self, seq: Sequence, num_tokens: int, hits: list[int] = ()) -> bool:
        if self.states is not None and seq.state_slot is None and not self.states.num_free:
            return False
        reused_free = sum(1 for b in hits if self.blocks[b].ref_count == 0)
        fresh = max(0, -(-num_tokens // self.block_size) - len(seq.block_table) - len(hits))
        return reused_free + fresh <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_tokens: int, hits: list[int] = ()) -> None:
        """Give seq blocks for its first num_tokens tokens, reusing prefix hits first (and a state slot)."""
        if self.states is not None and seq.state_slot is None:
            seq.state_slot = self.states.take(copy_of=seq.state_restore if hits else None)
        for block_id in hits:
            self._take_hit(block_id)
            seq.block_table.append(block_id)
        seq.num_hashed_blocks = max(seq.num_hashed_blocks, len(hits))
        for _ in range(self.blocks_needed(seq, num_tokens)):
            seq.block_table.append(self._take_fresh())

    def free_seq(self, seq: Sequence) -> None:
        for block_id in reversed(seq.block_table):
            self._release(block_id)
        seq.block_table.clear()
        seq.num_hashed_blocks = 0
        if seq.state_slot is not None:
            self.states.give(seq.state_slot)
            seq.state_slot = None
            self.states.retire(seq.seq_id, lambda i: self.block_hash(seq, i))

    def grow_uncached(self, seq: Sequence, num_tokens: int) -> int:
        """Give seq blocks toward num_tokens tokens from free blocks that hold no prefix-cache content only (taking
        one evicts nothing); returns how many tokens seq's blocks cover now, at most num_tokens."""
        while len(seq.block_table) * self.block_size < num_tokens and self.free:
            if self.blocks[next(iter(self.free))].hash is not None:
                break
            seq.block_table.append(self._take_fresh())
        return min(num_tokens, len(seq.block_table) * self.block_size)

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Give back seq's blocks past its first num_tokens tokens, newest first, each to the front of the free
        list: they hold no cached content, and grow_uncached took them from there, so the order is restored."""
        keep = -(-num_tokens // self.block_size)
        while len(seq.block_table) > keep:
            self._release(seq.block_table.pop())

    def can_fork(self, parent: Sequence) -> bool:
        """True when a fork of parent can get its copy of a partial last block."""
        has_partial = len(parent.block_table) > parent.num_computed_tokens // self.block_size
        if self.states is not None and not self.states.num_free:
            return False
        return self.num_free_blocks >= int(has_partial)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """child shares parent's full blocks; a partial last block is copied (copy on write), and so is the state."""
        if self.states is not None:
            child.state_slot = self.states.take(copy_of=parent.state_slot)
        num_full = parent.num_computed_tokens // self.block_size
        for block_id in parent.block_table[:num_full]:
            self.blocks[block_id].ref_count += 1
            child.block_table.append(block_id)
        child.num_hashed_blocks = parent.num_hashed_blocks
        if len(parent.block_table) > num_full:
            copy = self._take_fresh()
            self.pending_copies.append((parent.block_table[num_full], copy))
            child.block_table.append(copy)

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register seq's newly filled blocks in the prefix cache."""
        num_full = seq.num_computed_tokens // self.block_size
        while self.enable_prefix_caching and seq.num_hashed_blocks < num_full:
            i = seq.num_hashed_blocks
            block = self.blocks[seq.block_table[i]]
            block_hash = self.block_hash(seq, i)
            if block.hash is None and block_hash not in self.cached:
                block.hash, block.token_ids = block_hash, seq.block_tokens(i, self.block_size)
                self.cached[block_hash] = block.block_id
            seq.num_hashed_blocks += 1

    def block_hash(self, seq: Sequence, i: int) -> int:
        """Hash of seq's full block i: the previous block's hash chained with this block's token ids (memoised
        on the sequence; the tokens of a full block never change)."""
        hashes = seq.block_hashes
        while len(hashes) <= i:
            hashes.append(hash((hashes[-1] if hashes else None, seq.block_tokens(len(hashes), self.block_size))))
        return hashes[i]

    def live_blocks(self) -> list[int]:
        """Blocks in use or holding prefix-cache content (what a KV-scale change must convert)."""
        return [b.block_id for b in self.blocks if b.ref_count > 0 or b.hash is not None]

    def plan_snapshots(self, seq: Sequence, num_new_tokens: int) -> tuple[tuple[int, int], ...]:
        """(offset in this step's tokens after which seq's state is kept, its slot) for each snapshot the step
        takes (kvcache/state_pool.py): at the prompt's last full block when the step crosses it (cached at once),
        and at the last block boundary it crosses (seq's rolling snapshot)."""
        if self.states is None or not self.states.num_snapshots:
            return ()
        bs, start = self.block_size, seq.num_computed_tokens
        end = start + num_new_tokens
        snapshots = []
        prompt_end = (seq.num_prompt_tokens - 1) // bs * bs
        if start < prompt_end <= end:
            slot = self.states.cached_slot(self.block_hash(seq, prompt_end // bs - 1))
            if slot is not None:
                snapshots.append((prompt_end - start, slot))
        boundary = end // bs * bs
        if start < boundary != prompt_end:
            slot = self.states.snapshot_slot(seq.seq_id, boundary // bs - 1)
            if slot is not None:
                snapshots.append((boundary - start, slot))
        return tuple(snapshots)

    def reset_prefix_cache(self) -> None:
        if self.states is not None:
            self.states.clear_snapshots()
        for block in self.blocks:
            block.hash, block.token_ids = None, ()
        self.cached.clear()

    def take_pending_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    @property
    def hit_rate(self) -> float:
        return self.num_prefix_hits / self.num_prefix_queries if self.num_prefix_queries else 0.0

    def _release(self, block_id: int) -> None:
        """One user fewer; a block with none left is free: at the back of the LRU list when it holds cached
        content, at the front (taken first) when it holds none."""
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free[block_id] = None
            if block.hash is None:
                self.free.move_to_end(block_id, last=False)

    def _take_hit(self, block_id: int) -> int:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free[block_id]
        block.ref_count += 1
        return block_id

    def _take_fresh(self) -> int:
        block_id, _ = self.free.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None:
            if self.cached.get(block.hash) == block_id:
                del self.cached[block.hash]
            block.hash, block.token_ids = None, ()
        block.ref_count = 1
        return block_id
