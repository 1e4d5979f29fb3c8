"""Packed test rows with documents (labels = next token inside each document), and one
context-parallel training step over them."""
import torch.distributed as dist

from gdn_parallel.data.packing import random_packed_row
from gdn_parallel.parallel.batch import all_reduce_gradients, cp_loss, shard_batch
from tests.seeds import seeded


def make_batch(cu, seed, vocab=64):
    return random_packed_row(cu, vocab, seeded(seed))


def cp_step(model, batch, rank, world, algorithm="relay"):
    """This rank's shard of `batch` forward and backward; returns the global loss, and leaves the
    gradients summed over the (default) group, as one process over the whole row would have them."""
    shard = shard_batch(batch, rank, world, dist.group.WORLD, algorithm)
    loss = cp_loss(model, shard)
    loss.backward()
    shard.context.finish()
    total = loss.detach().clone()
    dist.all_reduce(total)
    all_reduce_gradients(model, dist.group.WORLD)
    return total
