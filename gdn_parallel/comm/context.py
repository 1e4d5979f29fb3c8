"""The context-parallel plan of one packed row, built once per batch (docs/design.md §2).

A packed row of `total` tokens with global document boundaries `cu_seqlens` is split contiguously
over the `size` ranks of a CP group, `total / size` tokens each. Each boundary between two ranks is
crossed by at most one document, so every hand-over (a GDN state, a conv or attention halo) is a
single message from rank r to rank r + 1, and only ranks a document spans exchange its data.

The plan also owns the asynchronous sends started on its behalf (`Outbox`): a send's handle must
outlive the op that started it (else the transfer may be cancelled) and is waited on once, when
the step that built the plan is done with it (`CPContext.finish`).
"""
from __future__ import annotations

import bisect
import collections
import contextlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


class Outbox:
    """Asynchronous sends not yet waited on. Completed ones are dropped as new ones arrive, so a
    long step holds only the sends whose receivers have not posted yet."""

    def __init__(self):
        self._works: list = []

    def post(self, work) -> None:
        self._works = [w for w in self._works if not w.is_completed()]
        self._works.append(work)

    def wait(self) -> None:
        """Each send completes once its receive is posted; after the backward every receive is."""
        while self._works:
            self._works.pop(0).wait()

    def __len__(self) -> int:
        return len(self._works)


class Loopback:
    """Hand-overs between the sequence chunks that one process runs in turn (chunked recomputation,
    parallel/checkpointing.py): a chunk's successor receives the very tensor the chunk sent, so the
    gradient flows back through autograd and the backward needs no message."""

    def __init__(self):
        self._queues: dict = collections.defaultdict(collections.deque)

    def put(self, sender: int, tensor: torch.Tensor) -> None:
        self._queues[sender].append(tensor)

    def take(self, sender: int) -> torch.Tensor:
        if not self._queues[sender]:
            raise RuntimeError(f"sequence chunk {sender + 1} asked for a hand-over that chunk {sender} never "
                               f"sent: the chunks must run in order")
        return self._queues[sender].popleft()


@dataclass
class CPContext:
    """Ranks here are positions along the row. With `chunks` > 1 each process of `group` holds
    `chunks` consecutive ones (sequence chunks it runs in turn); hand-overs between two of its own go
    through `loopback`, the others to the neighbouring process as usual."""
    group: dist.ProcessGroup | None
    rank: int                       # rank inside the CP group
    size: int                       # CP degree
    global_cu: list                 # global document boundaries, python ints
    local_len: int
    algorithm: str = "relay"       # relay | allgather (the GDN op's two algorithms, docs/design.md §2)
    device: torch.device = torch.device("cpu")
    outbox: Outbox = field(default_factory=Outbox, repr=False)
    chunks: int = 1
    loopback: Loopback | None = field(default=None, repr=False)
    # which queries full attention computes here: contiguous (the shard's) | zigzag (comm/zigzag.py)
    attention_split: str = "contiguous"

    # ------------------------------------------------------------------ construction
    @classmethod
    def build(cls, group: dist.ProcessGroup | None, cu_seqlens, local_len: int,
              algorithm: str = "relay", device=None, rank: int | None = None,
              size: int | None = None, attention_split: str = "contiguous") -> CPContext:
        """`cu_seqlens`: global boundaries (tensor or list; None = one document over all ranks).

        `rank`/`size` default to the caller's place in `group` (given explicitly, no group is
        needed: shard planning on one process).
        """
        size = dist.get_world_size(group) if size is None else size
        rank = dist.get_rank(group) if rank is None else rank
        if local_len < 1:
            raise ValueError(f"the local shard has {local_len} tokens; every CP rank needs at least one "
                             f"(lower parallel.cp or use longer sequences)")
        total = local_len * size
        if cu_seqlens is None:
            cu = [0, total]
        else:
            cu = (cu_seqlens.detach().to("cpu").tolist() if isinstance(cu_seqlens, torch.Tensor)
                  else [int(c) for c in cu_seqlens])
        if cu[0] != 0 or any(b <= a for a, b in zip(cu, cu[1:])):
            raise ValueError(f"cu_seqlens must start at 0 and be strictly increasing, got {cu}")
        if cu[-1] != total:
            raise ValueError(f"cu_seqlens ends at {cu[-1]} but the CP group holds {size} shards of "
                             f"{local_len} tokens = {total}: pass the global boundaries of the whole row, "
                             f"whose length must be divisible by the CP degree")
        return cls(group, rank, size, cu, local_len, algorithm,
                   torch.device(device) if device is not None else torch.device("cpu"),
                   attention_split=attention_split)

    # ------------------------------------------------------------------ geometry
    @property
    def total(self) -> int:
        return self.global_cu[-1]

    @property
    def start(self) -> int:
        return self.rank * self.local_len

    @property
    def end(self) -> int:
        return self.start + self.local_len

    def shard_start(self, rank: int) -> int:
        return rank * self.local_len

    def doc_of(self, position: int) -> int:
        """Index of the global document holding token `position`."""
        return bisect.bisect_right(self.global_cu, position) - 1

    def crosses(self, boundary_rank: int) -> bool:
        """Does a document continue from rank boundary_rank - 1 into rank boundary_rank?"""
        if boundary_rank <= 0 or boundary_rank >= self.size:
            return False
        return self.shard_start(boundary_rank) not in self._cu_set

    @property
    def _cu_set(self) -> set:
        cached = self.__dict__.get("_cu_set_cache")
        if cached is None:
            cached = self.__dict__["_cu_set_cache"] = set(self.global_cu)
        return cached

    @property
    def continues_from_prev(self) -> bool:
        return self.crosses(self.rank)

    @property
    def continues_to_next(self) -> bool:
        return self.crosses(self.rank + 1)

    @property
    def local_cu_list(self) -> list:
        inner = [c - self.start for c in self.global_cu if self.start < c < self.end]
        return [0, *inner, self.local_len]

    @property
    def local_cu_seqlens(self) -> torch.Tensor:
        """Host tensor, made once: the ops read boundaries on the host and keep one device copy
        (gdn_kernels.host_index.on_device); a fresh device tensor per layer would sync the GPU each time."""
        cached = self.__dict__.get("_local_cu_cache")
        if cached is None:
            cached = self.__dict__["_local_cu_cache"] = torch.tensor(self.local_cu_list, dtype=torch.long)
        return cached

    @property
    def num_local_docs(self) -> int:
        return len(self.local_cu_list) - 1

    @property
    def docs_starting_here(self) -> int:
        return self.num_local_docs - int(self.continues_from_prev)

    @property
    def docs_ending_here(self) -> int:
        return self.num_local_docs - int(self.continues_to_next)

    def ranks_spanned(self, doc: int) -> range:
        """The ranks that hold tokens of global document `doc`."""
        first = self.global_cu[doc] // self.local_len
        last = (self.global_cu[doc + 1] - 1) // self.local_len
        return range(first, last + 1)

    def halo_len(self, width: int, rank: int | None = None) -> int:
        """Tokens of the same document, at most `width`, that rank `rank` needs from before its shard."""
        rank = self.rank if rank is None else rank
        if width <= 0 or not self.crosses(rank):
            return 0
        start = self.shard_start(rank)
        return min(width, start - self.global_cu[self.doc_of(start)])

    def local_doc_ids(self) -> torch.Tensor:
        """Global document index of each local token (made once per plan: every layer asks)."""
        cached = self.__dict__.get("_local_doc_ids_cache")
        if cached is None:
            positions = torch.arange(self.start, self.end)
            ids = torch.bucketize(positions, self.global_cu_seqlens, right=True) - 1
            cached = self.__dict__["_local_doc_ids_cache"] = ids.to(self.device)
        return cached

    @property
    def global_cu_seqlens(self) -> torch.Tensor:
        """Host tensor of the global boundaries, made once (see local_cu_seqlens)."""
        cached = self.__dict__.get("_global_cu_cache")
        if cached is None:
            cached = self.__dict__["_global_cu_cache"] = torch.tensor(self.global_cu, dtype=torch.long)
        return cached

    def local_positions(self) -> torch.Tensor:
        """Position of each local token inside its (global) document."""
        cu = torch.tensor(self.global_cu, dtype=torch.long)
        positions = torch.arange(self.start, self.end)
        return (positions - cu[torch.bucketize(positions, cu, right=True) - 1]).to(self.device)

    # ------------------------------------------------------------------ communication bookkeeping
    def global_rank(self, rank: int) -> int:
        process = rank // self.chunks
        return process if self.group is None else dist.get_global_rank(self.group, process)

    @property
    def prev_is_local(self) -> bool:
        """Is the previous rank a chunk of this same process (a loopback hand-over)?"""
        return self.loopback is not None and self.rank % self.chunks != 0

    @property
    def next_is_local(self) -> bool:
        return self.loopback is not None and (self.rank + 1) % self.chunks != 0

    def finish(self) -> None:
        """Wait for the sends started under this plan: call once its row's forward and backward (or
        forward alone, in evaluation) have run."""
        self.outbox.wait()


@contextlib.contextmanager
def sends_finished(plans: Iterable[CPContext | None]):
    """The extent of one step: when the block ends, every send started under these plans (None: a
    row without context parallelism) has completed. After an error nothing is waited for: a peer
    that failed would never post its receive."""
    active = [plan for plan in plans if plan is not None]
    yield
    for plan in active:
        plan.finish()


def shard_bounds(total: int, cp_size: int, cp_rank: int, field_name: str = "the packed length") -> tuple:
    """[start, end) of a rank's contiguous shard; the length must divide evenly."""
    if cp_size < 1:
        raise ValueError(f"parallel.cp={cp_size} must be >= 1")
    if total < cp_size:
        raise ValueError(f"{field_name} = {total} leaves CP shards shorter than one token at "
                         f"parallel.cp={cp_size}; lower parallel.cp or lengthen the sequence")
    if total % cp_size:
        raise ValueError(f"{field_name} = {total} is not divisible by parallel.cp={cp_size}; choose a length "
                         f"that is a multiple of the CP degree (no padding is added)")
    local = total // cp_size
    return cp_rank * local, (cp_rank + 1) * local


def sequence_lengths(cu: Sequence[int]) -> list:
    return [b - a for a, b in zip(cu, cu[1:])]
