"""Context-parallel forms of the ops: the same math as gdn_parallel.ops on a contiguous shard."""
