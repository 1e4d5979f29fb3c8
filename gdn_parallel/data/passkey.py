"""Passkey retrieval (the single-needle S-NIAH-1 form): a 7-digit number stated once inside filler
text, asked for at the end. A model that answers it at every depth of a long context carries the
number across the whole sequence; under context parallelism, across ranks.

    task = PasskeyTask(ByteTokenizer())
    sample = task.sample(length=4096, depth=0.25, rng=random.Random(0))
    sample.ids[:sample.answer_start]    # the prompt; sample.ids[sample.answer_start:] the number

A sample is exactly `length` tokens: filler, the needle at `depth` of the filler (0: first, 1: just
before the question), more filler, the question, the answer. The pieces are tokenized one by one and
joined, so positions are exact for any tokenizer; the filler is cut at a token where it ends.
`documents` writes the same samples as text for training on the task (bytes: one token per byte).
"""
from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .text_tokenizer import ByteTokenizer

KEY_DIGITS = 7
# Plain, repetitive, and free of digits: nothing in the filler looks like the key.
FILLER = ("Rain moved slowly over the quiet valley. A cart rolled down the long road to the market. "
          "Birds settled in the tall trees by the water. The lamps in the village were lit one by one. ")
NEEDLE = "Note this: the secret code is {key}. Keep the secret code in mind. "
QUESTION = "Question: what is the secret code? Answer: the secret code is "


@dataclass(frozen=True)
class PasskeySample:
    ids: np.ndarray          # [length] token ids: prompt then answer
    answer_start: int        # index of the answer's first token
    needle_start: int        # index of the needle's first token
    needle_end: int          # one past its last token
    key: str
    depth: float

    @property
    def length(self) -> int:
        return len(self.ids)


class PasskeyTask:
    """Samples of the task for one tokenizer (anything with `encode_batch(texts) -> [ids]`)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._filler = self._encode(FILLER)
        self._question = self._encode(QUESTION)

    def _encode(self, text: str) -> np.ndarray:
        return np.asarray(self.tokenizer.encode_batch([text])[0], dtype=np.int64)

    def min_length(self) -> int:
        """The shortest sample: needle, question and answer with no filler."""
        key = "0" * KEY_DIGITS
        return len(self._encode(NEEDLE.format(key=key))) + len(self._question) + len(self._encode(key))

    def sample(self, length: int, depth: float, rng: random.Random) -> PasskeySample:
        if not 0.0 <= depth <= 1.0:
            raise ValueError(f"depth={depth}: the needle's depth is a fraction of the filler in [0, 1]")
        key = "".join(rng.choice("0123456789") for _ in range(KEY_DIGITS))
        needle, answer = self._encode(NEEDLE.format(key=key)), self._encode(key)
        filler_len = length - len(needle) - len(self._question) - len(answer)
        if filler_len < 0:
            raise ValueError(f"length={length} is shorter than the task itself ({self.min_length()} tokens)")
        filler = np.resize(self._filler, filler_len)   # repeated, cut at the token where it ends
        before = round(depth * filler_len)
        ids = np.concatenate([filler[:before], needle, filler[before:], self._question, answer])
        return PasskeySample(ids=ids, answer_start=length - len(answer), needle_start=before,
                             needle_end=before + len(needle), key=key, depth=depth)

    def grid(self, lengths: Sequence[int], depths: Sequence[float], per_cell: int,
             seed: int) -> list[PasskeySample]:
        """`per_cell` samples for every (length, depth), each cell from its own seed (a cell's samples
        do not change when the grid around it does)."""
        samples: list[PasskeySample] = []
        for length in lengths:
            for depth in depths:
                rng = random.Random(f"{seed}/{length}/{depth}")
                samples.extend(self.sample(length, depth, rng) for _ in range(per_cell))
        return samples


def documents(count: int, min_length: int, max_length: int, seed: int) -> list[str]:
    """`count` samples as text (UTF-8 byte length = tokens of the byte vocabulary), lengths uniform
    in [min_length, max_length], depths uniform: a training set for the task itself."""
    task = PasskeyTask(ByteTokenizer())
    if min_length < task.min_length() or max_length < min_length:
        raise ValueError(f"lengths {min_length}..{max_length}: need {task.min_length()} <= min <= max")
    rng = random.Random(seed)
    texts = []
    for _ in range(count):
        sample = task.sample(rng.randint(min_length, max_length), rng.random(), rng)
        texts.append(bytes(sample.ids.astype(np.uint8).tolist()).decode("utf-8"))
    return texts
