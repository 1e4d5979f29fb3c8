"""Activation offload: the block inputs that full activation checkpointing keeps, held in host memory.

Under full checkpointing a block keeps one tensor for its backward, its input (the fp32 residual
stream: 8 KB per token at hidden size 2048). At long context these inputs dominate a GPU's memory:
24 blocks x 128K tokens hold 26 GB. With `train.activation_offload=cpu` each offloaded block's input
is copied to pinned host memory during the forward, on a copy stream of its own (the compute stream
goes on), and copied back in the backward on that stream one block ahead: when block L's input is
asked for (its recomputation begins), the input of the block saved before it starts coming back, so
that the copy overlaps block L's recomputation and backward instead of stalling the next one.

The copy is exact, so training is unchanged bit for bit. It works through saved-tensor hooks around
the checkpointed call (parallel/checkpointing.py): the tensors torch's checkpoint saves for its
recomputation, the block's inputs, pass through `pack` and `unpack`; what the block saves inside is
already discarded and recomputed by the checkpoint itself.

Host buffers are kept in a pool by size and reused from step to step, registered with CUDA (page-
locked) at their exact size: torch's pinned-memory allocator rounds each block up to a power of two,
which at long context would double the host memory asked for. Each is mapped in transparent huge pages
and written once on several threads before it is registered, which makes the first step's pinning ten
times faster. On the CPU (tests) the same path runs with plain host copies and no streams.
"""
from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import mmap
import os
import warnings
import weakref

import torch


class _HostPool:
    """Host buffers by (numel, dtype), reused across steps; page-locked on CUDA at their exact size."""

    def __init__(self, pin: bool, device: torch.device | None = None):
        self.pin, self.device = pin, device
        self.free: dict[tuple[int, torch.dtype], list[torch.Tensor]] = collections.defaultdict(list)
        self.registered: list[torch.Tensor] = []
        self.bytes = 0  # host memory held, all buffers
        self._unregister_at_end()

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        free = self.free[(numel, dtype)]
        if free:
            return free.pop()
        buffer = _prefaulted_host_buffer(numel, dtype) if self.pin else torch.empty(numel, dtype=dtype)
        if self.pin:
            nbytes = buffer.numel() * buffer.element_size()
            status = torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), nbytes, 0)
            if int(status) != 0:
                raise RuntimeError(f"train.activation_offload=cpu: page-locking {nbytes / 2**30:.2f} GiB of "
                                   f"host memory failed (CUDA error {int(status)}); the host may be short of "
                                   f"memory: offload fewer blocks (train.activation_offload_blocks) or none")
            self.registered.append(buffer)
        self.bytes += buffer.numel() * buffer.element_size()
        return buffer

    def give_back(self, buffer: torch.Tensor) -> None:
        self.free[(buffer.numel(), buffer.dtype)].append(buffer)

    def release(self) -> None:
        self._unregister()          # now, once; buffers taken later are unregistered at the pool's end
        self._unregister_at_end()
        self.free.clear()
        self.bytes = 0

    def _unregister_at_end(self) -> None:
        # Memory freed while registered stays registered in the driver: a later host tensor at the same
        # addresses then fails its copies to the GPU (CUDA "invalid argument"; gdn-verify builds a model,
        # and with it a pool, per layout). The finalizer holds the buffers, not the pool: they live until
        # the pool is collected, are unregistered, and only then freed. At exit the process's end frees all.
        self.registered = []
        self._unregister = weakref.finalize(self, _unregister_buffers, self.registered, self.device)
        self._unregister.atexit = False


def _prefaulted_host_buffer(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A host buffer in transparent huge pages where the kernel offers them, its pages faulted in on
    several threads before CUDA page-locks it. Registering plain memory faults in 4 KiB pages one by one
    inside the driver: 0.78 GiB/s a rank with four ranks at once on an H200 host, so the 1M config's
    48 GiB a rank took about a minute of its first step; in huge pages, touched first, 6.5-9.6 GiB/s."""
    nbytes = numel * dtype.itemsize
    if not nbytes or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(numel, dtype=dtype)
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.madvise(mmap.MADV_HUGEPAGE)
    buffer = torch.frombuffer(region, dtype=torch.uint8)   # keeps the mapping alive
    _touch_in_parallel(buffer)
    return buffer.view(dtype)


def _touch_in_parallel(buffer: torch.Tensor) -> None:
    """Write every page once, a slice a thread (a write releases the GIL). torchrun starts each rank
    with one intra-op thread, so a plain zero_() would fault the pages in on one core."""
    ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    threads = max(1, min(8, len(os.sched_getaffinity(0)) // max(ranks_here, 1)))
    slices = buffer.chunk(threads)
    if len(slices) == 1:
        buffer.zero_()
        return
    with concurrent.futures.ThreadPoolExecutor(len(slices)) as workers:
        list(workers.map(torch.Tensor.zero_, slices))


def _unregister_buffers(buffers: list[torch.Tensor], device: torch.device | None) -> None:
    """Unregister page-locked host buffers once no copy queued on `device` may still read them."""
    if not buffers:
        return
    torch.cuda.synchronize(device)
    for buffer in buffers:
        status = int(torch.cuda.cudart().cudaHostUnregister(buffer.data_ptr()))
        if status != 0:   # said, not raised: this runs when the pool is collected
            warnings.warn(f"train.activation_offload=cpu: unregistering a host buffer of "
                          f"{buffer.numel() * buffer.element_size()} bytes failed (CUDA error {status})",
                          RuntimeWarning, stacklevel=1)
    buffers.clear()


class _Offloaded:
    """One tensor held in host memory: where it came from, and the one packed before it (the next to
    be asked for in a backward, which runs the blocks in reverse)."""
    __slots__ = ("host", "pool", "shape", "dtype", "device", "previous", "on_device", "ready", "__weakref__")

    def __init__(self, host, pool: _HostPool, like: torch.Tensor, previous):
        self.host, self.pool = host, pool
        self.shape, self.dtype, self.device = like.shape, like.dtype, like.device
        self.previous = previous          # a weak reference, or None
        self.on_device: torch.Tensor | None = None   # the copy back, once started
        self.ready: torch.cuda.Event | None = None

    def __del__(self):
        # never asked for (a graph freed without a backward): its buffer goes back to the pool; a
        # later copy into it is queued on the same copy stream as the copy out, so after it
        if self.host is not None:
            self.pool.give_back(self.host)
            self.host = None


class BlockInputOffload:
    """Saved-tensor hooks that hold checkpointed blocks' inputs in host memory (module docstring).
    One per model replica and process; `saving()` is the context to run a checkpointed call in."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.on_cuda = self.device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(self.device) if self.on_cuda else None
        self.pool = _HostPool(pin=self.on_cuda, device=self.device)
        self._last: weakref.ref | None = None
        # since the last reset: bytes sent to the host, and copies back started one block ahead or only
        # when asked for (the first block of a backward, or a backward in another order)
        self.offloaded_bytes = self.fetched_ahead = self.fetched_on_demand = 0

    def saving(self):
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    # ------------------------------------------------------------------ forward: to the host
    def _pack(self, tensor: torch.Tensor):
        # What reaches the hooks is the checkpoint's saved inputs: the block's hidden states, and an
        # empty marker tensor, which stays.
        if (tensor.device.type != self.device.type or isinstance(tensor, torch.nn.Parameter)
                or not tensor.numel()):
            return tensor
        source = tensor.contiguous()
        host = self.pool.take(source.numel(), source.dtype)
        if self.copy_stream is not None:
            compute = torch.cuda.current_stream(self.device)
            self.copy_stream.wait_stream(compute)   # the tensor is written by work queued so far
            with torch.cuda.stream(self.copy_stream):
                host.copy_(source.view(-1), non_blocking=True)
            # the compute stream may free the tensor now: its memory is not reused before the copy ends
            source.record_stream(self.copy_stream)  # type: ignore[arg-type]
        else:
            host.copy_(source.view(-1))
        self.offloaded_bytes += host.numel() * host.element_size()
        handle = _Offloaded(host, self.pool, tensor, self._last)
        self._last = weakref.ref(handle)
        return handle

    # ------------------------------------------------------------------ backward: back to the device
    def _unpack(self, packed):
        if not isinstance(packed, _Offloaded):
            return packed
        if packed.on_device is None:
            self._fetch(packed)
            self.fetched_on_demand += 1
        if packed.ready is not None:
            torch.cuda.current_stream(self.device).wait_event(packed.ready)
        tensor = packed.on_device.view(packed.shape)
        packed.on_device = None
        earlier = packed.previous() if packed.previous is not None else None
        if earlier is not None and earlier.host is not None and earlier.on_device is None:
            self._fetch(earlier)   # the block saved before this one is the next the backward asks for
            self.fetched_ahead += 1
        return tensor

    def _fetch(self, packed: _Offloaded) -> None:
        host, packed.host = packed.host, None
        if self.copy_stream is not None:
            compute = torch.cuda.current_stream(self.device)
            # allocated on the compute stream, which uses it; written on the copy stream once the
            # compute stream's queued work (which may still use this memory's previous owner) is done
            target = torch.empty(host.shape, dtype=host.dtype, device=self.device)
            self.copy_stream.wait_stream(compute)
            with torch.cuda.stream(self.copy_stream):
                target.copy_(host, non_blocking=True)
                packed.ready = torch.cuda.Event()
                packed.ready.record(self.copy_stream)
        else:
            target = host.clone()
        packed.on_device = target
        # Reusable at once: a later pack writes it on the same copy stream, after this read.
        self.pool.give_back(host)

    def reset_counters(self) -> None:
        self.offloaded_bytes = self.fetched_ahead = self.fetched_on_demand = 0

    def release(self) -> None:
        """Host memory back to the system (the end of a run)."""
        if self.on_cuda:
            torch.cuda.synchronize(self.device)
        self.pool.release()


def offload_context(offload: BlockInputOffload | None):
    return offload.saving() if offload is not None else contextlib.nullcontext()
