def chain_hash(prev_hash: int | None, token_ids: tuple[int, ...]) -> int:
    """Hash of a full KV block: the previous block's hash chained with this block's token ids."""
    return hash((prev_hash, token_ids))
