"""An experiment's data: saved tokenizer, text vs. prepared ArrayRecord sources, embedded corpus."""

import numpy as np
import pytest

from transformer.configs import base_config
from transformer.data import inputs, prepare, sources, tokenizers

TEXT = "".join(f"Paragraph {i}: the quick brown fox {i * 7} jumps.\n\n" for i in range(300))


def config_for(path, **data):
    config = base_config()
    config.seq_len, config.batch_size = 16, 4
    config.data.path = str(path)
    config.data.update(data)
    return config


@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text(TEXT)
    return path


def take(dataset, n):
    it = iter(dataset)
    return [next(it) for _ in range(n)]


def test_the_tokenizer_saved_in_the_workdir_wins_on_resume(text_file, tmp_path):
    workdir = tmp_path / "run"
    first = inputs.get_tokenizer(config_for(text_file, tokenizer="char"), str(workdir))
    assert not workdir.exists()  # a run saves it with its first checkpoint, not when built
    inputs.save_tokenizer(first, str(workdir))
    again = inputs.get_tokenizer(config_for(text_file, tokenizer="byte"), str(workdir))
    assert again.kind == "char" and again.vocab_size == first.vocab_size


def test_prepared_array_records_give_the_same_batches_as_the_text(text_file, tmp_path):
    prepared = tmp_path / "prepared"
    prepare.prepare(str(prepared), str(text_file), tokenizer="byte")
    from_text = config_for(text_file)
    from_records = config_for(prepared)
    tokenizer = inputs.get_tokenizer(from_records)
    assert tokenizer.kind == "byte"
    for split in ("train", "validation"):
        a = take(inputs.get_dataset(from_text, tokenizer, split), 5)
        b = take(inputs.get_dataset(from_records, tokenizer, split), 5)
        for x, y in zip(a, b, strict=True):
            for k in x:
                np.testing.assert_array_equal(x[k], y[k])
    for split in ("train", "validation"):  # prepare.json's counts give the text's targets
        assert inputs.bytes_per_token(from_text, tokenizer, split) == pytest.approx(
            inputs.bytes_per_token(from_records, tokenizer, split))
    # .bin shards read as one stream: every token but the first is a target
    prepare.prepare(str(tmp_path / "bin"), str(text_file), tokenizer="byte", format="bin")
    as_bin = config_for(tmp_path / "bin")
    tokens = len(inputs.corpus(as_bin, tokenizer, "validation"))
    num_bytes = sum(len(d.text.encode()) for d in inputs._documents(from_text, "validation"))
    assert inputs.bytes_per_token(as_bin, tokenizer, "validation") == pytest.approx(
        num_bytes / (tokens - 1))


def batches(config, tokenizer, split="train", n=5):
    return take(inputs.get_dataset(config, tokenizer, split), n)


def assert_same_batches(a, b):
    for x, y in zip(a, b, strict=True):
        for k in x:
            np.testing.assert_array_equal(x[k], y[k])


def test_prepared_documents_of_several_shards_train_in_input_order(text_file, tmp_path):
    """--num_shards=3 writes document j of a file to shard j % 3: training reads them back in
    input order, so it reads the batches of --num_shards=1 and of the text. A checkpoint of
    such data, saved when its shards were read one after another, does not resume on the
    new order; other data's stream is unchanged."""
    from transformer.training import checkpoint_manager

    streams, read = {}, {}
    for num_shards in (1, 3):
        prepared = tmp_path / f"shards{num_shards}"
        prepare.prepare(str(prepared), str(text_file), tokenizer="byte", num_shards=num_shards)
        config = config_for(prepared)
        tokenizer = inputs.get_tokenizer(config)
        read[num_shards] = {split: batches(config, tokenizer, split)
                            for split in ("train", "validation")}
        streams[num_shards] = inputs.data_stream(config)
    assert len(list(tmp_path.glob("shards3/train-*.array_record"))) == 3
    for split in ("train", "validation"):
        assert_same_batches(read[1][split], read[3][split])
        assert_same_batches(read[1][split], batches(config_for(text_file), tokenizer, split))
    assert "documents_in_input_order" not in streams[1]
    old = {k: v for k, v in streams[3].items() if k != "documents_in_input_order"}
    assert checkpoint_manager.stream_differences(old, streams[3]) == [
        "documents_in_input_order: checkpoint None, config True"]


@pytest.mark.parametrize("format", ["array_record", "bin"])
def test_prepared_data_in_a_directory_named_with_glob_characters(text_file, tmp_path, format):
    """data.path=prep/ar[v1] is that directory, not a glob pattern: it trains as prep/plain."""
    configs = []
    for name in ("plain", "ar[v1]"):
        prepare.prepare(str(tmp_path / name), str(text_file), tokenizer="byte", format=format,
                        **({"tokens_per_shard": 4000} if format == "bin" else {}))
        configs.append(config_for(tmp_path / name))
    tokenizer = inputs.get_tokenizer(configs[1])
    for split in ("train", "validation"):
        assert_same_batches(*(batches(config, tokenizer, split) for config in configs))
    assert inputs.data_stream(configs[0])["fingerprint"] == \
        inputs.data_stream(configs[1])["fingerprint"]


def test_prepared_data_tokenized_otherwise_than_the_config_says_is_refused(text_file, tmp_path):
    prepared = tmp_path / "prepared"
    prepare.prepare(str(prepared), str(text_file), tokenizer="char")
    with pytest.raises(ValueError, match="data.tokenizer='byte': the prepared data .* was "
                       "tokenized with 'char': expected data.tokenizer='char'"):
        inputs.get_tokenizer(config_for(prepared, tokenizer="byte"))
    assert inputs.get_tokenizer(config_for(prepared, tokenizer="char")).kind == "char"


def test_embedded_corpus_feeds_every_objective_without_a_download():
    config = base_config()
    config.seq_len, config.batch_size = 32, 2
    tokenizer = inputs.get_tokenizer(config)
    for family in ("gpt", "prefix_lm", "bert", "t5"):
        config.model.family = family
        batch = take(inputs.get_dataset(config, tokenizer, "train"), 1)[0]
        key = "encoder_inputs" if family == "t5" else "inputs"
        assert batch[key].shape == (2, 32) and batch[key].max() < tokenizer.vocab_size
    ratio = inputs.bytes_per_token(config, tokenizer, "validation")
    # bytes per target token: a packed document's targets are its tokens and <eos> but its
    # first, as many as its bytes under the byte tokenizer
    assert tokenizer.kind == "byte" and ratio == 1.0
    # 64 rows from a split of 17 documents (whole files): rows are windows through the split's
    # tokens, not documents, so any batch size works.
    config.batch_size, config.model.family, config.data.unit = 64, "gpt", "file"
    assert len(sources.load_documents(None, "validation", unit="file")) < 64
    batch = next(iter(inputs.get_dataset(config, tokenizer, "validation", num_epochs=1)))
    assert batch["inputs"].shape == (64, config.seq_len) and batch["weights"].all()


def test_stream_unit_splits_the_text_at_its_last_validation_fraction(text_file, tmp_path):
    """data.unit="stream" (nanoGPT's convention): train is the first 95% of the characters,
    validation the rest; a window crosses paragraphs. data.validation_path makes the splits
    explicit: all of data.path trains, all of the other file validates."""
    config = config_for(text_file, tokenizer="byte", unit="stream")
    tokenizer = tokenizers.build_tokenizer("byte")
    text = text_file.read_text()
    cut = round(len(text) * 0.95)
    train, validation = (inputs.corpus(config, tokenizer, s) for s in ("train", "validation"))
    assert train.stream and validation.stream
    assert tokenizer.decode(train.read(0, len(train) - 1)) == text[:cut]  # then <eos>
    assert tokenizer.decode(validation.read(0, len(validation) - 1)) == text[cut:]
    other = tmp_path / "held_out.txt"
    other.write_text("Held out.\n\nEntirely.\n")
    config = config_for(text_file, tokenizer="byte", validation_path=str(other))
    assert [d.text for d in inputs._documents(config, "train")] == \
        sources.split_paragraphs(text)
    assert [d.text for d in inputs._documents(config, "validation")] == \
        ["Held out.\n\n", "Entirely.\n"]


def test_rows_select_the_global_batch_rows_this_process_produces(text_file):
    config = config_for(text_file, tokenizer="byte", objective="mlm")
    tokenizer = tokenizers.build_tokenizer("byte")
    full = take(inputs.get_dataset(config, tokenizer, "train"), 3)
    mine = take(inputs.get_dataset(config, tokenizer, "train", rows=[3, 1]), 3)
    for whole, part in zip(full, mine, strict=True):
        for k in whole:
            np.testing.assert_array_equal(part[k], whole[k][[3, 1]])


def test_validation_batches_are_a_finite_pass(text_file):
    config = config_for(text_file)
    tokenizer = tokenizers.build_tokenizer("byte")
    batches = list(inputs.get_dataset(config, tokenizer, "validation", num_epochs=1,
                                      shuffle=False))
    assert 0 < len(batches) < 100


def test_test_path_is_a_split_of_its_own_that_nothing_trains_on(text_file, tmp_path):
    held_out = tmp_path / "test.txt"
    held_out.write_text("Never trained on.\n\nNor validated.\n")
    config = config_for(text_file, tokenizer="byte", unit="stream", test_path=str(held_out))
    tokenizer = tokenizers.build_tokenizer("byte")
    test = inputs.corpus(config, tokenizer, "test")
    assert tokenizer.decode(test.read(0, len(test))) == held_out.read_text() + "<eos>"
    for split in ("train", "validation"):  # the stream split of data.path is unchanged
        assert "Never" not in "".join(d.text for d in inputs._documents(config, split))
        without = config_for(text_file, tokenizer="byte", unit="stream")
        assert inputs._documents(config, split) == inputs._documents(without, split)
    assert inputs.has_test_split(config) and not inputs.has_test_split(without)
    # resumes either way: the test file's fingerprint is recorded, never a difference
    from transformer.training.checkpoint_manager import stream_differences

    assert stream_differences(inputs.data_stream(without), inputs.data_stream(config)) == []
    assert inputs.data_stream(config)[inputs.TEST_FINGERPRINT] == sources.fingerprint(held_out)
    with pytest.raises(ValueError, match="split='test' without a test_path"):
        inputs.corpus(without, tokenizer, "test")
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    with pytest.raises(ValueError, match="empty.txt: no text in 1 file"):
        inputs.corpus(config_for(text_file, test_path=str(empty)), tokenizer, "test")


@pytest.mark.parametrize("data,match", [
    (dict(test_path="missing.txt"), "missing.txt"),
    (dict(test_path="{text}", objective="classification", task="modules"),
     "with data.objective='classification': expected a text pretraining objective"),
    (dict(path="", test_path="{text}", sources=("path={text},weight=1",)),
     "with data.sources: expected '' \\(a mixture has no test split\\)"),
])
def test_bad_test_paths_are_one_line_errors(text_file, data, match):
    from transformer import configs

    config = config_for(text_file)
    config.data.update({k: v.format(text=text_file) if isinstance(v, str) else
                        tuple(x.format(text=text_file) for x in v) for k, v in data.items()})
    if data.get("objective") == "classification":
        config.model.update(family="bert", head="classify")
    with pytest.raises((ValueError, FileNotFoundError), match=match) as error:
        configs.validate_config(config)
    assert "\n" not in str(error.value)


@pytest.mark.slow
def test_a_run_with_test_path_reports_the_whole_test_split_at_its_end(text_file, tmp_path):
    from test_train import TINY_MODEL

    from transformer import evaluate, train
    from transformer.training import checkpoint

    held_out = tmp_path / "test.txt"
    held_out.write_text("".join(f"Test {i}: a lazy dog {i * 3}.\n\n" for i in range(40)))
    config = config_for(text_file, tokenizer="byte", test_path=str(held_out))
    config.update(steps=2, log_every=1, eval_every=2, eval_steps=1, checkpoint_every=2)
    config.model.update(**TINY_MODEL)
    workdir = tmp_path / "run"
    summary = train.train_and_evaluate(config, str(workdir))["summary"]
    again = evaluate.evaluate_workdir(str(workdir), split="test")
    assert summary["test_loss"] == pytest.approx(again["loss"], rel=1e-6)
    # The whole split: every next-token prediction of the test text, once.
    tokenizer = inputs.get_tokenizer(config, str(workdir))
    docs = sources.read_text(str(held_out))
    assert again["num_tokens"] == sum(len(tokenizer.encode(d.text)) for d in docs)
    assert summary["test_bits_per_byte"] == pytest.approx(
        summary["test_loss"] / np.log(2) / inputs.bytes_per_token(config, tokenizer, "test"))
    # --eval_seq_len reads the split asked for (it read validation under a _test name).
    at_length = evaluate.evaluate_workdir(str(workdir), split="test", seq_lens=(config.seq_len,))
    assert at_length["by_seq_len"][config.seq_len]["loss"] == pytest.approx(again["loss"])
    assert (workdir / f"eval_2_len{config.seq_len}_test.json").exists()
    # Evaluating after the data changed says so, in the results too (it was silent).
    assert "data_changed" not in again
    held_out.write_text(held_out.read_text() + "A test paragraph added after training.\n")
    changed = evaluate.evaluate_workdir(str(workdir), split="test")  # (it was not compared)
    assert changed["data_changed"] == [
        f"{held_out} content fingerprint: checkpoint "
        f"{checkpoint.saved_stream(str(workdir), 2)[inputs.TEST_FINGERPRINT]!r}, config "
        f"{sources.fingerprint(str(held_out))!r}"]
    assert "data_changed" not in evaluate.evaluate_workdir(str(workdir))  # not validation's
    text_file.write_text(TEXT + "A paragraph added after training.\n")
    changed = evaluate.evaluate_workdir(str(workdir))
    assert changed["data_changed"][0].startswith("content fingerprint: checkpoint '")


def test_evaluation_splits_are_tokenized_once_and_again_when_the_text_changes(tmp_path):
    text_file = tmp_path / "corpus.txt"
    text_file.write_text(TEXT)
    config = config_for(text_file, tokenizer="byte", unit="stream")
    tokenizer = tokenizers.build_tokenizer("byte")
    first = inputs.corpus(config, tokenizer, "validation")
    assert inputs.corpus(config, tokenizer, "validation") is first  # every evaluation
    assert inputs.corpus(config, tokenizer, "train") is not inputs.corpus(config, tokenizer,
                                                                          "train")
    text_file.write_text(TEXT + "One more paragraph.\n")
    changed = inputs.corpus(config, tokenizer, "validation")
    assert changed is not first
    assert tokenizer.decode(changed.read(len(changed) - 21, len(changed) - 1)) == \
        "One more paragraph.\n"


# --- which files each split reads ---------------------------------------------------------------


def test_a_shard_named_for_both_splits_goes_by_its_name_parts(tmp_path):
    """"*train*.bin" and "*val*.bin" both match pretrain_val_000000.bin (a validation shard)
    and retrieval_train_000000.bin (a training one): the name's parts decide."""
    from transformer.data import shards

    layouts = {"nanogpt": ("train.bin", "val.bin"),
               "modded": ("fineweb_train_000001.bin", "fineweb_val_000000.bin"),
               "pretrain": ("pretrain_train_000000.bin", "pretrain_val_000000.bin"),
               "retrieval": ("retrieval_train_000000.bin", "retrieval_val_000000.bin")}
    for name, (train, val) in layouts.items():
        for file, first in ((train, 1), (val, 2)):
            shards.write_token_shards(str(tmp_path / name / file[:-4]), [np.full(8, first)],
                                      format="nanogpt")
        config = config_for(tmp_path / name)
        assert inputs.token_shard_dir(config.data.path)
        for split, file in (("train", train), ("validation", val)):
            assert inputs._token_shards(config, split).paths == [str(tmp_path / name / file)]
        # A checkpoint of such a folder read its shards into both splits: its stream differs.
        assert ("shards_by_name_parts" in inputs.data_stream(config)) == (
            name in ("pretrain", "retrieval"))
    shards.write_token_shards(str(tmp_path / "pretrain" / "pretrainval"), [np.arange(4)],
                              format="nanogpt")
    with pytest.raises(ValueError) as error:
        inputs._token_shards(config_for(tmp_path / "pretrain"), "train")
    assert str(error.value) == (
        f"{tmp_path / 'pretrain' / 'pretrainval.bin'}: its name matches both '*train*.bin' and "
        "'*val*.bin', and its parts do not say which split: expected one part starting with "
        "'train' or 'val' (rename the shard)")


def test_held_out_files_among_the_training_files_are_refused(tmp_path):
    """data.path=dir with validation_path=dir/val.txt would train on the validation text."""
    from transformer import configs

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "train.txt").write_text(TEXT)
    (corpus / "val.txt").write_text(TEXT.upper())
    val = str(corpus / "val.txt")
    for key in ("validation_path", "test_path"):
        with pytest.raises(ValueError) as error:
            configs.validate_config(config_for(corpus, **{key: val}))
        assert str(error.value) == (
            f"data.{key}={val!r}: {val} is also a training file, of data.path={str(corpus)!r}: "
            "expected held-out files apart from the training files (point the path at the "
            "train files alone, e.g. a glob)")
        configs.validate_config(config_for(corpus / "train.txt", **{key: val}))  # apart: fine
    with pytest.raises(ValueError, match=f"data.sources 'corpus': validation_path='{val}': "
                                         f"{val} is also a training file, of data.sources "
                                         "'corpus': path="):
        configs.validate_config(config_for(
            "", sources=(f"path={corpus},weight=1,validation_path={val}",)))


def test_prepared_data_refuses_settings_that_contradict_what_it_was_prepared_with(text_file,
                                                                                  tmp_path):
    """prepare.json fixes the unit, the validation split and the text field, the tokenizer its
    sentinels; a default left in the config is taken as unset, except data.unit's stream-ness,
    which decides how training reads ArrayRecord documents."""
    from transformer import configs

    prepared = tmp_path / "stream"
    prepare.prepare(str(prepared), str(text_file), tokenizer="byte", unit="stream")
    with pytest.raises(ValueError) as error:
        configs.validate_config(config_for(prepared))  # trained as paragraphs until now
    assert str(error.value) == (
        f"data.unit='paragraph': the prepared data {str(prepared)!r} was prepared with "
        "unit='stream': expected --config.data.unit=stream")
    config = config_for(prepared, unit="stream")
    configs.validate_config(config)
    assert inputs.corpus(config, None, "train").stream
    for data, message in [
        ({"validation_fraction": 0.1}, "data.validation_fraction=0.1: the prepared data "
         f"{str(prepared)!r} was prepared with validation_fraction=0.05: expected "
         "--config.data.validation_fraction=0.05"),
        ({"text_field": "content"}, "data.text_field='content': the prepared data "
         f"{str(prepared)!r} was prepared with text_field='text': expected "
         "--config.data.text_field=text"),
    ]:
        with pytest.raises(ValueError) as error:
            configs.validate_config(config_for(prepared, unit="stream", **data))
        assert str(error.value) == message
    with pytest.raises(ValueError) as error:  # (checked where the tokenizer is loaded)
        inputs.get_tokenizer(config_for(prepared, unit="stream", num_sentinels=0))
    assert str(error.value) == (
        f"data.num_sentinels=0: the tokenizer of the prepared data {str(prepared)!r} has 100 "
        "sentinels: expected data.num_sentinels=100")
    with pytest.raises(ValueError, match=r"data.sources 'stream': unit='paragraph': .* was "
                                         r"prepared with unit='stream': expected unit=stream in "
                                         "its entry"):
        configs.validate_config(config_for("", sources=(f"path={prepared},weight=1",)))
    configs.validate_config(config_for("", sources=(f"path={prepared},weight=1,unit=stream",)))
    paragraphs = tmp_path / "paragraphs"
    prepare.prepare(str(paragraphs), str(text_file), tokenizer="byte", validation_fraction=0.2)
    configs.validate_config(config_for(paragraphs))  # defaults left: prepare.json's apply
    with pytest.raises(ValueError, match="data.unit='file': .* was prepared with unit='paragraph'"):
        configs.validate_config(config_for(paragraphs, unit="file"))
    bin_stream = tmp_path / "bin_stream"  # .bin shards train as a stream whatever data.unit says
    prepare.prepare(str(bin_stream), str(text_file), tokenizer="byte", unit="stream",
                    format="bin")
    configs.validate_config(config_for(bin_stream))


def test_a_shard_named_for_neither_split_is_left_out_with_a_warning(tmp_path, capsys):
    from transformer.data import shards

    for file in ("train", "val", "fineweb_000002"):
        shards.write_token_shards(str(tmp_path / file), [np.arange(8)], format="nanogpt")
    config = config_for(tmp_path)
    assert inputs._token_shards(config, "train").paths == [str(tmp_path / "train.bin")]
    assert capsys.readouterr().err == (
        f"warning: data.path={str(tmp_path)!r}: fineweb_000002.bin matches neither "
        "'*train*.bin' nor '*val*.bin': not read (name a shard for its split)\n")


# --- the tokenizer a run reads with must be the one its settings say -----------------------------


def test_a_resume_refuses_other_sentinels_or_vocab_size_than_its_saved_tokenizer(text_file,
                                                                                 tmp_path):
    """A resume (new_data=True too) reads the tokenizer saved in its workdir: a changed
    data.num_sentinels would mark T5 spans with ids of real characters, a changed vocab_size
    would be recorded for a tokenizer that does not have it."""
    workdir = str(tmp_path / "run")
    config = config_for(text_file, tokenizer="char", num_sentinels=2)
    inputs.save_tokenizer(inputs.get_tokenizer(config), workdir)
    assert inputs.get_tokenizer(config, workdir).num_sentinels == 2  # unchanged: resumes
    for sentinels in (4, tokenizers.NUM_SENTINELS):  # the default is a count like any other
        with pytest.raises(ValueError) as error:
            inputs.get_tokenizer(config_for(text_file, tokenizer="char",
                                            num_sentinels=sentinels), workdir)
        assert str(error.value) == (
            f"data.num_sentinels={sentinels}: the tokenizer {workdir!r} was trained with has 2 "
            "sentinels: expected data.num_sentinels=2")
    spm = str(tmp_path / "spm")
    config = config_for(text_file, tokenizer="sentencepiece_bpe", vocab_size=300)
    inputs.save_tokenizer(inputs.get_tokenizer(config), spm)
    assert inputs.get_tokenizer(config, spm).vocab_size == 300 + tokenizers.NUM_SENTINELS
    with pytest.raises(ValueError) as error:
        inputs.get_tokenizer(config_for(text_file, tokenizer="sentencepiece_bpe",
                                        vocab_size=320), spm)
    assert str(error.value) == (
        f"data.vocab_size=320: the tokenizer {spm!r} was trained with has 300 pieces "
        "(sentinels not counted): expected data.vocab_size=300")


def test_a_fine_tune_refuses_other_sentinels_than_its_init_from_tokenizer(text_file, tmp_path):
    """init_from=WORKDIR reads text with the pretraining's tokenizer: a data.num_sentinels
    other than its count would be dropped silently (T5 spans marked with the saved ids)."""
    pretrained = str(tmp_path / "pretrained")
    inputs.save_tokenizer(inputs.get_tokenizer(config_for(text_file, tokenizer="char",
                                                          num_sentinels=2)), pretrained)
    config = config_for(text_file, tokenizer="char", num_sentinels=2)
    config.init_from = pretrained
    assert inputs.get_tokenizer(config).num_sentinels == 2
    config.data.num_sentinels = 5
    with pytest.raises(ValueError) as error:
        inputs.get_tokenizer(config)
    assert str(error.value) == (
        f"data.num_sentinels=5: the tokenizer of init_from={pretrained!r} has 2 sentinels: "
        "expected data.num_sentinels=2")


def test_a_resume_on_prepared_data_takes_its_sentinels_where_the_config_leaves_the_default(
        text_file, tmp_path):
    """Prepared data's tokenizer fixes the sentinels (a Hugging Face one's own count, here 0):
    a config that leaves data.num_sentinels at its default resumes; another count is refused."""
    prepared, workdir = tmp_path / "prepared", str(tmp_path / "run")
    prepare.prepare(str(prepared), str(text_file), tokenizer="byte")
    tokenizers.ByteTokenizer(num_sentinels=0).save(str(prepared))  # as GPT-2's would have
    inputs.save_tokenizer(inputs.get_tokenizer(config_for(prepared)), workdir)
    assert inputs.get_tokenizer(config_for(prepared), workdir).num_sentinels == 0
    with pytest.raises(ValueError, match=r"^data.num_sentinels=3: the tokenizer .* was trained "
                                         r"with has 0 sentinels: expected data.num_sentinels=0$"):
        inputs.get_tokenizer(config_for(prepared, num_sentinels=3), workdir)


def test_prepared_sentencepiece_data_refuses_another_vocab_size(text_file, tmp_path):
    prepared = tmp_path / "prepared"
    prepare.prepare(str(prepared), str(text_file), tokenizer="sentencepiece_bpe", vocab_size=300)
    for size in (0, 300):  # unset, or the prepared tokenizer's
        config = config_for(prepared, tokenizer="sentencepiece_bpe", vocab_size=size)
        assert inputs.get_tokenizer(config).vocab_size == 300 + tokenizers.NUM_SENTINELS
    with pytest.raises(ValueError) as error:
        inputs.get_tokenizer(config_for(prepared, tokenizer="sentencepiece_bpe", vocab_size=512))
    assert str(error.value) == (
        f"data.vocab_size=512: the tokenizer of the prepared data {str(prepared)!r} has 300 "
        "pieces (sentinels not counted): expected data.vocab_size=300 or 0")


def test_characters_a_char_tokenizer_never_saw_in_train_are_warned_of(tmp_path, capsys):
    """They read as <unk> in validation, a cheap token: bits per byte reads low. Warned once
    per split where it is tokenized for training / evaluate, and by prepare."""
    train, validation = tmp_path / "train.txt", tmp_path / "validation.txt"
    train.write_text("the cat sat on the mat.\n\nthe dog ran.\n")
    validation.write_text("the cat sat on the mat.\n\nthe dog ate the zeta\u00e9z.\n")
    config = config_for(train, tokenizer="char", validation_path=str(validation))
    tokenizer = inputs.get_tokenizer(config)
    capsys.readouterr()
    for _ in range(2):  # every evaluation reads it: one warning
        inputs.corpus(config, tokenizer, "validation")
    assert capsys.readouterr().err.splitlines() == [
        f"warning: the validation split (data.validation_path={str(validation)!r}) holds 3 "
        "characters (2 distinct: 'z', '\u00e9') that the char tokenizer has no id for (the train "
        "split it was built from has none): each reads as <unk>, so bits per byte undercounts "
        "them"]
    inputs.corpus(config, tokenizer, "train")
    assert not capsys.readouterr().err
    # prepare: paragraphs of one character each that no other paragraph holds
    corpus = tmp_path / "unique.txt"
    corpus.write_text("".join(f"Paragraph {i}: the fox {chr(0x4E00 + i)}.\n\n"
                              for i in range(200)))
    prepare.prepare(str(tmp_path / "prepared"), str(corpus), tokenizer="char")
    tokens = inputs.corpus(config_for(tmp_path / "prepared", tokenizer="char"), None,
                           "validation").tokens
    unknown = int(np.sum(np.asarray(tokens) == tokenizers.UNK_ID))
    [line] = [line for line in capsys.readouterr().err.splitlines() if "no id for" in line]
    assert unknown > 0 and line.startswith(
        f"warning: --output_dir={tmp_path / 'prepared'}: the validation split holds {unknown} "
        f"characters ({unknown} distinct: ")
