"""DFlash over MLX distributed: the target sharded across ranks, the drafter on rank 0
(docs/distributed.md). `group` (ranks, the packet), `sharded` (loading), `leader` (rank 0's
mirrored forwards), `worker` (the other ranks' loop), `launcher` (starting local or ssh ranks)."""
