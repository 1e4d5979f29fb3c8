"""A small byte-level BPE tokenizer (as GPT-2's and Llama 3's are built: bos and eos around every
document by its post-processor) and a dataset prepared with it by tools/prepare_data.py, for the tests
of val_bpb and of Hugging Face exports."""
from pathlib import Path

import pytest

WORDS = ("the quick brown fox jumps over a lazy dog while naïve café owners sing déjà vu and 😀 emoji "
         "rivers mountains gated delta networks forget remember state").split()
BOS, EOS, PAD = "<s>", "</s>", "<pad>"


def texts(count: int = 60, seed: int = 0) -> list[str]:
    """Documents of 8 to 40 words, some starting or ending with spaces (offsets with gaps)."""
    import random
    rng = random.Random(seed)
    made = []
    for i in range(count):
        words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 40)))
        made.append((" " if i % 7 == 0 else "") + words + ("\n" if i % 3 == 0 else "."))
    return made


def byte_level_bpe(path: Path, documents: list[str], vocab_size: int = 300):
    """Trains, saves at `path` and returns the tokenizer (ids 0, 1, 2: <s>, </s>, <pad>)."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers
    tokenizer = tokenizers.Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[BOS, EOS, PAD],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(documents, trainer)
    tokenizer.post_processor = processors.TemplateProcessing(single=f"{BOS} $A {EOS}",
                                                             special_tokens=[(BOS, 0), (EOS, 1)])
    tokenizer.save(str(path))
    return tokenizer


def prepare_bpe_dataset(root: Path, documents: list[str], *extra: str) -> Path:
    """root/tokenizer.json and root/data (prepared from root/in/docs.jsonl with it); returns root/data."""
    import json

    import tools.prepare_data as tool
    (root / "in").mkdir(parents=True)
    byte_level_bpe(root / "tokenizer.json", documents)
    (root / "in" / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in documents))
    out = root / "data"
    assert tool.main([str(root / "in"), "--out", str(out), "--tokenizer", str(root / "tokenizer.json"),
                      "--pad-token", PAD, "--progress", "off", *extra]) == 0
    return out
