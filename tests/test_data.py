"""Tests of the reference trainer's data pipeline (lossparity.training.data)."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
import torch

from lossparity.training.data import (
    BOS_ID,
    EOS_ID,
    IGNORE_INDEX,
    NUM_SPECIAL,
    PAD_ID,
    Batch,
    ByteTokenizer,
    HFTokenizer,
    JsonlCorpus,
    SyntheticCorpus,
    TextFileCorpus,
    TokenListCorpus,
    global_batch,
    split_batch,
    stream_documents,
)

_ = -100  # IGNORE_INDEX, written short for the hand-worked tables


def _assert_batch_equal(a: Batch, b: Batch) -> None:
    for name in ("tokens", "labels", "mask", "positions"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert (a.segment_ids is None) == (b.segment_ids is None)
    if a.segment_ids is not None:
        assert torch.equal(a.segment_ids, b.segment_ids)


def _check_consistency(batch: Batch, packed: bool) -> None:
    """Invariants of semantics §0 / the module contract, checked row by row with plain Python."""
    tok, lab, msk, pos = (t.tolist() for t in (batch.tokens, batch.labels, batch.mask, batch.positions))
    seg = batch.segment_ids.tolist() if packed else None
    assert batch.tokens.dtype == batch.labels.dtype == batch.positions.dtype == torch.int64
    assert batch.mask.dtype == torch.float32
    assert (batch.segment_ids is not None) == packed
    S = batch.seq_len
    for r in range(batch.num_rows):
        # in padded mode a row is one document followed by padding: segment 1 then 0
        sr = seg[r] if packed else [1 if pos[r][t] == t and tok[r][t] != PAD_ID else 0 for t in range(S)]
        for t in range(S):
            assert msk[r][t] == (1.0 if lab[r][t] != IGNORE_INDEX else 0.0)
            if sr[t] == 0:  # padding
                assert (tok[r][t], lab[r][t], pos[r][t]) == (PAD_ID, IGNORE_INDEX, 0)
                assert all(x == 0 for x in sr[t:]), "padding is trailing"
                continue
            new_doc = t == 0 or sr[t - 1] != sr[t]
            assert pos[r][t] == (0 if new_doc else pos[r][t - 1] + 1)
            if new_doc:
                assert tok[r][t] == BOS_ID
                assert sr[t] == (1 if t == 0 else sr[t - 1] + 1), "segment ids count 1, 2, ... along the row"
            if t + 1 < S and sr[t + 1] == sr[t]:
                assert lab[r][t] == tok[r][t + 1]
            elif t + 1 < S:
                assert lab[r][t] == IGNORE_INDEX, "last token of a document has no target"
            # t == S-1: a truncated document may have a target beyond the row; checked elsewhere


# ------------------------------------------------------------------------------------------------ Batch


def test_batch_rows_to_and_validation():
    b = global_batch(SyntheticCorpus(seed=1), 0, global_batch_size=6, seq_len=16, packed=True, seed=0)
    sub = b.rows(2, 5)
    assert sub.num_rows == 3 and sub.seq_len == 16
    assert torch.equal(sub.tokens, b.tokens[2:5]) and torch.equal(sub.segment_ids, b.segment_ids[2:5])
    moved = b.to("cpu")
    _assert_batch_equal(moved, b)
    with pytest.raises(ValueError, match="rows"):
        b.rows(4, 7)
    with pytest.raises(ValueError, match="labels shape"):
        Batch(b.tokens, b.labels[:, :3], b.mask, None, b.positions)
    with pytest.raises(TypeError, match="mask"):
        Batch(b.tokens, b.labels, b.labels, None, b.positions)


# ------------------------------------------------------------------------------------------------ batching


@pytest.mark.parametrize("packed", [False, True])
def test_global_batch_deterministic(packed):
    kw = dict(global_batch_size=16, seq_len=64, packed=packed, seed=5)
    a = global_batch(SyntheticCorpus(seed=7), 3, **kw)
    b = global_batch(SyntheticCorpus(seed=7), 3, **kw)  # a fresh corpus object: no hidden state
    _assert_batch_equal(a, b)
    c = global_batch(SyntheticCorpus(seed=7), 4, **kw)
    assert not torch.equal(a.tokens, c.tokens)
    d = global_batch(SyntheticCorpus(seed=8), 3, **kw)
    assert not torch.equal(a.tokens, d.tokens)
    # resuming far away only builds that step's batch
    far = global_batch(SyntheticCorpus(seed=7), 10**12, **kw)
    _check_consistency(far, packed)


def test_global_batch_does_not_depend_on_history():
    corpus = SyntheticCorpus(seed=2)
    kw = dict(global_batch_size=8, seq_len=32, packed=True, seed=0)
    direct = global_batch(corpus, 9, **kw)
    for s in range(9):
        global_batch(corpus, s, **kw)
    _assert_batch_equal(direct, global_batch(corpus, 9, **kw))


@pytest.mark.parametrize("packed", [False, True])
def test_batch_consistency_synthetic(packed):
    for step in (0, 1, 17):
        batch = global_batch(SyntheticCorpus(seed=3), step, global_batch_size=12, seq_len=48, packed=packed, seed=0)
        _check_consistency(batch, packed)
        assert batch.mask.sum() > 0


def test_padded_rows_are_stream_documents():
    corpus = SyntheticCorpus(seed=4)
    N, S, step = 8, 40, 3
    batch = global_batch(corpus, step, global_batch_size=N, seq_len=S, packed=False, seed=0)
    for r in range(N):
        doc = corpus.document(step * N + r).tolist()  # unbounded corpus: stream position p is document p
        L = min(len(doc), S)
        assert batch.tokens[r, :L].tolist() == doc[:L]
        assert batch.tokens[r, L:].tolist() == [PAD_ID] * (S - L)
        expect = doc[1 : S + 1] + [IGNORE_INDEX] * (S - len(doc[1 : S + 1]))
        assert batch.labels[r].tolist() == expect
        assert batch.positions[r].tolist() == list(range(L)) + [0] * (S - L)


def test_packed_segments_are_candidate_documents():
    corpus = SyntheticCorpus(seed=6)
    N, S, M, step = 8, 64, 30, 2
    batch = global_batch(corpus, step, global_batch_size=N, seq_len=S, packed=True, seed=0, docs_per_step=M)
    cands = {i: corpus.document(i).tolist() for i in range(step * M, (step + 1) * M)}
    used = []
    for r in range(N):
        row_docs = []
        seg = batch.segment_ids[r].tolist()
        for sid in range(1, max(seg) + 1):
            cols = [t for t in range(S) if seg[t] == sid]
            toks = batch.tokens[r, cols].tolist()
            match = [i for i, d in cands.items() if i not in used and d[: min(len(d), S)] == toks]
            assert match, f"segment {sid} of row {r} is not a candidate document"
            i = match[0]
            used.append(i)
            row_docs.append(i)
            d = cands[i]
            if len(d) > S:  # truncated document: its last position predicts token S of the document
                assert batch.labels[r, cols[-1]].item() == d[S]
        assert row_docs == sorted(row_docs), "documents keep stream order within a row"
    assert step * M in used and batch.segment_ids[0, 0].item() == 1  # first candidate opens row 0
    assert (batch.segment_ids > 0).float().mean() > 0.9


def test_hand_worked_packed_example():
    docs = [[1, 10, 11], [1, 12], [1, 13, 14, 15], [1, 16, 17, 18, 19, 20, 21]]
    corpus = TokenListCorpus(docs, vocab_size=32, shuffle=False)
    batch = global_batch(corpus, 0, global_batch_size=2, seq_len=5, packed=True, seed=0, docs_per_step=4)
    # first fit: doc0 (3 positions) -> row 0 @0; doc1 (2) -> row 0 @3; doc2 (4) -> row 1 @0;
    # doc3 (7 tokens, cut to 6, needs 5 positions) fits nowhere -> skipped.
    assert batch.tokens.tolist() == [[1, 10, 11, 1, 12], [1, 13, 14, 15, 0]]
    assert batch.labels.tolist() == [[10, 11, _, 12, _], [13, 14, 15, _, _]]
    assert batch.mask.tolist() == [[1, 1, 0, 1, 0], [1, 1, 1, 0, 0]]
    assert batch.segment_ids.tolist() == [[1, 1, 1, 2, 2], [1, 1, 1, 1, 0]]
    assert batch.positions.tolist() == [[0, 1, 2, 0, 1], [0, 1, 2, 3, 0]]
    # step 1 reads stream positions 4..7 = documents 0..3 again (second epoch, no shuffle)
    _assert_batch_equal(
        global_batch(corpus, 1, global_batch_size=2, seq_len=5, packed=True, seed=0, docs_per_step=4), batch
    )
    # a long document first: it takes a whole row (cut to S+1 = 6 tokens), the short ones follow
    corpus2 = TokenListCorpus([docs[3], docs[1], docs[0]], vocab_size=32, shuffle=False)
    b2 = global_batch(corpus2, 0, global_batch_size=2, seq_len=5, packed=True, seed=0, docs_per_step=3)
    assert b2.tokens.tolist() == [[1, 16, 17, 18, 19], [1, 12, 1, 10, 11]]
    assert b2.labels.tolist() == [[16, 17, 18, 19, 20], [12, _, 10, 11, _]]
    assert b2.segment_ids.tolist() == [[1, 1, 1, 1, 1], [1, 1, 2, 2, 2]]
    assert b2.positions.tolist() == [[0, 1, 2, 3, 4], [0, 1, 0, 1, 2]]


def test_hand_worked_padded_example():
    docs = [[1, 10, 11], [1, 12], [1, 13, 14, 15], [1, 16, 17, 18, 19, 20, 21]]
    corpus = TokenListCorpus(docs, vocab_size=32, shuffle=False)
    b = global_batch(corpus, 1, global_batch_size=2, seq_len=5, packed=False, seed=0)  # documents 2, 3
    assert b.segment_ids is None
    assert b.tokens.tolist() == [[1, 13, 14, 15, 0], [1, 16, 17, 18, 19]]
    assert b.labels.tolist() == [[13, 14, 15, _, _], [16, 17, 18, 19, 20]]
    assert b.mask.tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]
    assert b.positions.tolist() == [[0, 1, 2, 3, 0], [0, 1, 2, 3, 4]]


def test_shuffled_stream_is_a_permutation_per_epoch():
    docs = [[1, 3 + i] for i in range(10)]
    corpus = TokenListCorpus(docs, vocab_size=16, shuffle=True)
    s = stream_documents(corpus, 3, 0, 30)
    for e in range(3):
        assert sorted(s[10 * e : 10 * (e + 1)].tolist()) == list(range(10))
    assert s[:10].tolist() != s[10:20].tolist()
    assert s[:10].tolist() != list(range(10))
    assert stream_documents(corpus, 3, 7, 9).tolist() == s[7:16].tolist()
    assert stream_documents(corpus, 4, 0, 10).tolist() != s[:10].tolist()
    # padded batch rows follow the stream
    b = global_batch(corpus, 2, global_batch_size=4, seq_len=3, packed=False, seed=3)
    assert b.tokens[:, 1].tolist() == [3 + i for i in s[8:12].tolist()]


# ------------------------------------------------------------------------------------------------ split


@pytest.mark.parametrize("D,K,b", [(1, 1, 8), (2, 2, 2), (4, 1, 2), (2, 4, 1), (8, 1, 1), (1, 8, 1), (1, 2, 4)])
def test_split_covers_each_row_once(D, K, b):
    batch = global_batch(SyntheticCorpus(seed=9), 1, global_batch_size=8, seq_len=24, packed=True, seed=0)
    # tag rows so that each microbatch row can be traced back to its global row index
    tagged = Batch(
        tokens=torch.arange(8).repeat_interleave(24).view(8, 24),
        labels=batch.labels,
        mask=batch.mask,
        segment_ids=batch.segment_ids,
        positions=batch.positions,
    )
    seen = []
    parts = []
    for d in range(D):
        mbs = split_batch(tagged, D, d, K, b)
        assert len(mbs) == K
        for k, mb in enumerate(mbs):
            assert mb.num_rows == b
            rows = mb.tokens[:, 0].tolist()
            assert rows == [d * K * b + k * b + j for j in range(b)]
            seen += rows
        parts += split_batch(batch, D, d, K, b)
    assert sorted(seen) == list(range(8))
    for name in ("tokens", "labels", "mask", "segment_ids", "positions"):
        assert torch.equal(torch.cat([getattr(p, name) for p in parts]), getattr(batch, name))


def test_split_errors():
    batch = global_batch(SyntheticCorpus(), 0, global_batch_size=8, seq_len=8, packed=False, seed=0)
    with pytest.raises(ValueError, match=r"N=8.*3\*1\*2 = 6"):
        split_batch(batch, 3, 0, 1, 2)
    with pytest.raises(ValueError, match="dp_rank"):
        split_batch(batch, 2, 2, 2, 2)
    with pytest.raises(ValueError, match="microbatch_size"):
        split_batch(batch, 2, 0, 2, 0)
    with pytest.raises(ValueError, match="global_batch_size"):
        global_batch(SyntheticCorpus(), 0, global_batch_size=0, seq_len=8, packed=False, seed=0)
    with pytest.raises(ValueError, match="step"):
        global_batch(SyntheticCorpus(), -1, global_batch_size=2, seq_len=8, packed=False, seed=0)


# ------------------------------------------------------------------------------------------------ synthetic


def test_synthetic_documents_are_pure_and_prefix_consistent():
    corpus = SyntheticCorpus(seed=11)
    d9 = corpus.document(9).tolist()
    flat, lens = corpus.gather([9, 2, 9, 40], max_len=10)
    assert lens.tolist() == [min(len(corpus.document(i)), 10) for i in (9, 2, 9, 40)]
    assert flat[: lens[0]].tolist() == d9[:10]
    assert flat[lens[0] + lens[1] : lens[0] + lens[1] + lens[2]].tolist() == d9[:10]
    assert SyntheticCorpus(seed=11).document(9).tolist() == d9
    assert corpus.lengths([9]).tolist() == [len(d9)]
    # documents: BOS then content ids only
    flat, lens = corpus.gather(np.arange(200))
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]])
    assert (flat[starts] == BOS_ID).all()
    content = np.delete(flat, starts)
    assert content.min() >= NUM_SPECIAL and content.max() < corpus.vocab_size


def test_synthetic_structure_without_noise():
    corpus = SyntheticCorpus(seed=0, noise_short=0.0, topic_vocab=24, vocab_size=512)
    for i in range(50):
        d = corpus.document(i).tolist()
        assert len(set(d[1:])) <= 24  # motifs of one topic draw from its private pool
    # documents of the same topic share their pool
    topics = corpus.topics(np.arange(400))
    same = np.flatnonzero(topics == topics[0])[:5]
    pool = set().union(*(set(corpus.document(int(i)).tolist()[1:]) for i in same))
    assert len(pool) <= 24


def test_synthetic_lengths_heavy_tailed():
    corpus = SyntheticCorpus(seed=0, min_len=8, max_len=1024)
    lens = corpus.lengths(np.arange(20000)).astype(np.float64)
    assert lens.min() >= 8 and lens.max() <= 1024
    med, mean = np.median(lens), lens.mean()
    assert mean > 1.4 * med  # right skew
    top = np.sort(lens)[::-1][: len(lens) // 10]
    assert top.sum() / lens.sum() > 0.3  # the longest 10% of documents hold > 30% of the tokens
    assert lens.max() > 20 * med
    assert (lens <= 2 * med).mean() > 0.6  # and most documents are short
    skew = ((lens - mean) ** 3).mean() / lens.std() ** 3
    assert skew > 3


def _bigram_estimator_gap(corpus: SyntheticCorpus) -> tuple[float, float, float]:
    """Fit an add-0.1 bigram model on documents 0..2999, evaluate per-token NLL on 3000..4999 (float64).

    Returns (per-token mean S/Ntok, per-sample mean (1/N) Σ s_i/n_i, Cov(n, l)/mean(n)).
    """
    V = corpus.vocab_size
    counts = np.full((V, V), 0.1)
    for i in range(3000):
        d = corpus.document(i).numpy()
        np.add.at(counts, (d[:-1], d[1:]), 1.0)
    logp = np.log(counts / counts.sum(axis=1, keepdims=True))
    s, n = [], []
    for i in range(3000, 5000):
        d = corpus.document(i).numpy()
        s.append(-logp[d[:-1], d[1:]].sum())
        n.append(len(d) - 1)
    s, n = np.array(s), np.array(n, dtype=np.float64)
    l = s / n
    cov = ((n - n.mean()) * (l - l.mean())).mean()
    return s.sum() / n.sum(), l.mean(), cov / n.mean()


def test_synthetic_estimator_gap_is_clearly_nonzero():
    per_token, per_sample, gap = _bigram_estimator_gap(SyntheticCorpus(seed=3))
    assert per_token - per_sample == pytest.approx(gap, rel=1e-9)  # the identity behind the gap
    assert gap < -0.3  # long documents are easier: per-token mean < per-sample mean
    _, _, flat_gap = _bigram_estimator_gap(SyntheticCorpus(seed=3, noise_exponent=0.0))
    assert abs(flat_gap) < abs(gap) / 5
    _, _, rev_gap = _bigram_estimator_gap(SyntheticCorpus(seed=3, noise_short=0.1, noise_exponent=-0.5))
    assert rev_gap > 0.1  # long documents harder: the gap changes sign


# ------------------------------------------------------------------------------------------------ files


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    assert tok.vocab_size == 256 + NUM_SPECIAL and (tok.bos_id, tok.eos_id) == (BOS_ID, EOS_ID)
    text = "hello, wörld ✓\n\tend"
    ids = tok.encode(text)
    assert ids == [b + NUM_SPECIAL for b in text.encode("utf-8")]
    assert tok.decode(ids) == text
    assert tok.decode([BOS_ID] + ids + [EOS_ID, PAD_ID]) == text
    assert tok.encode("") == []
    with pytest.raises(ValueError, match="ids"):
        tok.decode([259])


def _bytes_doc(text: str, eos: bool = False) -> list[int]:
    return [BOS_ID] + [b + NUM_SPECIAL for b in text.encode("utf-8")] + ([EOS_ID] if eos else [])


def test_text_file_corpus(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("first para\nline two\n\n\n  second  \n \t \nthird\n\n", encoding="utf-8")
    corpus = TextFileCorpus(path, ByteTokenizer(), shuffle=False)
    assert len(corpus) == 3 and corpus.vocab_size == 259
    assert corpus.document(0).tolist() == _bytes_doc("first para\nline two")
    assert corpus.document(1).tolist() == _bytes_doc("second")
    assert corpus.document(2).tolist() == _bytes_doc("third")
    with_eos = TextFileCorpus(str(path), ByteTokenizer(), add_eos=True)
    assert with_eos.document(2).tolist() == _bytes_doc("third", eos=True)
    b = global_batch(corpus, 0, global_batch_size=3, seq_len=8, packed=False, seed=0)
    assert b.tokens[2].tolist() == _bytes_doc("third") + [PAD_ID] * 2
    _check_consistency(global_batch(corpus, 1, global_batch_size=2, seq_len=12, packed=True, seed=0), True)


def test_jsonl_corpus(tmp_path):
    path = tmp_path / "c.jsonl"
    rows = [{"text": "abc", "id": 1}, {"text": "", "id": 2}, {"body": "x", "text": "é"}]
    path.write_text("\n".join(json.dumps(r) for r in rows[:2]) + "\n\n" + json.dumps(rows[2]) + "\n")
    corpus = JsonlCorpus(path, ByteTokenizer(), shuffle=False)
    assert [corpus.document(i).tolist() for i in range(3)] == [_bytes_doc("abc"), [BOS_ID], _bytes_doc("é")]
    path2 = tmp_path / "d.jsonl"
    path2.write_text(json.dumps({"body": "hi"}) + "\n")
    assert JsonlCorpus(path2, ByteTokenizer(), field="body").document(0).tolist() == _bytes_doc("hi")


def test_file_errors(tmp_path):
    missing = tmp_path / "nope.txt"
    with pytest.raises(FileNotFoundError, match="nope.txt"):
        TextFileCorpus(missing, ByteTokenizer())
    with pytest.raises(FileNotFoundError, match="nope.txt"):
        JsonlCorpus(missing, ByteTokenizer())
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "a"}\n\n{"text": oops}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:3: invalid JSON"):
        JsonlCorpus(bad, ByteTokenizer())
    nofield = tmp_path / "nofield.jsonl"
    nofield.write_text('{"text": "a"}\n{"txt": "b"}\n')
    with pytest.raises(ValueError, match=r"nofield\.jsonl:2: field 'text'"):
        JsonlCorpus(nofield, ByteTokenizer())
    blank = tmp_path / "blank.txt"
    blank.write_text("\n  \n")
    with pytest.raises(ValueError, match="no documents"):
        TextFileCorpus(blank, ByteTokenizer())


def test_hf_tokenizer_without_transformers(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # makes `import transformers` fail
    with pytest.raises(ImportError, match="transformers"):
        HFTokenizer("gpt2")
