"""Training FLOPs of packed rows, for MFU: the work the model does on the documents it is given.

forward + backward = 3 x forward: 6 FLOPs per matmul parameter and token, plus each token mixer's own
work (MixerKind.flops_per_token: the attention scores over the keys a token sees, the GDN and KDA chunk
algorithms). A packed row's documents do not attend to each other, so a token of a document of length
L sees at most L keys: a row of 262,144 tokens cut into 30K-token documents does a ninth of the full
attention that one 262K-token document would. Counting the keys of the whole row instead (as
Megatron-LM's and torchtitan's FLOP counts do) reads above what the hardware did once documents are
shorter than the row: at 256K tokens, kimi-1.3b's MFU by that count was over 70% on an H200.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cached_property

from ..config import ModelConfig
from .mixers import mixer_flops_per_token


@dataclass(frozen=True)
class TrainingFlops:
    """The whole model's training FLOPs (every pipeline stage's), given its matmul parameter count."""
    config: ModelConfig
    matmul_params: int

    def per_token(self, seq_len: int) -> float:
        """A row that is one document of `seq_len` tokens, per token."""
        return self.of_pieces([seq_len]) / seq_len

    def of_pieces(self, lengths: Iterable[int]) -> float:
        """Packed pieces (documents cut at row ends) of these lengths; each attends within itself."""
        tokens, mixer = 0, 0.0
        for length, count in Counter(int(n) for n in lengths).items():
            tokens += length * count
            mixer += length * count * self._mixers(length)
        return 6.0 * self.matmul_params * tokens + 3.0 * mixer

    @cached_property
    def _layers(self) -> Counter:
        """How many layers of each mixer the model has (counted once: `of_pieces` runs every step)."""
        return Counter(self.config.layer_types)

    def _mixers(self, length: int) -> float:
        """Every layer's mixer work per token of a piece of `length` tokens."""
        return sum(count * mixer_flops_per_token(symbol, self.config, length)
                   for symbol, count in self._layers.items())
