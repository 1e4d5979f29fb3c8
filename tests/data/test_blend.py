"""data.blend: the config rule, shares of the realised tokens against the weights at every point of
the stream, determinism, resume mid-blend under another layout (the stream, and the trainer's
checkpoint), loading any source kinds."""
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from gdn_parallel.config import Config, ConfigError, DataConfig
from gdn_parallel.data import BlendedDocuments, Documents, TokenBatches, check_vocabulary, load_dataset
from gdn_parallel.data.blend import blend_quotas
from tests.data.megatron_builder import random_megatron_documents, write_megatron
from tests.seeds import generator, seeded

REPO = Path(__file__).resolve().parents[2]
# Source s's token ids are SOURCE_BASE * s + a document number: a token tells its source.
SOURCE_BASE = 10_000


def source_documents(source: int, count: int, longest: int, seed: int) -> Documents:
    gen = generator(seed)
    lengths = torch.randint(1, longest, (count,), generator=gen).tolist()
    return Documents.from_sequences([torch.full((n,), SOURCE_BASE * source + i)
                                     for i, n in enumerate(lengths)])


def three_sources():
    return [source_documents(0, 9, 50, 1), source_documents(1, 40, 20, 2), source_documents(2, 4, 150, 3)]


def global_tokens(blend, tokens: int, seed: int, seq_len=16, rows=2) -> torch.Tensor:
    """The first `tokens` tokens of the blend's global stream (one replica)."""
    stream = TokenBatches(blend, seq_len, rows, seed=seed)
    batches = math.ceil(tokens / (seq_len * rows))
    return torch.cat([next(stream).input_ids[0] for _ in range(batches)])[:tokens]


def test_config_takes_pairs_and_one_way_of_naming_the_data():
    config = Config().with_overrides(["data.source=''", "data.blend=[[7, a_text_document], [0.3, stdlib]]"])
    config.validate()
    assert config.data.blend == [[7.0, "a_text_document"], [0.3, "stdlib"]]
    with pytest.raises(ConfigError, match=r"data\.blend and data\.source='stdlib' both name the data.*"
                                          r"data\.source=''"):
        Config().with_overrides(["data.blend=[[1, stdlib]]"]).validate()
    with pytest.raises(ConfigError, match=r"data\.source='' names no data.*data\.blend"):
        DataConfig(source="").validate()
    for bad, where in (("[[0, a]]", r"data\.blend\[0\]"), ("[[1, a], [-2, b]]", r"data\.blend\[1\]"),
                       ("[[1, '']]", r"data\.blend\[0\]"), ("[[1, a, 2]]", r"data\.blend\[0\]"),
                       ("[[true, a]]", r"data\.blend\[0\]"), ("[[.nan, a]]", r"data\.blend\[0\]"),
                       ("a", r"data\.blend='a' must be a list")):
        with pytest.raises(ConfigError, match=where):
            DataConfig(source="", blend=yaml.safe_load(bad)).validate()


def test_quotas_follow_the_weights_in_whole_tokens():
    quotas = blend_quotas([0.5, 0.3, 0.2], 1001)
    assert quotas.sum() == 1001 and np.all(np.abs(quotas - np.array([0.5, 0.3, 0.2]) * 1001) < 1)
    assert blend_quotas([1, 1, 1], 10).tolist() == [4, 3, 3]          # remainders: the first source first
    with pytest.raises(ValueError, match="source 1's share .* rounds to no token"):
        blend_quotas([1.0, 1e-9], 1000)


@pytest.mark.parametrize("weights", [(0.5, 0.3, 0.2), (1, 1, 8), (0.05, 0.9, 0.05)])
def test_realised_shares_follow_the_weights_at_every_token(weights):
    """At every prefix of the stream source s's tokens differ from its share of all tokens by less than
    its share of one document of each other source, or than one of its own; each blend epoch exactly."""
    blend = BlendedDocuments(three_sources(), weights)
    epoch, quotas = blend.num_tokens, blend.quotas
    tokens = global_tokens(blend, 6 * epoch + 123, seeded(7))
    source = (tokens // SOURCE_BASE).numpy()
    prefix = np.arange(1, tokens.numel() + 1)
    longest = [int(documents.lengths.max()) for documents in blend.sources]
    for s, quota in enumerate(quotas.tolist()):
        taken = np.cumsum(source == s)
        share = quota / epoch                       # weights[s] / sum(weights) to under one token per epoch
        deviation = taken - share * prefix
        assert deviation.max() <= (1 - share) * longest[s] + 1e-9
        assert deviation.min() >= -share * (sum(longest) - longest[s]) - 1e-9
        assert [int(taken[e * epoch - 1]) for e in range(1, 7)] == [e * quota for e in range(1, 7)]
        assert abs(quota - weights[s] / sum(weights) * epoch) < 1


def test_each_source_reads_every_document_before_any_again():
    """A source's tokens in the blend are its own shuffled stream (epochs of every document once)."""
    blend = BlendedDocuments(three_sources(), (0.2, 0.2, 0.6))
    tokens = global_tokens(blend, 4 * blend.num_tokens, seeded(8))
    for s, documents in enumerate(blend.sources):
        own = tokens[tokens // SOURCE_BASE == s] - SOURCE_BASE * s
        per_epoch = documents.num_tokens
        for start in range(0, own.numel() - per_epoch + 1, per_epoch):
            counts = torch.bincount(own[start:start + per_epoch], minlength=len(documents))
            assert torch.equal(counts, torch.from_numpy(documents.lengths)), f"source {s}"


def test_the_stream_is_fixed_by_the_seed_and_one_source_is_its_plain_stream():
    sources = three_sources()
    blend = BlendedDocuments(sources, (0.5, 0.3, 0.2))
    first = global_tokens(blend, 2000, seeded(9))
    assert torch.equal(first, global_tokens(BlendedDocuments(sources, (0.5, 0.3, 0.2)), 2000, seeded(9)))
    assert not torch.equal(first, global_tokens(blend, 2000, seeded(9) + 1))
    alone = BlendedDocuments(sources[:1], (3.0,))
    assert torch.equal(global_tokens(alone, 3000, seeded(9)), global_tokens(sources[0], 3000, seeded(9)))


# (dp, rows, seq_len) when saved -> when resumed
@pytest.mark.parametrize("before,after", [((2, 3, 29), (3, 2, 29)), ((1, 2, 16), (4, 1, 40))])
def test_resume_mid_blend_continues_the_uninterrupted_stream(before, after):
    blend = BlendedDocuments(three_sources(), (0.5, 0.3, 0.2))
    seed = seeded(10)
    dp, rows, seq_len = before
    old = [TokenBatches(blend, seq_len, rows, dp_rank=r, dp_size=dp, seed=seed) for r in range(dp)]
    steps = math.ceil(1.5 * blend.num_tokens / (dp * rows * seq_len))          # into the second blend epoch
    seen = [[next(s) for _ in range(steps)] for s in old]
    state = json.loads(json.dumps(old[0].state_dict()))
    assert state["epoch"] == 1 and state["tokens_into_epoch"] > 0 and len(state["blend"]) == 3
    dp, rows, seq_len = after
    again = BlendedDocuments(three_sources(), (0.5, 0.3, 0.2))          # as a restarted job builds it
    new = [TokenBatches(again, seq_len, rows, dp_rank=r, dp_size=dp, seed=seed) for r in range(dp)]
    for s in new:
        s.load_state_dict(state)
    more = [[next(s) for _ in range(40)] for s in new]
    whole = torch.cat([seen[r][k].input_ids[0] for k in range(steps) for r in range(len(seen))]
                      + [more[r][k].input_ids[0] for k in range(40) for r in range(dp)])
    assert torch.equal(whole, global_tokens(blend, whole.numel(), seed))


def test_a_state_of_another_blend_is_refused():
    state = TokenBatches(BlendedDocuments(three_sources(), (0.5, 0.3, 0.2)), 8, 1).state_dict()
    other = TokenBatches(BlendedDocuments(three_sources(), (0.3, 0.5, 0.2)), 8, 1)
    with pytest.raises(ConfigError, match=r"blend sources as \[quota, documents, tokens\].*data\.blend"):
        other.load_state_dict(state)
    plain = TokenBatches(three_sources()[0], 8, 1).state_dict()
    with pytest.raises(ConfigError, match="data.blend"):
        other.load_state_dict(plain)


def write_texts(root, count, word):
    root.mkdir(parents=True)
    for i in range(count):
        (root / f"{word}{i}.txt").write_text(f"{word} {i} " * (i + 5))
    return str(root)


def test_load_dataset_blends_any_source_kinds(tmp_path):
    megatron = write_megatron(tmp_path / "m_text_document",
                              random_megatron_documents(30, seeded(15), high=200))
    texts = write_texts(tmp_path / "texts", 12, "word")
    config = DataConfig(source="", blend=[[3, megatron], [1, texts]], val_fraction=0.2)
    dataset = load_dataset(config)
    assert dataset.kind == "blend" and [part.kind for part in dataset.parts] == ["megatron", "bytes"]
    assert isinstance(dataset.train, BlendedDocuments) and isinstance(dataset.val, BlendedDocuments)
    assert dataset.train.num_tokens == sum(part.train.num_tokens for part in dataset.parts)
    assert "75.0% " in dataset.describe() and "25.0% " in dataset.describe()
    batch = next(TokenBatches.from_config(config, 32, 2, dataset=dataset))
    assert batch.num_tokens == 64
    assert next(TokenBatches.from_config(config, 32, 2, split="val", dataset=dataset)).num_tokens == 64
    check_vocabulary(config, 256)
    with pytest.raises(ConfigError, match=r"model\.vocab_size=200 .*data\.blend\[1\]: .*read as bytes"):
        check_vocabulary(config, 200)


def test_blend_sources_are_named_in_errors_and_validation_gaps_are_said(tmp_path):
    texts = write_texts(tmp_path / "texts", 12, "word")
    single = write_texts(tmp_path / "single", 1, "only")                # no validation document
    with pytest.raises(ConfigError, match=r"data\.blend\[1\]: data\.source=.*nope.* does not exist"):
        load_dataset(DataConfig(source="", blend=[[1, texts], [1, str(tmp_path / "nope")]]))
    dataset = load_dataset(DataConfig(source="", blend=[[1, texts], [1, single]], val_fraction=0.3))
    assert len(dataset.val.sources) == 1
    assert "data.blend[1] without validation documents" in dataset.describe()


def test_sources_of_different_tokenizers_are_refused(tmp_path):
    from gdn_parallel.data.prepared import METADATA_FILE
    from tools.prepare_data import main as prepare_data
    texts = write_texts(tmp_path / "texts", 4, "word")
    out = tmp_path / "prepared"
    assert prepare_data([texts, "--out", str(out), "--progress", "off"]) == 0
    metadata = json.loads((out / METADATA_FILE).read_text())
    metadata["tokenizer"] = {"kind": "tokenizers", "file": "bpe.json", "sha256": "ab" * 32}
    (out / METADATA_FILE).write_text(json.dumps(metadata))
    with pytest.raises(ConfigError, match=r"data\.blend mixes ids of different tokenizers \(data\.blend\[0\] "
                                          r"by bytes, data\.blend\[1\] by tokenizers bpe\.json"):
        load_dataset(DataConfig(source="", blend=[[1, texts], [1, str(out)]]))


def test_training_on_a_blend_resumes_exactly(tmp_path):
    """The trainer saves the blend's position with the checkpoint: steps 2-3 resumed from step 2 are
    the uninterrupted run's (the same losses)."""
    import shutil

    from gdn_parallel.train.trainer import run_training
    sources = [write_texts(tmp_path / "short", 20, "short"),
               write_texts(tmp_path / "long", 8, "longer words")]
    overrides = ["model.n_layers=2", "train.seq_len=64", "train.batch_size=2", "train.steps=4",
                 "train.warmup_steps=1", "train.eval_rows=2", "checkpoint.interval=2", "data.source=''",
                 f"data.blend=[[0.6, {sources[0]}], [0.4, {sources[1]}]]"]

    def train(out_dir, resume=None):
        config = Config.from_yaml(REPO / "configs" / "tiny-cpu.yaml",
                                  overrides + [f"train.out_dir={out_dir}"])
        return run_training(config, print_fn=lambda line: None, resume=resume)

    straight = train(tmp_path / "straight")
    checkpoint = Path("checkpoints") / "step_2"
    shutil.copytree(tmp_path / "straight" / checkpoint, tmp_path / "resumed" / checkpoint)
    resumed = train(tmp_path / "resumed", resume="auto")
    assert resumed["start_step"] == 2 and resumed["losses"] == straight["losses"][2:]
    saved = json.loads((tmp_path / "straight" / checkpoint / "trainer_state.json").read_text())
    assert saved["data"]["stream"]["tokens_into_epoch"] == 256 and len(saved["data"]["stream"]["blend"]) == 2
