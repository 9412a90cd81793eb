"""Real corpora: tokenizers by name, trained and by path, the token cache shared by
ranks and launches, the corpus's own validation split, exact bits per byte, bad input.

Everything runs offline on real files in tmp_path: HF ``tokenizers`` trains the BPE, HF
``transformers`` saves the tokenizer directory, torchrun launches the ranks."""

from __future__ import annotations

import json
import logging
import math
import pickle

import datasets
import numpy as np
import pytest
import torch

from stabilize.data import (
    ByteTokenizer,
    DataConfig,
    build_dataloaders,
    choose_tokenizer,
    embedded_corpus,
    open_token_cache,
    stream_dtype,
    token_byte_counts,
    train_bpe,
)
from stabilize.model import GPT
from stabilize.train import run

from conftest import FAST, cli, compose_run, launch_sh, read_csv_metrics, series

TEXTS = list(embedded_corpus()["text"])  # CPython's pydoc topics: ~465k characters of prose


@pytest.fixture
def hf_cache(tmp_path, monkeypatch):
    """datasets' Arrow cache inside tmp_path (it reads the variable at import time)."""
    cache = tmp_path / "hf_cache"
    monkeypatch.setenv("HF_DATASETS_CACHE", str(cache))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    return cache


@pytest.fixture
def corpus_txt(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("\n\n".join(TEXTS), encoding="utf-8")  # ~470 KB
    return path


def local(path, tmp_path, **kw):
    return DataConfig(source="local", paths=[str(path)], cache_dir=str(tmp_path / "c"), **kw)


def build_lines(caplog):
    return [r.getMessage() for r in caplog.records if ": building (" in r.getMessage()]


# ---- the shared cache under torchrun ---------------------------------------------------------
@pytest.mark.slow  # ~40 s: two torchrun launches; one-rank BPE and two-rank runs stay in the suite
def test_two_ranks_train_bpe_through_one_cache_built_once_and_resume_exactly(tmp_path, corpus_txt):
    cache = tmp_path / "cache"
    common = [
        *[o for o in FAST if not o.startswith("trainer.progress")],
        "trainer.accelerator=cpu",
        "trainer.max_steps=8",
        "trainer.checkpoint_every_n_steps=4",
        "trainer.val_check_interval=4",
        "logger=none",
        "data=local",
        f"data.paths=[{corpus_txt}]",
        "data.tokenizer=bpe",
        "data.vocab_size=512",
        f"data.cache_dir={cache}",
    ]
    env = {"HF_DATASETS_CACHE": str(tmp_path / "hf_cache")}

    def launch(run_dir, *extra):
        r = launch_sh(run_dir, *common, *extra, cwd=tmp_path, env=env)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        logs = {p.name: p.read_text() for p in run_dir.glob("*.log")}
        assert len(logs) == 2, logs.keys()  # one per rank
        return logs

    full, cut = tmp_path / "full", tmp_path / "cut"
    first = launch(full)
    (entry,) = [p for p in (cache / "tokens").iterdir() if p.is_dir()]
    meta = json.loads((entry / "meta.json").read_text())
    stamp = (entry / "meta.json").stat().st_mtime_ns, (entry / "train.bin").stat().st_mtime_ns
    launch(cut, "trainer.stop_at_step=4")
    both = launch(cut, "resume=auto")  # a rank's log file holds both of its launches

    builds = [t.count(": building (") for logs in (first, both) for t in logs.values()]
    assert builds[:2] in ([1, 0], [0, 1]) and sum(builds) == 1  # one rank, first launch only
    mapped = f"token cache {entry.name}: memory-mapped"
    assert [t.count(mapped) for t in first.values()] == [1, 1]  # every rank mapped the entry
    assert [t.count(mapped) for t in both.values()] == [2, 2]  # again in each later launch
    assert stamp == (
        (entry / "meta.json").stat().st_mtime_ns,
        (entry / "train.bin").stat().st_mtime_ns,
    )
    assert meta["tokenizer"]["kind"] == "trained" and meta["dtype"] == "uint16"
    assert (entry / "tokenizer.json").is_file() and meta["built_by"]["rank"] in ("0", "1")
    saved = json.loads((full / "config.json").read_text())
    assert saved["model"]["vocab_size"] == 512  # followed the tokenizer (tiny's preset: 256)

    a, b = series(read_csv_metrics(full), "train/loss"), series(read_csv_metrics(cut), "train/loss")
    assert sorted(b) == list(range(8))
    for step in range(4, 8):
        assert abs(a[step] - b[step]) <= 1e-6, (step, a[step], b[step])
    bpb = series(read_csv_metrics(full), "val/bpb")
    assert len(bpb) == 2 and all(0 < v < 8 for v in bpb.values())


# ---- tokenizers --------------------------------------------------------------------------
def test_bpe_is_deterministic_and_round_trips(tmp_path, hf_cache, corpus_txt):
    c1 = open_token_cache(local(corpus_txt, tmp_path / "1", tokenizer="bpe", vocab_size=400))
    c2 = open_token_cache(local(corpus_txt, tmp_path / "2", tokenizer="bpe", vocab_size=400))
    assert (c1.path / "tokenizer.json").read_bytes() == (c2.path / "tokenizer.json").read_bytes()
    assert (c1.path / "train.bin").read_bytes() == (c2.path / "train.bin").read_bytes()
    assert c1.tokenizer.vocab_size == 400 and c1.train.array().dtype == np.uint16
    n = len(c1.train)
    assert n < 0.6 * len(corpus_txt.read_bytes())  # merges: fewer tokens than bytes
    head = c1.tokenizer.decode(c1.train[:2000].long())
    assert corpus_txt.read_text().startswith(head[:-5])  # the last token may be cut


def test_tokenizer_by_path_json_file_and_transformers_directory(tmp_path, hf_cache, corpus_txt):
    from transformers import PreTrainedTokenizerFast

    tok = train_bpe([TEXTS[:40]], 300)
    tok.save(tmp_path / "tok.json")
    PreTrainedTokenizerFast(tokenizer_object=tok.tok).save_pretrained(str(tmp_path / "hf_dir"))
    text = "Café — naïve 日本語 🙂 and the rest of the sentence."
    for name in (tmp_path / "tok.json", tmp_path / "hf_dir"):
        cfg = local(corpus_txt, tmp_path, tokenizer=str(name))
        choice = choose_tokenizer(cfg)
        assert choice.kind == "file" and choice.vocab_size == 300
        assert np.array_equal(choice.loaded.encode(text), tok.encode(text))
        assert choice.loaded.decode(choice.loaded.encode(text)) == text
        train, _ = build_dataloaders(cfg, 32, num_steps=1)
        x, _ = next(iter(train))
        assert int(x.max()) < 300 and x.dtype == torch.long
    with pytest.raises(ValueError, match="has no tokenizer.json"):
        choose_tokenizer(local(corpus_txt, tmp_path, tokenizer=str(tmp_path)))


def test_vocab_follows_the_tokenizer_and_a_mismatch_is_refused_before_anything(
    tmp_path, monkeypatch, capsys
):
    bpe = ["data.tokenizer=bpe", "data.vocab_size=700"]
    assert compose_run(tmp_path, bpe).model.vocab_size == 700  # tiny's 256 followed
    assert compose_run(tmp_path, [*bpe, "model=gpt-125m"]).model.vocab_size == 700
    assert compose_run(tmp_path, ["model=gpt-125m"]).model.vocab_size == 50257  # bytes: kept
    assert compose_run(tmp_path, [*bpe, "model.vocab_size=1024"]).model.vocab_size == 1024
    message = (
        "model.vocab_size=512 is not allowed with the 'bpe' tokenizer (ids 0 .. 699); "
        "allowed: >= 700"
    )
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        compose_run(tmp_path, [*bpe, "model.vocab_size=512"])
    run_dir = tmp_path / "cli"
    args = [*bpe, "model.vocab_size=512", f"hydra.run.dir={run_dir}"]
    code, err = cli(args, tmp_path, monkeypatch, capsys)
    assert code == 2 and message in err and "Traceback" not in err
    assert not (run_dir / "config.json").exists() and not (run_dir / "checkpoints").exists()
    # A data error at start-up: one line too (the CLI prints ConfigErrors, exit code 2).
    args = ["data.tokenizer=./no/tok.json", f"hydra.run.dir={run_dir}"]
    code, err = cli(args, tmp_path, monkeypatch, capsys)
    assert code == 2 and "Traceback" not in err
    assert "data.tokenizer='./no/tok.json' is not allowed: no such file or directory" in err


def test_stream_dtype_uint16_where_the_vocabulary_fits_else_uint32(tmp_path, hf_cache):
    from tokenizers import Tokenizer, models, pre_tokenizers

    assert [stream_dtype(v).name for v in (256, 257, 50257, 65536, 65537)] == [
        "uint8", "uint16", "uint16", "uint16", "uint32"
    ]  # fmt: skip
    words = {"[UNK]": 0, "alpha": 1, "beta": 2, "gamma": 70_000}  # ids up to 70,000
    wl = Tokenizer(models.WordLevel(words, unk_token="[UNK]"))
    wl.pre_tokenizer = pre_tokenizers.Whitespace()
    wl.save(str(tmp_path / "wide.json"))
    (tmp_path / "w.txt").write_text("alpha gamma beta\n\ngamma delta")
    cached = open_token_cache(
        local(tmp_path / "w.txt", tmp_path, tokenizer=str(tmp_path / "wide.json"))
    )
    assert cached.tokenizer.vocab_size == 70_001 and cached.train.array().dtype == np.uint32
    assert cached.train.long().tolist()[:3] == [1, 70_000, 2]
    assert (cached.path / "train.bin").stat().st_size == 4 * len(cached.train)


# ---- bits per byte -------------------------------------------------------------------------
def test_bits_per_byte_is_exact_against_a_hand_computation(tmp_path, hf_cache, corpus_txt):
    tok = train_bpe([TEXTS], 600)
    text = "Café — naïve 日本語 🙂 and an ordinary English sentence."
    ids = tok.encode(text)
    table = token_byte_counts(tok)
    assert int(table[torch.from_numpy(ids)].sum()) == len(text.encode("utf-8"))
    assert torch.equal(token_byte_counts(ByteTokenizer()), torch.ones(256, dtype=torch.long))

    # A trained run: the val/bpb it logs against the same sums over the same batches.
    overrides = [
        *FAST,
        "logger=none",
        "trainer.max_steps=2",
        "trainer.val_check_interval=2",
        "data=local",
        f"data.paths=[{corpus_txt}]",
        "data.tokenizer=bpe",
        "data.vocab_size=600",
        f"data.cache_dir={tmp_path / 'cache'}",
    ]
    cfg = compose_run(tmp_path / "run", overrides)
    run(cfg)
    logged = list(series(read_csv_metrics(tmp_path / "run"), "val/bpb").values())[-1]
    state = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=False)
    model = GPT(cfg.model)
    model.load_state_dict({k.removeprefix("model."): v for k, v in state["state_dict"].items()})
    _, val = build_dataloaders(cfg.data, cfg.model.block_size, num_steps=1, val_batches=2)
    table = val.dataset.token_bytes
    nats = nbytes = 0.0
    with torch.no_grad():
        for x, y in val:
            logits = model(x).flatten(0, 1)
            nats += torch.nn.functional.cross_entropy(logits, y.flatten(), reduction="sum").item()
            nbytes += table[y].sum().item()
    assert nbytes > 2 * val.dataset.block_size * 4  # several bytes per BPE token
    assert logged == pytest.approx(nats / nbytes / math.log(2), rel=1e-5)


# ---- the cache ------------------------------------------------------------------------------
def test_second_open_hits_and_the_mapped_stream_equals_in_memory_tokens(tmp_path, hf_cache, caplog):
    caplog.set_level(logging.INFO, logger="stabilize.data")
    cfg = DataConfig(max_chars=30_000, batch_size=2, cache_dir=str(tmp_path / "c"))
    first = open_token_cache(cfg)
    mtime = (first.path / "meta.json").stat().st_mtime_ns
    second = open_token_cache(cfg)
    assert len(build_lines(caplog)) == 1 and second.path == first.path
    assert (second.path / "meta.json").stat().st_mtime_ns == mtime
    assert isinstance(second.train.array(), np.memmap)
    assert len(pickle.dumps(second.train)) < 1000  # workers get the path, not the tokens
    cached = [x for x, _ in build_dataloaders(cfg, 16, num_steps=5)[0]]
    memory = [x for x, _ in build_dataloaders(cfg, 16, num_steps=5, tokenizer=ByteTokenizer())[0]]
    assert all(torch.equal(a, b) for a, b in zip(cached, memory, strict=True))
    # Batching settings are not in the fingerprint: a sweep over them shares the entry.
    other = DataConfig(max_chars=30_000, batch_size=8, seed=7, cache_dir=str(tmp_path / "c"))
    assert open_token_cache(other).path == first.path and len(build_lines(caplog)) == 1


@pytest.mark.parametrize("damage", ["flip", "truncate", "meta"])
def test_corrupt_cache_is_rebuilt_with_a_logged_line(damage, tmp_path, hf_cache, caplog):
    caplog.set_level(logging.INFO, logger="stabilize.data")
    cfg = DataConfig(max_chars=20_000, cache_dir=str(tmp_path / "c"))
    good = open_token_cache(cfg)
    tokens = good.train.long()
    path = good.path / ("meta.json" if damage == "meta" else "train.bin")
    data = bytearray(path.read_bytes())
    n = len(data)
    if damage == "flip":
        data[1234] ^= 0xFF
    path.write_bytes(
        data[:-7] if damage == "truncate" else b"{not json" if damage == "meta" else data
    )
    again = open_token_cache(cfg)
    reason = {"flip": "recorded checksum", "truncate": f"{n - 7} bytes, {n} recorded"}
    reason["meta"] = "unreadable meta.json"
    rebuilt = [r for r in caplog.records if "rebuilding" in r.getMessage()]
    assert len(rebuilt) == 1 and reason[damage] in rebuilt[0].getMessage()
    assert rebuilt[0].levelno == logging.WARNING and len(build_lines(caplog)) == 2
    assert torch.equal(again.train.long(), tokens)


# ---- validation splits -------------------------------------------------------------------
def test_validation_from_the_corpus_own_split(tmp_path, hf_cache, corpus_txt):
    (tmp_path / "val.txt").write_text("held-out text " * 200)
    cfg = local(corpus_txt, tmp_path, val_paths=[str(tmp_path / "val.txt")], batch_size=2)
    cached = open_token_cache(cfg)
    assert ByteTokenizer().decode(cached.val.long()) == "held-out text " * 200
    assert len(cached.train) == len(corpus_txt.read_bytes())  # all of it trains
    _, val = build_dataloaders(cfg, 16, num_steps=1)
    x, _ = next(iter(val))
    assert ByteTokenizer().decode(x[0]) == ("held-out text " * 2)[:16]

    repo = tmp_path / "repo"
    repo.mkdir()
    for split, docs in (("train", TEXTS[:20]), ("validation", ["the validation split"])):
        rows = "".join(json.dumps({"text": d}) + "\n" for d in docs)
        (repo / f"{split}.jsonl").write_text(rows)
    hub = DataConfig(source="hub", name=str(repo), cache_dir=str(tmp_path / "c"))
    assert ByteTokenizer().decode(open_token_cache(hub).val.long()) == "the validation split"
    tail = DataConfig(source="hub", name=str(repo), val_split=None, cache_dir=hub.cache_dir)
    assert open_token_cache(tail).val is None  # the tail split, as before


# ---- bad input: one line each ------------------------------------------------------------------
def test_bad_inputs_fail_with_one_line(tmp_path, hf_cache):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "blank.jsonl").write_text('{"text": ""}\n{"text": ""}\n')
    (tmp_path / "num.jsonl").write_text('{"text": 3, "body": "words"}\n')
    (tmp_path / "ok.txt").write_text("some text " * 100)
    (tmp_path / "file").write_text("x")
    cases = [
        (dict(paths=["empty.txt"]),
            r"data.paths=\[.*empty.txt'\] is not allowed: the corpus is empty"),
        (dict(paths=["blank.jsonl"]), r"blank.jsonl'\] is not allowed: the corpus is empty"),
        (dict(paths=["num.jsonl"]), r"text_field='text' is not allowed: that column holds "
            r"Value\('int64'\), not text; allowed: the text columns \['body'\]"),
        (dict(paths=["num.jsonl"], text_field="title"),
            r"'title' is not a column.*\['text', 'body'\]"),
        (dict(paths=["ok.txt"], tokenizer="./no/such/tokenizer.json"),
            r"data.tokenizer='./no/such/tokenizer.json' is not allowed: no such file"),
        (dict(paths=["ok.txt"], tokenizer=str(tmp_path / "nope")), r"no such file or directory"),
        (dict(paths=["ok.txt"], tokenizer="nobody/no-such-tokenizer"),
            r"'nobody/no-such-tokenizer' is not allowed: no such file or directory, and the hub "
            r"is off \(HF_HUB_OFFLINE is set\); allowed: \['bpe', 'bytes'\]"),
        (dict(paths=["ok.txt"], cache_dir=str(tmp_path / "file" / "sub")),
            r"data.cache_dir='.*file/sub' is not allowed: .* is not writable"),
    ]  # fmt: skip
    for kw, match in cases:
        kw["paths"] = [str(tmp_path / p) for p in kw["paths"]]
        kw.setdefault("cache_dir", str(tmp_path / "c"))
        with pytest.raises(ValueError, match=match) as e:
            build_dataloaders(DataConfig(source="local", **kw), 8, num_steps=1)
        assert "\n" not in str(e.value), str(e.value)
    assert not [p for p in (tmp_path / "c" / "tokens").iterdir() if p.is_dir()]  # nothing left
    with pytest.raises(ValueError, match=r"data.val_paths=\['v.txt'\] is not allowed with data"):
        DataConfig(val_paths=["v.txt"])
    with pytest.raises(ValueError, match=r"data.val_paths=.* no such file: .*missing.txt"):
        DataConfig(source="local", paths=[str(tmp_path / "ok.txt")], val_paths=["missing.txt"])
    with pytest.raises(ValueError, match=r"data.vocab_size=100 .*\[256, 4294967296\]"):
        DataConfig(tokenizer="bpe", vocab_size=100)
