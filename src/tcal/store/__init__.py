"""What a run keeps on disk: its record, its folder, the caches, atomic writes, digests."""
