"""Differentiable hand-overs between neighbouring CP ranks.

Forward data flows from rank r to rank r + 1 only; its gradient flows back from r + 1 to r in the
backward. Both sides are asynchronous where the next computation does not need the result:
a receive is posted early and waited on when needed; a send returns at once.

Autograd wiring: `send_to_next` returns a zero scalar "token" that the caller adds to its output, so
that the backward reaches the send's node and receives the gradient from rank r + 1 there. Nodes
created after the send (the outputs) are backpropagated first, then the token's node waits for the
incoming gradient, then the work that needs it runs: the backward mirrors the forward's overlap.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from . import links, replay
from .context import CPContext


class PendingRecv:
    """A receive from rank r - 1 posted before the work that does not need it."""

    def __init__(self, cp: CPContext, shape, dtype, device):
        self.cp = cp
        self.local = cp.prev_is_local   # from a chunk of this process: the sent tensor itself
        if replay.replaying():  # a recomputed block: what the first forward received
            self.buffer, self.work = replay.replay(), None
            return
        if cp.loopback is not None and self.local:
            self.buffer, self.work = cp.loopback.take(cp.rank - 1), None
            replay.record(self.buffer)
            return
        self.buffer = torch.empty(shape, dtype=dtype, device=device)
        self.work = links.irecv(self.buffer, cp.global_rank(cp.rank - 1), cp.group)
        replay.record(self.buffer)

    def _wait(self) -> None:
        if self.work is not None:
            self.work.wait()

    def wait(self, *anchors: torch.Tensor) -> torch.Tensor:
        """The received tensor, differentiable: its gradient is sent back to rank r - 1.

        `anchors` are inputs of the op that may require grad; they only connect the receive to the
        autograd graph (their gradient from here is zero).
        """
        self._wait()
        grads_wanted = torch.is_grad_enabled() and any(a.requires_grad for a in anchors)
        if not grads_wanted or self.local:   # a loopback tensor carries its own autograd history
            return self.buffer
        return _ReceivedFromPrev.apply(self.buffer, self.cp, *anchors)


def post_recv_from_prev(cp: CPContext, shape, dtype, device) -> PendingRecv:
    return PendingRecv(cp, shape, dtype, device)


def send_to_next(cp: CPContext, tensor: torch.Tensor) -> torch.Tensor | None:
    """Start sending `tensor` to rank r + 1. Returns a zero token to add to the op's output (or None
    when no gradient is needed, or rank r + 1 is a chunk of this process: it gets `tensor` itself)."""
    if cp.loopback is not None and cp.next_is_local:
        if not replay.replaying():
            # a copy of a view (a halo), as _isend makes: the receiver keeps what it got until its
            # backward, and the view would keep the sender's whole tensor with it
            cp.loopback.put(cp.rank, tensor.clone() if _is_view_of_more(tensor) else tensor)
        return None
    if torch.is_grad_enabled() and tensor.requires_grad:
        return _SentToNext.apply(tensor, cp)
    _isend(cp, tensor.detach().contiguous(), cp.rank + 1)
    return None


class StateRelay:
    """The relay's four hand-overs, for kernels that call them from inside their own forward and
    backward (gdn_kernels' triton_gated_delta_rule): the incoming state (its receive posted early),
    the outgoing final state, and in the backward their gradients."""

    def __init__(self, cp: CPContext, incoming: PendingRecv | None):
        # hand-overs with a chunk of this process go through autograd instead (ops/gated_delta_rule/cp.py)
        self.cp, self.incoming = cp, incoming
        self.receives = incoming is not None and not incoming.local
        self.sends = cp.continues_to_next and not cp.next_is_local

    def receive_state(self) -> torch.Tensor:
        incoming = self._incoming()
        incoming._wait()
        return incoming.buffer

    def send_state(self, state: torch.Tensor) -> None:
        _isend(self.cp, state.detach().contiguous(), self.cp.rank + 1)
        self.meta = (state.shape, state.dtype, state.device)

    def receive_state_grad(self) -> torch.Tensor:
        shape, dtype, device = self.meta
        grad = torch.empty(shape, dtype=dtype, device=device)
        links.irecv(grad, self.cp.global_rank(self.cp.rank + 1), self.cp.group).wait()
        return grad

    def send_state_grad(self, grad: torch.Tensor) -> None:
        _isend(self.cp, grad.detach().to(self._incoming().buffer.dtype).contiguous(), self.cp.rank - 1)

    def _incoming(self) -> PendingRecv:
        if self.incoming is None:
            raise RuntimeError(f"CP rank {self.cp.rank} receives no state (no document continues from rank "
                               f"{self.cp.rank - 1}), yet one was asked for (relay.receives is False)")
        return self.incoming


def tie(output: torch.Tensor, token: torch.Tensor | None) -> torch.Tensor:
    """Make the backward of `output` pass through a send's gradient receive (no copy of `output`)."""
    return output if token is None else _Tie.apply(output, token)


class _Tie(torch.autograd.Function):
    """Identity on `output` that also makes autograd visit `token`'s node (adding a zero token would
    cost a pass over the whole output, forward and backward)."""

    @staticmethod
    def forward(ctx, output, token):
        ctx.token_meta = (token.dtype, token.device)
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad):
        dtype, device = ctx.token_meta
        return grad, torch.zeros((), dtype=dtype, device=device)


def _is_view_of_more(tensor: torch.Tensor) -> bool:
    return tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size()


def _isend(cp: CPContext, tensor: torch.Tensor, dst: int) -> None:
    if replay.replaying():  # the receiver replays what it got in the first forward
        return
    if _is_view_of_more(tensor):
        # A send holds its tensor until the step's sends are finished; a view (a halo, the last
        # document's state) would hold the whole storage behind it. Under full activation
        # checkpointing that pinned every layer's conv inputs on all but the last CP rank until
        # the end of the step: the CP=2 step's extra 10 GB at 64K tokens per rank.
        tensor = tensor.clone()
    cp.outbox.post(links.isend(tensor, cp.global_rank(dst), cp.group))


class _ReceivedFromPrev(torch.autograd.Function):
    @staticmethod
    def forward(ctx, buffer, cp, *anchors):
        ctx.cp = cp
        ctx.num_anchors = len(anchors)
        return buffer.clone()

    @staticmethod
    def backward(ctx, grad):
        _isend(ctx.cp, grad.contiguous(), ctx.cp.rank - 1)
        return (None, None) + (None,) * ctx.num_anchors


class _SentToNext(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, cp):
        ctx.cp = cp
        ctx.meta = (tensor.shape, tensor.dtype, tensor.device)
        _isend(cp, tensor.detach().contiguous(), cp.rank + 1)
        return tensor.new_zeros(())

    @staticmethod
    def backward(ctx, _unused):
        shape, dtype, device = ctx.meta
        grad = torch.empty(shape, dtype=dtype, device=device)
        links.irecv(grad, ctx.cp.global_rank(ctx.cp.rank + 1), ctx.cp.group).wait()
        return grad, None


class _AllGather(torch.autograd.Function):
    """All-gather along a new leading dim; backward sums every rank's gradient of the gathered
    tensor (all-reduce, which gloo supports unlike reduce-scatter) and keeps this rank's slice."""

    @staticmethod
    def forward(ctx, tensor, cp):
        ctx.cp = cp
        if replay.replaying():
            return replay.replay()
        out = [torch.empty_like(tensor) for _ in range(cp.size)]
        dist.all_gather(out, tensor.contiguous(), group=cp.group)
        gathered = torch.stack(out)
        replay.record(gathered)
        return gathered

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.cp.group)
        return grad[ctx.cp.rank], None


def all_gather(cp: CPContext, tensor: torch.Tensor) -> torch.Tensor:
    """[*] -> [cp.size, *], differentiable."""
    if cp.chunks > 1:  # the later chunks of this process have not run yet
        raise ValueError("an all-gather over sequence chunks run in turn cannot be: chunked recomputation "
                         "(train.recompute_chunks) takes sliding-window attention and the relay only")
    return _AllGather.apply(tensor, cp)
