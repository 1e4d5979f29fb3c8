"""Communication for context parallelism, on torch.distributed alone: the per-batch plan and its
sends (context.py), differentiable hand-overs between neighbouring ranks and the all-gather
(p2p.py), halos (halo.py), the zigzag movement of query blocks (zigzag.py), and the replay of
received messages in recomputed blocks (replay.py).
The ops' context-parallel forms are written on top of this; it knows nothing of them."""
from .context import CPContext, Outbox, sends_finished, sequence_lengths, shard_bounds

__all__ = ["CPContext", "Outbox", "sends_finished", "sequence_lengths", "shard_bounds"]
