"""Data: the real datasets library on real files in tmp_path, offline, and the step order
checked against its definition (positions -> per-epoch permutations)."""

from __future__ import annotations

import json
import math
import socket

import datasets
import numpy as np
import pytest
import torch

from stabilize.data import (
    DEFAULT_TOKENIZER,
    TOKENIZERS,
    ByteTokenizer,
    DataConfig,
    PackedBlocks,
    StepSampler,
    Tokenizer,
    bits_per_byte,
    build_dataloaders,
    build_tokenizer,
    embedded_corpus,
    epoch_permutation,
    load_corpus,
    register_tokenizer,
    split_stream,
    tokenize,
    unregister_tokenizer,
)
from stabilize.validate import ConfigError

DOCS = [
    "The quick brown fox jumps over the lazy dog.\nA second line.",
    "Café, naïve, Übermaß — and 日本語 too 🙂",
    "third document\n\n\nwith a paragraph break inside",
]
TEXT = "\n\n".join(DOCS)
TOK = ByteTokenizer()


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """No network, and the datasets cache inside tmp_path. datasets reads its environment at
    import time, so the module-level config is patched as well as the variables."""
    cache = tmp_path / "hf_cache"
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(cache))
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)

    real_connect = socket.socket.connect

    def refuse(self, address, *args):
        if self.family in (socket.AF_INET, socket.AF_INET6):  # AF_UNIX: DataLoader workers
            raise AssertionError(f"network access attempted: {address}")
        return real_connect(self, address, *args)

    monkeypatch.setattr(socket.socket, "connect", refuse)
    return cache


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def stream_of(cfg):
    return tokenize(load_corpus(cfg), TOK, cfg.text_field)


# ---- tokenizer ---------------------------------------------------------------------------
def test_byte_tokenizer_round_trips_non_ascii():
    ids = TOK.encode(TEXT)
    assert ids.dtype.name == "uint8" and len(ids) == len(TEXT.encode("utf-8")) > len(TEXT)
    assert TOK.decode(ids) == TEXT
    assert TOK.decode(torch.from_numpy(ids).long()) == TEXT
    assert TOK.decode(list(TOK.encode("é"))[:1]) == "\ufffd"  # half a character: replaced
    with pytest.raises(ValueError, match=r"\[0, 255\]"):
        TOK.decode([300])


class ShiftedBytes:
    """A tokenizer from outside the package: byte b is id b + 300 (ids need int16)."""

    vocab_size = 556

    def encode(self, text):
        return TOK.encode(text).astype(np.int16) + 300

    def decode(self, seq):
        return TOK.decode(np.asarray(seq) - 300)


@pytest.fixture
def shifted():
    register_tokenizer("shifted")(ShiftedBytes)
    yield "shifted"
    unregister_tokenizer("shifted")


def test_tokenizer_registry_builds_by_name_and_lists_the_registered(shifted):
    assert isinstance(build_tokenizer(), ByteTokenizer) and DEFAULT_TOKENIZER == "bytes"
    assert isinstance(build_tokenizer("bytes"), Tokenizer)
    tok = build_tokenizer(shifted)
    assert isinstance(tok, ShiftedBytes) and isinstance(tok, Tokenizer)
    with pytest.raises(ValueError, match=r"tokenizer='bpe' is not allowed; allowed: \['bytes', "):
        build_tokenizer("bpe")
    register_tokenizer(shifted)(ShiftedBytes)  # the same class again: a no-op
    with pytest.raises(ValueError, match="'bytes' is already registered"):
        register_tokenizer("bytes")(ShiftedBytes)
    assert TOKENIZERS["bytes"] is ByteTokenizer


def test_registered_tokenizer_feeds_the_loaders(shifted, offline):
    cfg = DataConfig(max_chars=5_000, batch_size=2, val_fraction=0.1)
    stream = tokenize(embedded_corpus(max_chars=5_000), build_tokenizer(shifted))
    assert stream.dtype == torch.int16  # vocab 556 does not fit uint8
    assert torch.equal(stream.long() - 300, stream_of(cfg).long())
    train, _ = build_dataloaders(cfg, 16, num_steps=2, tokenizer=build_tokenizer(shifted))
    x, y = next(iter(train))
    assert x.dtype == torch.long and int(x.min()) >= 300 and int(x.max()) < 556
    assert torch.equal(x[:, 1:], y[:, :-1])


# ---- corpora -----------------------------------------------------------------------------
def test_embedded_corpus_is_real_english_and_offline(offline):
    ds = embedded_corpus()
    texts = list(ds["text"])
    n_chars = sum(map(len, texts))
    assert n_chars >= 400_000 and len(texts) >= 50
    joined = "\n\n".join(texts)
    words = joined.lower().split()
    # Prose, not code or noise: the commonest English words are frequent.
    for w in ("the", "is", "of", "and", "a", "to"):
        assert words.count(w) > 500, w
    assert sum(c.isalpha() or c.isspace() for c in joined) / len(joined) > 0.8
    assert list(embedded_corpus()["text"]) == texts  # deterministic
    capped = embedded_corpus(max_chars=10_000)
    assert sum(map(len, capped["text"])) == 10_000
    assert "".join(capped["text"]) == "".join(texts)[:10_000]
    assert not offline.exists()  # built in memory: nothing cached


def test_local_txt_jsonl_parquet_give_the_same_stream(tmp_path, offline):
    expected = torch.from_numpy(TOK.encode(TEXT))
    (tmp_path / "a.txt").write_text(TEXT, encoding="utf-8")
    write_jsonl(tmp_path / "a.jsonl", [{"text": d, "id": i} for i, d in enumerate(DOCS)])
    datasets.Dataset.from_dict({"text": DOCS}).to_parquet(str(tmp_path / "a.parquet"))
    for name in ("a.txt", "a.jsonl", "a.parquet"):
        stream = stream_of(DataConfig(source="local", paths=[str(tmp_path / name)]))
        assert stream.dtype == torch.uint8
        assert torch.equal(stream, expected), name
    # Several files: read in the order given, joined like documents.
    write_jsonl(tmp_path / "b.jsonl", [{"text": "tail document"}])
    cfg = DataConfig(source="local", paths=[str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")])
    assert TOK.decode(stream_of(cfg)) == TEXT + "\n\ntail document"
    capped = DataConfig(source="local", paths=[str(tmp_path / "a.jsonl")], max_chars=70)
    assert TOK.decode(stream_of(capped)) == DOCS[0] + "\n\n" + DOCS[1][: 70 - len(DOCS[0])]
    assert offline.exists()  # the cache went where the fixture pointed it


def test_missing_text_field_names_the_columns(tmp_path, offline):
    path = write_jsonl(tmp_path / "c.jsonl", [{"content": "hello", "id": 1}])
    cfg = DataConfig(source="local", paths=[str(path)])
    with pytest.raises(ValueError, match=r"data.text_field='text'.*\['content', 'id'\]"):
        load_corpus(cfg)
    assert TOK.decode(stream_of(DataConfig(**{**vars(cfg), "text_field": "content"}))) == "hello"


def test_hub_path_reads_a_local_dataset_directory(tmp_path, offline):
    expected = torch.from_numpy(TOK.encode(TEXT))
    pq = tmp_path / "pq_repo"
    pq.mkdir()
    datasets.Dataset.from_dict({"text": DOCS[:2]}).to_parquet(str(pq / "train-0.parquet"))
    datasets.Dataset.from_dict({"text": DOCS[2:]}).to_parquet(str(pq / "train-1.parquet"))
    assert torch.equal(stream_of(DataConfig(source="hub", name=str(pq))), expected)
    js = tmp_path / "json_repo"
    js.mkdir()
    write_jsonl(js / "train.jsonl", [{"text": d} for d in DOCS])
    write_jsonl(js / "test.jsonl", [{"text": "held out"}])
    assert torch.equal(stream_of(DataConfig(source="hub", name=str(js))), expected)
    assert TOK.decode(stream_of(DataConfig(source="hub", name=str(js), split="test"))) == (
        "held out"
    )


def test_hub_path_reads_save_to_disk_directories(tmp_path, offline):
    ds = datasets.Dataset.from_dict({"text": DOCS})
    ds.save_to_disk(str(tmp_path / "saved"))
    cfg = DataConfig(source="hub", name=str(tmp_path / "saved"))
    assert TOK.decode(stream_of(cfg)) == TEXT
    other = datasets.Dataset.from_dict({"text": ["validation text"]})
    datasets.DatasetDict(train=ds, validation=other).save_to_disk(str(tmp_path / "dd"))
    cfg = DataConfig(source="hub", name=str(tmp_path / "dd"), split="validation")
    assert TOK.decode(stream_of(cfg)) == "validation text"
    with pytest.raises(ValueError, match=r"data.split='test'.*\['train', 'validation'\]"):
        load_corpus(DataConfig(source="hub", name=str(tmp_path / "dd"), split="test"))


def test_unreachable_hub_name_fails_fast_offline_with_a_hint(offline):
    # offline is a setting of this environment: a config error (exit 2), not a crash
    said = r"data.name='nobody/no-such-set'.*not in the local cache and the hub cannot be "
    with pytest.raises(ConfigError, match=said + r"reached \(offline.*data=embedded"):
        load_corpus(DataConfig(source="hub", name="nobody/no-such-set"))


# ---- packing and splitting ---------------------------------------------------------------
def test_packed_blocks_are_the_hand_computed_windows():
    stream = torch.arange(23, dtype=torch.uint8)
    blocks = PackedBlocks(stream, 5)
    assert len(blocks) == 4  # (23 - 1) // 5
    x, y = blocks[0]
    assert x.dtype == y.dtype == torch.int64
    assert x.tolist() == [0, 1, 2, 3, 4] and y.tolist() == [1, 2, 3, 4, 5]
    x, y = blocks[3]
    assert x.tolist() == [15, 16, 17, 18, 19] and y.tolist() == [16, 17, 18, 19, 20]
    with pytest.raises(IndexError):
        blocks[4]
    assert len(PackedBlocks(stream[:5], 5)) == 0 and len(PackedBlocks(stream[:6], 5)) == 1


def test_split_is_contiguous_with_the_right_sizes():
    stream = torch.randint(0, 256, (1000,), dtype=torch.uint8)
    train, val = split_stream(stream, 0.1)
    assert (len(train), len(val)) == (900, 100)
    assert torch.equal(torch.cat([train, val]), stream) and torch.equal(val, stream[900:])
    train, val = split_stream(stream, 0.0)
    assert len(train) == 1000 and len(val) == 0


# ---- the step-indexed order --------------------------------------------------------------
def batches(n, b, seed, rank=0, world=1, start=0, steps=10):
    return list(StepSampler(n, b, seed, rank, world, start, num_steps=steps))


def test_sampler_is_deterministic_and_seeded():
    assert batches(50, 4, seed=1) == batches(50, 4, seed=1)
    assert batches(50, 4, seed=1) != batches(50, 4, seed=2)
    s = StepSampler(50, 4, 1, num_steps=10)
    assert len(s) == 10 and s.batch_for_step(3) == batches(50, 4, seed=1)[3]


def test_sampler_visits_every_item_once_per_epoch_one_and_two_ranks():
    one = batches(20, 4, seed=7, steps=10)  # 5 steps per epoch
    for e in range(2):
        epoch = [i for b in one[5 * e : 5 * e + 5] for i in b]
        assert sorted(epoch) == list(range(20))
        assert epoch == epoch_permutation(20, 7, e).tolist()
    r0, r1 = (batches(24, 3, seed=7, rank=r, world=2, steps=4) for r in (0, 1))
    for a, b in zip(r0, r1, strict=True):
        assert not set(a) & set(b)  # ranks disjoint within a global step
    union = [i for a, b in zip(r0, r1, strict=True) for i in a + b]
    assert sorted(union) == list(range(24))


def test_sampler_global_order_does_not_depend_on_how_it_is_cut():
    # Positions (s*W + r)*B + j enumerate one global sequence: W=2,B=3 equals W=1,B=6.
    r0, r1 = (batches(10, 3, seed=3, rank=r, world=2, steps=7) for r in (0, 1))
    two_ranks = [i for a, b in zip(r0, r1, strict=True) for i in a + b]
    assert two_ranks == [i for b in batches(10, 6, seed=3, steps=7) for i in b]


def test_sampler_resumes_with_the_exact_tail():
    full = batches(30, 4, seed=5, rank=1, world=2, steps=12)
    for k in (0, 3, 7, 12):
        assert batches(30, 4, seed=5, rank=1, world=2, start=k, steps=12) == full[k:]


def test_sampler_crosses_epoch_boundaries():
    # n=7, B=3: batches straddle epochs; every run of 7 positions is one fresh permutation.
    flat = [i for b in batches(7, 3, seed=11, steps=14) for i in b]
    epochs = [flat[7 * e : 7 * e + 7] for e in range(6)]
    for e, chunk in enumerate(epochs):
        assert chunk == epoch_permutation(7, 11, e).tolist()
    assert len({tuple(c) for c in epochs}) > 1
    # A batch larger than the data wraps more than once.
    b = StepSampler(4, 9, 0, num_steps=1).batch_for_step(0)
    assert len(b) == 9 and sorted(b[:4]) == sorted(b[4:8]) == [0, 1, 2, 3]


# ---- loaders -----------------------------------------------------------------------------
def test_loaders_pack_and_shard(offline):
    cfg = DataConfig(max_chars=20_000, batch_size=4, val_fraction=0.2)
    train, val = build_dataloaders(cfg, 32, num_steps=5)
    assert len(train) == 5
    x, y = next(iter(train))
    assert x.shape == y.shape == (4, 32) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    stream = tokenize(embedded_corpus(max_chars=20_000), TOK, "text")
    _, val_stream = split_stream(stream, 0.2)
    val_blocks = PackedBlocks(val_stream, 32)
    all_val = [xb for xb, _ in val]
    assert sum(len(b) for b in all_val) == len(val_blocks)  # drop_last False: the tail too
    assert torch.equal(
        torch.cat(all_val), torch.stack([val_blocks[i][0] for i in range(len(val_blocks))])
    )
    # Two ranks, 5 val batches: rank 0 takes 0, 2, 4 and rank 1 takes 1, 3; no overlap.
    vals = (
        build_dataloaders(cfg, 32, rank=r, world_size=2, num_steps=5, val_batches=5)[1]
        for r in (0, 1)
    )
    shards = [[xb for xb, _ in v] for v in vals]
    assert [len(s) for s in shards] == [3, 2]
    for r, shard in enumerate(shards):
        for k, xb in enumerate(shard):
            assert torch.equal(xb, all_val[r + 2 * k])
    # Train batches of the two ranks at the same step never share a block.
    t0, t1 = (build_dataloaders(cfg, 32, rank=r, world_size=2, num_steps=3)[0] for r in (0, 1))
    for s0, s1 in zip(t0.batch_sampler, t1.batch_sampler, strict=True):
        assert not set(s0) & set(s1)


def test_resumed_loader_and_worker_processes_give_the_same_batches(offline):
    cfg = DataConfig(max_chars=8_000, batch_size=2)
    full = [x for x, _ in build_dataloaders(cfg, 16, num_steps=6)[0]]
    tail = [x for x, _ in build_dataloaders(cfg, 16, start_step=4, num_steps=6)[0]]
    assert all(torch.equal(a, b) for a, b in zip(full[4:], tail, strict=True))
    cfg_w = DataConfig(max_chars=8_000, batch_size=2, num_workers=1)
    workers = [x for x, _ in build_dataloaders(cfg_w, 16, num_steps=6)[0]]
    assert all(torch.equal(a, b) for a, b in zip(full, workers, strict=True))


def test_too_small_corpus_says_how_small(offline):
    with pytest.raises(ValueError, match=r"too small: 48 train tokens.*needs 129"):
        build_dataloaders(DataConfig(max_chars=50), 128, num_steps=1)
    with pytest.raises(ValueError, match=r"data.val_fraction=0.01.*Raise data.val_fraction"):
        build_dataloaders(DataConfig(max_chars=2000, val_fraction=0.01), 64, num_steps=1)


def test_bits_per_byte():
    assert bits_per_byte(math.log(2)) == pytest.approx(1.0)
    assert bits_per_byte(math.log(256)) == pytest.approx(8.0)  # a uniform byte model


# ---- bad settings ------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(source="s3"), r"data.source='s3' .*allowed: \['embedded', 'local', 'hub'\]"),
        (dict(val_fraction=0.5), r"data.val_fraction=0.5 .*\[0.0, 0.5\)"),
        (dict(batch_size=0), r"data.batch_size=0 .*positive integer"),
        (dict(num_workers=-1), r"data.num_workers=-1 .*integer >= 0"),
        (dict(max_chars=0), r"data.max_chars=0 .*positive integer"),
        (dict(seed=-3), r"data.seed=-3 .*integer >= 0"),
        (dict(text_field=""), r"data.text_field='' .*non-empty"),
        (dict(source="local"), r"data.paths=\[\] .*'.parquet'"),
        (dict(source="hub"), r"data.name=None .*allowed: a dataset name or directory"),
        (dict(paths=["x.txt"]), r"data.paths=\['x.txt'\] .*data.source='embedded'"),
        (dict(name="wikitext"), r"data.name='wikitext'.*allowed: None"),
    ],
)
def test_bad_settings_name_key_value_and_allowed(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DataConfig(**kwargs)


def test_bad_local_paths(tmp_path):
    (tmp_path / "a.txt").write_text("x")
    (tmp_path / "b.jsonl").write_text("{}")
    (tmp_path / "c.csv").write_text("x")
    with pytest.raises(ValueError, match=r"suffix='.csv' is not allowed; allowed: \['.txt'"):
        DataConfig(source="local", paths=[str(tmp_path / "c.csv")])
    with pytest.raises(ValueError, match=r"no such file: .*missing.txt"):
        DataConfig(source="local", paths=[str(tmp_path / "missing.txt")])
    with pytest.raises(ValueError, match=r"mixes file types \['.jsonl', '.txt'\]"):
        DataConfig(source="local", paths=[str(tmp_path / "a.txt"), str(tmp_path / "b.jsonl")])
    assert DataConfig(source="local", paths=str(tmp_path / "a.txt")).paths == [
        str(tmp_path / "a.txt")
    ]


@pytest.mark.parametrize(
    "args, kwargs, match",
    [
        ((10, 2, 0), dict(rank=2, world_size=2, num_steps=1), r"rank=2 .*\[0, 1\]"),
        ((10, 2, 0), dict(start_step=5, num_steps=3), r"start_step=5 .*\[0, 3\]"),
        ((0, 2, 0), dict(num_steps=3), r"n_items=0 .*positive integer"),
        ((10, 2, 0), dict(world_size=0, num_steps=3), r"world_size=0 .*positive integer"),
        ((10, 2, 0), dict(rank=1, num_steps=3), r"rank=1 .*\[0, 0\]"),
        ((10, 2, 0), dict(start_step=1, num_steps=0), r"start_step=1 .*\[0, 0\]"),
    ],
)
def test_bad_sampler_settings(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        StepSampler(*args, **kwargs)


def test_bad_loader_settings(offline):
    with pytest.raises(ValueError, match=r"block_size=0 .*positive integer"):
        build_dataloaders(DataConfig(), 0, num_steps=1)
    with pytest.raises(ValueError, match=r"val_batches=-1 .*integer >= 0"):
        build_dataloaders(DataConfig(), 8, num_steps=1, val_batches=-1)
    # 0 means no validation (Lightning's limit_val_batches=0), even with several ranks.
    _, val = build_dataloaders(
        DataConfig(max_chars=5000), 8, world_size=4, num_steps=1, val_batches=0
    )
    assert len(val) == 0 and list(val) == []
