"""Text sources, the train/validation split, ArrayRecord shards and the prepare command."""

import importlib.util
import json
import os
import pickle
import random
import re
import subprocess
import sys

import grain
import numpy as np
import pytest

from transformer.data import sources
from transformer.data.sources import Document

HAS_TOKENIZERS = importlib.util.find_spec("transformer.data.tokenizers") is not None
needs_tokenizers = pytest.mark.skipif(not HAS_TOKENIZERS, reason="tokenizers.py not there yet")

TEXT = ("\n\nFIRST CITIZEN:\nBefore we proceed any further, hear me speak.\n\n"
        "ALL:\nSpeak, speak.\n \n\t\n"
        "FIRST CITIZEN:\nYou are all resolved rather to die than to famish?\n\n\n"
        "ALL:\nResolved. resolved.")


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8", newline="")
    return str(path)


# --- embedded corpus -------------------------------------------------------------------------


def test_embedded_corpus_is_real_deterministic_text():
    docs = sources.embedded_corpus()
    assert docs == sources.embedded_corpus()
    names = [d.name for d in docs]
    assert names == sorted(names) and len(set(names)) == len(names)
    assert "pydoc:assert" in names and "stdlib:os.py" in names
    assert {n.split(":")[0] for n in names} == {"pydoc", "stdlib"}
    assert all(isinstance(d.text, str) and d.text.strip() for d in docs)
    assert sum(len(d.text) for d in docs) > 1_000_000
    docs.clear()  # callers get a copy; the cache is untouched
    assert sources.embedded_corpus()


# --- read_text -------------------------------------------------------------------------------


def test_paragraphs_lose_no_text(tmp_path):
    file = write(tmp_path / "speeches.txt", TEXT)
    docs = sources.read_text(file)
    assert "".join(d.text for d in docs) == TEXT
    assert [d.name for d in docs] == [f"{file}#{k}" for k in range(4)]
    assert [d.text.strip().splitlines()[0] for d in docs] == ["FIRST CITIZEN:", "ALL:"] * 2
    assert docs[1].text == "ALL:\nSpeak, speak.\n \n\t\n"
    assert sources.read_text(file, split="file") == [Document(file, TEXT)]


def test_crlf_and_form_feed_paragraphs_join_back(tmp_path):
    text = "a\r\nb\r\n\r\nc\x0c\nd\r\n\r\n\r\n"
    docs = sources.read_text(write(tmp_path / "x.txt", text))
    assert [d.text for d in docs] == ["a\r\nb\r\n\r\n", "c\x0c\n", "d\r\n\r\n\r\n"]


def test_directory_and_glob(tmp_path):
    a = write(tmp_path / "b" / "a.txt", "alpha\n\nbeta\n")
    b = write(tmp_path / "a.md", "gamma")
    write(tmp_path / ".hidden.txt", "secret")
    write(tmp_path / ".git" / "config", "secret")
    write(tmp_path / "empty.txt", "")
    docs = sources.read_text(str(tmp_path))
    assert [(d.name, d.text) for d in docs] == [
        (f"{b}#0", "gamma"), (f"{a}#0", "alpha\n\n"), (f"{a}#1", "beta\n")]
    assert [d.name for d in sources.read_text(str(tmp_path), split="file")] == [b, a]
    assert [d.name for d in sources.read_text(str(tmp_path / "*" / "*.txt"))] == [
        f"{a}#0", f"{a}#1"]
    assert [d.name for d in sources.read_text(str(tmp_path / "**" / "*.md"))] == [f"{b}#0"]


def test_invalid_utf8_names_file_and_byte(tmp_path):
    path = tmp_path / "x.txt"
    path.write_bytes(b"ok\n\xff rest")
    with pytest.raises(ValueError, match="invalid UTF-8") as e:
        sources.read_text(str(path))
    assert str(path) in str(e.value) and "byte 3" in str(e.value)


def test_a_text_files_byte_order_mark_is_not_text(tmp_path):
    """A UTF-8 byte-order mark starting a .txt file is skipped (as JSON Lines skip it): it
    became the first document's first character, and a file of only the mark a document. An
    invalid byte is still named by its offset in the file, the mark counted; the fingerprint
    marks a file read without it now (a checkpoint of a run that read it as text)."""
    bom = tmp_path / "a.txt"
    bom.write_bytes(b"\xef\xbb\xbfHello world\n\nsecond\n")
    assert [d.text for d in sources.file_documents(str(bom), split="paragraph")] == [
        "Hello world\n\n", "second\n"]
    assert [d.text for d in sources.read_text(str(bom), split="file")] == [
        "Hello world\n\nsecond\n"]
    only = tmp_path / "only" / "b.txt"
    only.parent.mkdir()
    only.write_bytes(b"\xef\xbb\xbf")
    assert list(sources.file_documents(str(only), split="file")) == []
    with pytest.raises(ValueError, match="no text in 1 file"):
        sources.read_text(str(only.parent))
    # One file's fingerprint is of its size and bytes, whatever its name, but for the mark
    for data, same in ((b"Hello world\n", True), (b"\xef\xbb\xbfHello world\n", False)):
        (tmp_path / "a.jsonl").write_bytes(data)
        (tmp_path / "c.txt").write_bytes(data)
        assert (sources.fingerprint(str(tmp_path / "a.jsonl")) ==
                sources.fingerprint(str(tmp_path / "c.txt"))) == same
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"\xef\xbb\xbfok\n\xff")
    with pytest.raises(ValueError, match=r"invalid UTF-8 at byte 6: "):
        sources.read_text(str(bad))


def test_missing_and_empty_inputs(tmp_path):
    for missing in (tmp_path / "nope.txt", tmp_path / "*.nope"):
        with pytest.raises(FileNotFoundError, match="nope"):
            sources.read_text(str(missing))
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        sources.read_text(str(tmp_path))  # an empty directory
    empty = write(tmp_path / "empty.txt", "")
    with pytest.raises(ValueError, match="empty.txt"):
        sources.read_text(empty)
    write(tmp_path / "blank.txt", " \n\n\t\n")
    for split in sources.UNITS:
        with pytest.raises(ValueError, match=f"{tmp_path}: no text"):
            sources.read_text(str(tmp_path), split=split)
    with pytest.raises(ValueError, match="split='line'"):
        sources.read_text(empty, split="line")


# --- train / validation split ----------------------------------------------------------------


def names(docs):
    return {d.name for d in docs}


def test_split_is_a_partition_with_the_asked_fraction():
    docs = [Document(str(i), f"document {i}") for i in range(4000)]
    train = sources.split_documents(docs, "train", 0.1)
    validation = sources.split_documents(docs, "validation", 0.1)
    assert not names(train) & names(validation)
    assert names(train) | names(validation) == names(docs)
    assert 0.085 < len(validation) / len(docs) < 0.115
    assert sources.split_documents(docs, "train", 0.0) == docs
    assert sources.split_documents(docs, "validation", 1.0) == docs


def test_split_ignores_order_and_position_and_keeps_duplicates_together():
    docs = [Document(f"{i}", f"text {i % 300}") for i in range(1000)]
    shuffled = random.Random(0).sample(docs, len(docs))
    for split in sources.SPLITS:
        assert names(sources.split_documents(docs, split, 0.3)) == names(
            sources.split_documents(shuffled, split, 0.3))
    validation = sources.split_documents(docs, "validation", 0.3)
    texts = {d.text for d in validation}
    assert texts and all((d.text in texts) == (d in validation) for d in docs)
    renamed = [Document("other", d.text) for d in docs[:50]]
    assert [d.text for d in sources.split_documents(renamed, "validation", 0.3)] == [
        d.text for d in docs[:50] if d.text in texts]


def test_split_rejects_bad_arguments():
    with pytest.raises(ValueError, match="split='test'"):
        sources.split_documents([], "test")
    for fraction in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="validation_fraction"):
            sources.split_documents([], "train", fraction)


def test_load_documents(tmp_path):
    corpus = sources.embedded_corpus("paragraph")  # the default unit's documents
    validation = sources.load_documents(None, "validation")
    assert validation == sources.load_documents("", "validation")
    assert 0 < len(validation) < len(corpus) / 5
    assert set(validation) <= set(corpus)
    files = sources.load_documents(None, "validation", unit="file")
    assert set(files) <= set(sources.embedded_corpus()) and len(files) < len(validation)
    file = write(tmp_path / "a.txt", TEXT)
    assert sources.load_documents(file, "train", validation_fraction=0.0) == sources.read_text(file)
    assert len(sources.load_documents(file, "train", unit="file", validation_fraction=0)) == 1
    with pytest.raises(ValueError, match="validation split .* is empty"):
        sources.load_documents(file, "validation", validation_fraction=0.0)


# --- ArrayRecord -----------------------------------------------------------------------------


def sequences(n=11):
    rng = np.random.default_rng(0)
    seqs = [rng.integers(-2**31, 2**31, size=rng.integers(0, 40)) for _ in range(n)]
    seqs[3] = np.array([], np.int64)
    seqs[4] = [5, 6, 7]  # any 1-D integer sequence
    return seqs


def test_array_records_round_trip(tmp_path):
    seqs = sequences()
    prefix = str(tmp_path / "out" / "train")
    paths = sources.write_array_records(prefix, iter(seqs), num_shards=3)
    assert paths == [f"{prefix}-{i:05d}-of-00003.array_record" for i in range(3)]
    assert sorted(os.listdir(tmp_path / "out")) == [os.path.basename(p) for p in paths]
    source = sources.array_record_source(f"{prefix}-*.array_record")
    assert len(source) == len(seqs)
    # Shard-major: sequence j is record j // 3 of shard j % 3.
    expected = [seqs[j] for i in range(3) for j in range(i, len(seqs), 3)]
    for got, want in zip([source[i] for i in range(len(source))], expected, strict=True):
        assert got.dtype == np.int32 and got.tolist() == list(want)
    assert [a.tolist() for a in source.__getitems__([5, 0])] == [source[5].tolist(),
                                                                 source[0].tolist()]
    again = pickle.loads(pickle.dumps(source))
    assert [a.tolist() for a in grain.MapDataset.source(again)] == [list(s) for s in expected]


def test_array_records_never_show_partial_shards(tmp_path):
    during = []

    def failing():
        yield np.arange(3)
        during.extend(sorted(os.listdir(tmp_path)))  # what a crash right now would leave
        raise RuntimeError("tokenizer crashed")

    with pytest.raises(RuntimeError, match="crashed"):
        sources.write_array_records(str(tmp_path / "x"), failing(), num_shards=2)
    assert len(during) == 2 and not any(name.endswith(".array_record") for name in during)
    with pytest.raises(ValueError, match="expected a 1-D array of integers"):
        sources.write_array_records(str(tmp_path / "x"), [np.zeros(3)])
    with pytest.raises(ValueError, match="int32"):
        sources.write_array_records(str(tmp_path / "x"), [np.array([2**31])])
    assert os.listdir(tmp_path) == []
    with pytest.raises(FileNotFoundError, match="x-\\*.array_record"):
        sources.array_record_source(str(tmp_path / "x-*.array_record"))


# --- prepare ---------------------------------------------------------------------------------


def snapshot(directory):
    return {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in directory.iterdir()}


def shakespeare(directory):
    speeches = [f"SPEAKER {i % 3}:\nLine {i} of the speech,\nand é{i * 7} {chr(0x4E00 + i)}.\n\n"
                for i in range(30)]
    for act in range(6):
        write(directory / "play" / f"act{act}.txt", "".join(speeches[act * 5:act * 5 + 5]))
    return str(directory / "play")


@needs_tokenizers
@pytest.mark.parametrize("kind", ["byte", "sentencepiece_bpe"])
def test_prepare_writes_tokenizer_shards_and_counts(tmp_path, kind):
    if kind.startswith("sentencepiece") and importlib.util.find_spec("sentencepiece") is None:
        pytest.skip("sentencepiece not installed")
    from transformer.data import prepare, tokenizers

    text_dir, out = shakespeare(tmp_path), tmp_path / "prepared"
    vocab_size = 400 if kind.startswith("sentencepiece") else None
    counts = prepare.prepare(str(out), text_dir, tokenizer=kind, vocab_size=vocab_size,
                             num_shards=2, validation_fraction=0.3)
    assert json.loads((out / "prepare.json").read_text()) == counts
    tok = tokenizers.load_tokenizer(str(out))
    assert counts["tokenizer"] == tok.kind == kind and counts["vocab_size"] == tok.vocab_size
    for split in sources.SPLITS:
        docs = sources.load_documents(text_dir, split, validation_fraction=0.3)
        records = sources.array_record_source(str(out / f"{split}-*.array_record"))
        files = sources.document_files(text_dir)  # the input files, in order
        by_file = [[d for d in docs if d.name.rpartition("#")[0] == f] for f in files]
        # Each input file's own 2 shards, shard-major: its documents 0, 2, ..., then 1, 3, ...
        ordered = [d for one in by_file for d in one[0::2] + one[1::2]]
        assert counts[split]["files"] == [
            f"{split}-{i:06d}-{k:05d}-of-00002.array_record"
            for i, one in enumerate(by_file) for k in range(2) if one]
        assert len(records) == len(docs) == counts[split]["documents"]
        for doc, ids in zip(ordered, records, strict=True):
            assert ids[-1] == tokenizers.EOS_ID and tok.decode(ids[:-1]) == doc.text
            assert ids[:-1].tolist() == tok.encode(doc.text).tolist()
        assert counts[split]["tokens"] == sum(len(ids) for ids in records)
        assert counts[split]["bytes"] == sum(len(d.text.encode()) for d in docs)
    assert sorted(counts["train"]["files"] + counts["validation"]["files"]) == sorted(
        p for p in os.listdir(out) if p.endswith(".array_record"))

    before = snapshot(out)
    shard_count = len(counts["train"]["files"] + counts["validation"]["files"])
    with pytest.raises(FileExistsError, match=f"already holds {shard_count} ArrayRecord files"):
        prepare.prepare(str(out), text_dir, tokenizer="byte")
    assert snapshot(out) == before


@pytest.mark.slow
@needs_tokenizers
def test_prepare_command_and_train_split_tokenizer(tmp_path):
    text_dir, out = shakespeare(tmp_path), tmp_path / "prepared"
    root = os.path.dirname(os.path.dirname(os.path.dirname(sources.__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run(
        [sys.executable, "-m", "transformer.data.prepare", f"--output_dir={out}",
         f"--input={text_dir}", "--tokenizer=char", "--validation_fraction=0.5", "--unit=file"],
        capture_output=True, text=True, cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stderr
    counts = json.loads(result.stdout)
    assert counts == json.loads((out / "prepare.json").read_text())
    train = sources.load_documents(text_dir, "train", validation_fraction=0.5, unit="file")
    assert counts["train"]["documents"] == len(train) < 6
    assert counts["train"]["documents"] + counts["validation"]["documents"] == 6
    from transformer.data import tokenizers

    # The char tokenizer is built from the train split only.
    assert tokenizers.load_tokenizer(str(out)).chars == "".join(
        sorted(set("".join(d.text for d in train))))


# --- what a directory holds --------------------------------------------------------------------


def write_parquet(path, texts):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"text": texts}), str(path))
    return str(path)


def test_a_folder_of_several_hub_splits_is_refused_and_a_readme_beside_tables_warned(tmp_path,
                                                                                      capsys):
    """A dataset as the Hugging Face Hub keeps it (data/train-00000-of-00001.parquet, test-...,
    validation-..., README.md): read whole, its test and validation rows would train."""
    hub = tmp_path / "hub"
    for split in ("train", "test", "validation"):
        write_parquet(hub / "data" / f"{split}-00000-of-00001.parquet",
                      [f"{split} row {i}" for i in range(3)])
    write(hub / "README.md", "---\nlicense: mit\n---\n\n# A dataset card\n")
    for where in (hub, hub / "data"):
        with pytest.raises(ValueError) as error:
            sources.read_text(str(where))
        assert str(error.value) == (
            f"{where}: holds the Hugging Face Hub splits ['test', 'train', 'validation'] "
            f"({hub / 'data' / 'train-00000-of-00001.parquet'}, "
            f"{hub / 'data' / 'test-00000-of-00001.parquet'}), which would all train: expected "
            f"a path to the train files alone (a glob such as {hub / 'data' / 'train*'}) and "
            "data.validation_path at the validation files")
    train = sources.read_text(str(hub / "data" / "train*"))  # the path the error suggests
    assert [d.text for d in train] == ["train row 0", "train row 1", "train row 2"]
    jsonl = tmp_path / "jsonl"  # JSON Lines, and valid / dev for validation
    for name in ("train.jsonl", "dev.jsonl"):
        write(jsonl / name, json.dumps({"text": name}) + "\n")
    with pytest.raises(ValueError, match=r"the Hugging Face Hub splits \['train', 'validation'\]"):
        sources.read_text(str(jsonl))

    # One split beside its dataset card: read (as before), with a warning naming the card.
    (tmp_path / "one").mkdir()
    os.rename(hub / "README.md", tmp_path / "one" / "README.md")
    os.rename(hub / "data", tmp_path / "one" / "data")
    for split in ("test", "validation"):
        os.remove(tmp_path / "one" / "data" / f"{split}-00000-of-00001.parquet")
    capsys.readouterr()
    docs = sources.read_text(str(tmp_path / "one"))
    assert len(docs) == 5  # 3 rows, and the card's 2 paragraphs
    assert capsys.readouterr().err == (
        f"warning: {tmp_path / 'one'}: {tmp_path / 'one' / 'README.md'} is read as text beside 1 "
        "Parquet / JSON Lines files (its paragraphs train): if it is not corpus, point data.path "
        "at the corpus files alone (a glob)\n")


def test_hub_split_aliases_and_split_named_folders_are_refused(tmp_path):
    """val / training / eval name splits as `datasets` reads them, and the Hub's Parquet export
    keeps its splits in folders (default/train/0000.parquet): read whole, all would train."""
    for names, splits in ((("train.jsonl", "val.jsonl"), ["train", "validation"]),
                          (("train.parquet", "val.parquet", "test.parquet"),
                           ["test", "train", "validation"]),
                          (("training.jsonl", "eval.jsonl"), ["test", "train"])):
        flat = tmp_path / "_".join(names)
        for name in names:
            if name.endswith(".parquet"):
                write_parquet(flat / name, [name])
            else:
                write(flat / name, json.dumps({"text": name}) + "\n")
        with pytest.raises(ValueError, match=rf"^{flat}: holds the Hugging Face Hub splits "
                                             rf"{re.escape(str(splits))} \({flat / names[0]}, "):
            sources.document_files(str(flat))
    export = tmp_path / "export"
    for split in ("train", "validation"):
        write_parquet(export / "default" / split / "0000.parquet", [f"{split} row"])
    for where in (export, export / "default"):
        with pytest.raises(ValueError) as error:
            sources.read_text(str(where))
        train, validation = export / "default" / "train", export / "default" / "validation"
        assert str(error.value) == (
            f"{where}: holds the Hugging Face Hub splits ['train', 'validation'] ({train}, "
            f"{validation}), which would all train: expected a path to the train files alone "
            f"(the folder {train}) and data.validation_path at the validation folder")
    train = sources.read_text(str(export / "default" / "train"))  # the path the error names
    assert [d.text for d in train] == ["train row"]


def test_a_symlinked_folder_is_read_as_a_glob_reads_it_and_a_cycle_once(tmp_path):
    """A corpus assembled from links to folders elsewhere: each linked file is read, a folder
    reached twice (a link back up, two links to one folder) once."""
    elsewhere = tmp_path / "elsewhere"
    write(elsewhere / "web" / "a.txt", "linked text")
    corpus = tmp_path / "corpus"
    write(corpus / "own.txt", "own text")
    os.symlink(elsewhere / "web", corpus / "web")
    os.symlink(elsewhere / "web", corpus / "web_again")
    os.symlink(corpus, corpus / "loop")  # a cycle
    files = sources._files(str(corpus))
    assert files == [str(corpus / "own.txt"), str(corpus / "web" / "a.txt")]
    assert [d.text for d in sources.read_text(str(corpus))] == ["own text", "linked text"]
    assert str(corpus / "web" / "a.txt") in sources._files(str(corpus / "*"))


def test_a_truncated_jsonl_gz_names_the_last_row_it_read(tmp_path):
    import gzip

    from transformer.data import formats

    path = tmp_path / "cut.jsonl.gz"
    rows = "".join(json.dumps({"text": f"row {k} " + "word " * 20}) + "\n" for k in range(5000))
    whole = gzip.compress(rows.encode())
    path.write_bytes(whole[:len(whole) // 2])  # a download cut short
    read = []
    with pytest.raises(ValueError) as error:
        for row, text in formats.read_rows(str(path)):
            assert text.startswith(f"row {row} ")
            read.append(row)
    assert 0 < len(read) < 5000 and read == list(range(len(read)))
    assert str(error.value).startswith(
        f"{path}: unreadable after row {read[-1]} (line {len(read)}): EOFError: ")


def test_the_modules_tasks_test_paragraphs_are_not_in_the_embedded_corpus_pretraining():
    """tasks.py's promise: pretrained on the embedded corpus with the same validation_fraction,
    a model never saw a test paragraph of the `modules` task. The corpus was split by whole file
    whatever data.unit said, while the task splits paragraphs: 412 of its 644 test paragraphs
    were in pretraining's train split."""
    from transformer.data import tasks

    train = "".join(d.text for d in sources.load_documents(None, "train", validation_fraction=0.15))
    test = tasks.make_task("modules", "", 8, 0.15).splits["test"]
    # the long ones: a short paragraph ("    Example:\n\n") may recur inside another
    long = [e.source for e in test if len(e.source) > 200]
    assert len(long) > 50 and not [text for text in long if text in train]


def test_a_broken_link_in_a_folder_or_glob_is_refused_naming_it(tmp_path):
    """A Hugging Face hub cache after an interrupted download: snapshots/<rev>/b.jsonl links to a
    blob that is not there. It was skipped, and the run went on with less data."""
    snapshot = tmp_path / "snapshots" / "rev"
    write(snapshot / "a.jsonl", "".join(json.dumps({"text": f"row {k}"}) + "\n" for k in range(30)))
    os.symlink("../../blobs/0123abcd", snapshot / "b.jsonl")
    os.symlink("/nonexistent/.hidden.jsonl", snapshot / ".hidden.jsonl")  # hidden: skipped
    broken = (f"{snapshot / 'b.jsonl'}: a broken symbolic link to {tmp_path / 'blobs' / '0123abcd'}"
              ", which does not exist: expected the file it links to (download it again, or "
              "remove the link)")
    for where in (snapshot, snapshot / "*.jsonl", tmp_path / "snapshots" / "*",
                  snapshot / "b.jsonl", tmp_path / "**" / "*.jsonl"):
        with pytest.raises(FileNotFoundError) as error:
            sources.read_text(str(where))
        assert str(error.value) == broken, where
    os.remove(snapshot / "b.jsonl")
    os.symlink("a.jsonl", snapshot / "b.jsonl")  # a link to a file that is there is read
    assert len(sources.read_text(str(snapshot))) == 60


@pytest.mark.parametrize("kind, column_type", [
    ("large_string", "large_string"), ("string_view", "string_view"),
    ("categorical", "dictionary<values=string, indices=int8, ordered=0>"),
    ("dictionary", "dictionary<values=string, indices=int32, ordered=0>")])
def test_parquet_text_held_as_a_view_large_string_or_categorical_is_read(tmp_path, kind,
                                                                         column_type):
    """Text columns as pandas (a categorical) or Arrow (string views, large strings, dictionary
    encoding) write them: read as strings; a bad row is still refused by its number."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    def write_texts(texts):
        path = str(tmp_path / f"{kind}.parquet")
        column = pa.array(texts, pa.string_view() if kind == "string_view" else
                          pa.large_string() if kind == "large_string" else pa.string())
        if kind == "categorical":  # pandas' Categorical of a few values: int8 codes
            column = column.dictionary_encode().cast(pa.dictionary(pa.int8(), pa.string()))
        elif kind == "dictionary":
            column = column.dictionary_encode()
        pq.write_table(pa.table({"text": column}), path)
        assert str(pq.read_schema(path).field("text").type) == column_type
        return path

    path = write_texts(["first", "second", "first"])
    assert [d.text for d in sources.read_text(path)] == ["first", "second", "first"]
    with pytest.raises(ValueError, match=r"\.parquet: row 2: text=None is NoneType: expected"):
        sources.read_text(write_texts(["first", "second", None]))
    if kind in ("string_view", "dictionary"):  # invalid UTF-8 (Arrow checks none on write)
        column = pa.array([b"ok", b"x\xff"], pa.binary()).view(pa.string())
        column = column.cast(pa.string_view()) if kind == "string_view" else \
            column.dictionary_encode()
        pq.write_table(pa.table({"text": column}), path)
        with pytest.raises(ValueError, match=r"row 1: text holds invalid UTF-8 at byte 1: "):
            sources.read_text(path)


def test_a_parquet_column_that_holds_no_text_is_refused(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    for name, column in (("ints", pa.array([1, 2])), ("bytes", pa.array([b"a", b"b"])),
                         ("codes", pa.array([1, 2]).dictionary_encode())):
        path = tmp_path / f"{name}.parquet"
        pq.write_table(pa.table({"text": column}), str(path))
        with pytest.raises(ValueError) as error:
            sources.read_text(str(path))
        assert str(error.value) == (f"{path}: row 0: the 'text' column holds "
                                    f"{pq.read_schema(path).field('text').type}: expected strings "
                                    "of text")


def test_a_spark_folders_underscore_files_are_skipped_and_other_text_beside_tables_warned(
        tmp_path, monkeypatch, capsys):
    """A Spark / Hadoop output folder: part files, _SUCCESS, _committed_<id> (JSON), and a
    _temporary/ folder, as pyarrow.dataset reads it (skipping "_..." names, its ignore_prefixes);
    a LICENSE and a README.md beside the tables are read, with a warning naming them (a .txt
    without one: a mixed folder's corpus). The listing is
    what the fingerprint covers, so a run that read the "_" files does not resume on them."""
    spark = tmp_path / "spark"
    part = write_parquet(spark / "part-00000-abc-c000.snappy.parquet", ["row one", "row two"])
    write(spark / "_SUCCESS", "")
    write(spark / "_committed_123", '{"added": ["part-00000-abc-c000.snappy.parquet"]}\n')
    write(spark / "_temporary" / "0" / "task.txt", "half-written task output")
    license_file = write(spark / "LICENSE", "Apache License\nVersion 2.0\n")
    now = sources.fingerprint(str(spark))
    monkeypatch.setattr(sources, "_beside_tables", lambda directory, files: files)
    older = sources.fingerprint(str(spark))  # the listing before: every non-hidden file
    monkeypatch.undo()

    capsys.readouterr()
    assert sources.document_files(str(spark)) == [license_file, part]
    assert [d.text for d in sources.read_text(str(spark))] == [
        "Apache License\nVersion 2.0\n", "row one", "row two"]
    assert capsys.readouterr().err == (
        f"warning: {spark}: {license_file} is read as text beside 1 Parquet / JSON Lines files "
        "(its paragraphs train): if it is not corpus, point data.path at the corpus files alone "
        "(a glob)\n")
    # The fingerprint covers the files read: an older run's (over the "_" files too) differs,
    # so its resume is refused as changed data; removing the skipped files changes nothing.
    assert now != older
    for name in ("_SUCCESS", "_committed_123", "_temporary/0/task.txt"):
        os.remove(spark / name)
    assert sources.fingerprint(str(spark)) == now

    notes = write(spark / "notes.txt", "more corpus")  # a .txt: corpus, no word (a mixed folder)
    write(spark / "README.md", "# A dataset card")  # several: the first named, and a count
    assert notes in sources.document_files(str(spark))
    sources.read_text(str(spark))
    assert capsys.readouterr().err == (
        f"warning: {spark}: {license_file} and 1 other files are read as text beside 1 Parquet / "
        "JSON Lines files (their paragraphs train): if they are not corpus, point data.path at "
        "the corpus files alone (a glob)\n")
    text_only = tmp_path / "text"  # no tables: every non-hidden file is corpus, "_" ones too
    for name in ("_intro.txt", "body.txt", ".hidden.txt"):
        write(text_only / name, name)
    assert sources.document_files(str(text_only)) == [
        str(text_only / "_intro.txt"), str(text_only / "body.txt")]
    assert notes in sources.document_files(str(spark / "*"))  # a glob names its files


def test_a_corrupt_parquet_page_names_its_row_group_and_rows(tmp_path):
    """A Parquet file corrupted inside (its footer intact): a page's compressed data, or its
    header (Thrift's error holds line breaks). The one-line error names the row group and its
    rows, the rows before it having been read."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from transformer.data import formats

    path = tmp_path / "shard.parquet"
    texts = [f"document {i} " * 20 for i in range(30)]
    pq.write_table(pa.table({"text": texts}), str(path), row_group_size=10, compression="snappy",
                   use_dictionary=False)
    written = path.read_bytes()
    chunk = pq.ParquetFile(str(path)).metadata.row_group(1).column(0)
    start, end = chunk.data_page_offset, chunk.data_page_offset + chunk.total_compressed_size
    for corrupt, at, cause in (("data", (start + 40, end), "OSError: Corrupt snappy"),
                               ("header", (start, start + 8), "OSError: Couldn't deserialize")):
        data = bytearray(written)
        data[at[0]:at[1]] = (b"\0" if corrupt == "data" else b"\xff") * (at[1] - at[0])
        path.write_bytes(bytes(data))
        read = []
        with pytest.raises(ValueError) as error:
            read.extend(formats.read_rows(str(path)))
        assert read == list(enumerate(texts[:10]))
        assert str(error.value).startswith(f"{path}: row group 1 (rows 10..19): unreadable "
                                           f"Parquet ({cause}")
        assert str(error.value).endswith("): expected a complete, uncorrupted Parquet file")
        assert "\n" not in str(error.value)


def test_two_mixture_sources_sharing_a_file_are_warned_at_start_up(tmp_path, capsys):
    """`web/*.parquet` and `web/part-1.parquet`: the shared file would train in both and its
    validation rows count twice in the sources' total, silently."""
    from transformer import configs

    web = tmp_path / "web"
    for k in range(3):
        write_parquet(web / f"part-{k}.parquet", [f"web {k} row {i}" for i in range(4)])
    shared = str(web / "part-1.parquet")
    config = configs.base_config()
    config.data.sources = (f"path={web}/*.parquet,weight=0.5,name=all",
                           f"path={shared},weight=0.5,name=p1")
    capsys.readouterr()
    configs.validate_config(config, num_devices=1, num_processes=1)
    assert capsys.readouterr().err == (
        f"warning: data.sources 'all' and 'p1' both read {shared} (their path): it trains in "
        "both (at their combined rate), and its validation rows count twice in `validation`: "
        "if not meant, point the paths at disjoint files\n")
    config.data.sources = (f"path={web}/part-0.parquet,weight=0.5,name=a",  # disjoint: quiet
                           f"path={shared},weight=0.5,name=b")
    configs.validate_config(config, num_devices=1, num_processes=1)
    assert capsys.readouterr().err == ""
