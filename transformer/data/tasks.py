"""Labeled tasks for fine-tuning: examples, stable splits, features and Grain datasets.

A task turns text into (text, label) examples of `data.num_classes` classes:

* `"speakers"`: which speaker says a speech of play text (`data.path`: tinyshakespeare-style
  text, one speech per paragraph, its first line `NAME:` alone, NAME an uppercase letter of any
  script, then letters, digits, spaces and ' . -); the classes are the most frequent speakers.
  Other paragraphs are skipped, and counted in the task's `balance`.
* `"modules"`: which standard-library module a paragraph of source comes from, derived from the
  embedded corpus (no `data.path`); the classes are the modules with the most paragraphs.

Splits use the same hash as pretraining (`sources.split_documents`) on the *whole paragraph*:
hash < f (f = `data.validation_fraction`) is "test", [f, 2f) "validation", the rest "train". So
a model pretrained on the same text with the same f never saw a test paragraph.

The classes are derived from the data (by frequency) each time it is read, so a classifier's
checkpoint records their names in class order with its data stream (`stream_labels`): resuming,
evaluating or starting from it where the data now gives other classes is refused
(`label_change`).

Features per objective (`data.objective`):
* `"classification"` (bert, gpt, prefix_lm): token rows + one integer target per row, weight 1
  (0 for the rows that pad the last evaluation batch); a prefix LM's rows are all prefix;
* `"text2text"` (t5): the text to the encoder, the label's name (its tokens + <eos>) as the
  decoder's target, and the class id under "label".
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import re

import grain
import jax
import ml_collections
import numpy as np

from transformer.data import pipeline, sources
from transformer.data.tokenizers import ByteTokenizer  # noqa: F401 (the doctests')
from transformer.models import family_of

TASKS = ("speakers", "modules")
OBJECTIVES = pipeline.TASK_OBJECTIVES  # ("classification", "text2text")
SPLITS = ("train", "validation", "test")
# A speaker's line: NAME, then `:`. NAME starts with a letter ([^\W\d_]: of any script; the
# first must be uppercase, checked apart: `re` has no class for it), then letters or digits
# ([^\W_]) and ' . - or spaces ("First Citizen", "ÉLISE", "CITIZEN2").
_SPEAKER = re.compile(r"([^\W\d_](?:[^\W_]|[' .-])*):[ \t]*")
_NO_NAME, _NO_SPEECH = "without a `NAME:` line of their own", "with an empty speech"
# The data stream's key for a labeled task's class names (`stream_labels`).
LABELS = "labels"


@dataclasses.dataclass(frozen=True)
class Example:
    text: str
    label: int
    source: str  # the paragraph the example came from (what the split hashes)


@dataclasses.dataclass(frozen=True)
class Task:
    name: str
    labels: tuple[str, ...]  # class names; class id = index
    splits: dict[str, tuple[Example, ...]]
    skipped: str = ""  # a line counting the paragraphs that are no example (`_skipped_note`)

    def balance(self) -> str:
        """One line per split: examples per class; and the paragraphs skipped, if any."""
        lines = []
        for split, examples in self.splits.items():
            counts = collections.Counter(e.label for e in examples)
            lines.append(f"{split} ({len(examples)}): " + ", ".join(
                f"{name} {counts[i]}" for i, name in enumerate(self.labels)))
        return "\n".join(lines + [self.skipped] * bool(self.skipped))


def speaker_speeches(text: str, skipped: list | None = None) -> list[tuple[str, str, str]]:
    """(speaker, speech, paragraph) of each paragraph of play text whose first line is `NAME:`
    (see the module docstring); `skipped` (a list) gets (why, first line) of every other one.

    >>> speaker_speeches("ROMEO:\\nBut soft!\\n\\nJULIET:\\nAy me!\\nO Romeo.\\n\\nStage.\\n")
    [('ROMEO', 'But soft!', 'ROMEO:\\nBut soft!\\n\\n'), ('JULIET', 'Ay me!\\nO Romeo.', \
'JULIET:\\nAy me!\\nO Romeo.\\n\\n')]
    >>> [name for name, _, _ in speaker_speeches("ÉLISE:\\nOui.\\n\\nCITIZEN2:\\nAy.\\n")]
    ['ÉLISE', 'CITIZEN2']
    """
    speeches = []
    for paragraph in sources.split_paragraphs(text):
        first, _, rest = paragraph.strip("\n").partition("\n")
        match = _SPEAKER.fullmatch(first.strip())
        named = match is not None and match.group(1)[0].isupper()
        if named and rest.strip():
            speeches.append((match.group(1), rest.strip(), paragraph))
        elif skipped is not None:
            skipped.append((_NO_SPEECH if named else _NO_NAME, first.strip()))
    return speeches


def _skipped_note(skipped: list[tuple[str, str]], total: int) -> str:
    """One line counting the paragraphs `speaker_speeches` skipped, with the first line of the
    first of each kind; "" where there are none.

    >>> _skipped_note([(_NO_NAME, "ROMEO: Hi."), (_NO_SPEECH, "JULIET:"), (_NO_NAME, "x")], 9)
    "skipped 3 of 9 paragraphs as no speech: 2 without a `NAME:` line of their own (the first: \
'ROMEO: Hi.'), 1 with an empty speech (the first: 'JULIET:')"
    """
    if not skipped:
        return ""
    counts = collections.Counter(why for why, _ in skipped)
    first = {}
    for why, line in skipped:
        first.setdefault(why, line)
    return f"skipped {len(skipped)} of {total} paragraphs as no speech: " + ", ".join(
        f"{count} {why} (the first: {first[why][:60]!r})" for why, count in counts.items())


def module_paragraphs() -> list[tuple[str, str, str]]:
    """(module, paragraph, paragraph) of the embedded corpus's standard-library files."""
    out = []
    for doc in sources.embedded_corpus():
        if doc.name.startswith("stdlib:"):
            module = doc.name.removeprefix("stdlib:").removesuffix(".py")
            out += [(module, p.strip(), p) for p in sources.split_paragraphs(doc.text)
                    if p.strip()]
    return out


def split_of(paragraph: str, fraction: float) -> str:
    """"test" / "validation" / "train" by the paragraph's hash (see the module docstring)."""
    h = sources._unit_hash(paragraph)
    return "test" if h < fraction else "validation" if h < 2 * fraction else "train"


def make_task(name: str, path: str, num_classes: int, fraction: float) -> Task:
    """The task's examples of its `num_classes` most frequent labels (ties by name; 0: all its
    labels), split."""
    if name not in TASKS:
        raise ValueError(f"data.task={name!r}: expected one of {TASKS}")
    if not isinstance(num_classes, int) or isinstance(num_classes, bool) or num_classes < 0 \
            or num_classes == 1:
        raise ValueError(f"data.num_classes={num_classes!r}: expected an int >= 2, or 0 (all the "
                         "task's labels)")
    if not 0.0 < fraction < 0.5:
        raise ValueError(f"data.validation_fraction={fraction}: expected a number in (0, 0.5) "
                         "(test and validation take that fraction each)")
    if name == "speakers":
        if not path:
            raise ValueError("data.task='speakers' reads play text: expected data.path (e.g. "
                             "tinyshakespeare.txt)")
        skipped: list[tuple[str, str]] = []
        rows = [r for doc in sources.read_text(path, split="file")
                for r in speaker_speeches(doc.text, skipped)]
        note = _skipped_note(skipped, len(rows) + len(skipped))
    else:
        if path:
            raise ValueError(f"data.task='modules' derives its text from the embedded corpus: "
                             f"expected data.path='', not {path!r}")
        rows, note = module_paragraphs(), ""
    counts = collections.Counter(label for label, _, _ in rows)
    if len(counts) < max(num_classes, 2):
        raise ValueError(f"data.num_classes={num_classes}: the text has only {len(counts)} "
                         f"labels ({sorted(counts)[:10]}...)" +
                         ": expected at least 2" * (num_classes == 0))
    labels = tuple(sorted(counts, key=lambda k: (-counts[k], k))[:num_classes or None])
    index = {label: i for i, label in enumerate(labels)}
    splits: dict[str, list[Example]] = {s: [] for s in SPLITS}
    for label, text, paragraph in rows:
        if label in index:
            splits[split_of(paragraph, fraction)].append(Example(text, index[label], paragraph))
    for split, examples in splits.items():
        if not examples:
            raise ValueError(f"the {split} split of task {name!r} is empty: expected more text "
                             "or a larger data.validation_fraction")
    return Task(name, labels, {s: tuple(e) for s, e in splits.items()}, note)


@functools.cache
def _cached_task(name, path, num_classes, fraction) -> Task:
    return make_task(name, path, num_classes, fraction)


def task_for(config: ml_collections.ConfigDict) -> Task:
    """The config's task (built once per process)."""
    data = config.data
    return _cached_task(data.task, data.path, data.num_classes, data.validation_fraction)


def stream_labels(config: ml_collections.ConfigDict) -> dict:
    """{LABELS: the class names, in class order} of a classifier's labeled task, for its data
    stream (`inputs.data_stream`): what its checkpoints' class ids stand for. {} for other runs
    (text2text's decoder writes the names themselves)."""
    if pipeline.objective_for(config) != "classification":
        return {}
    return {LABELS: list(task_for(config).labels)}


def label_change(saved, labels) -> str | None:
    """Where a checkpoint's recorded class names (`saved`, its stream's LABELS) differ from the
    task's now (`labels`), what is wrong, to follow "checkpoint ... "; None where they agree or
    either is unknown (a checkpoint saved before they were recorded).

    >>> label_change(["ROMEO", "NURSE"], ("NURSE", "ROMEO"))
    "was trained on the classes ['ROMEO', 'NURSE'], but the task's data now gives ['NURSE', \
'ROMEO'] (class i is the i-th name: its class ids would stand for other names)"
    """
    if saved is None or labels is None or list(saved) == list(labels):
        return None
    return (f"was trained on the classes {list(saved)}, but the task's data now gives "
            f"{list(labels)} (class i is the i-th name: its class ids would stand for other "
            "names)")


# --- feature converters ---------------------------------------------------------------------


def _pad(ids, length: int) -> tuple[np.ndarray, np.ndarray]:
    """(ids right-padded with 0 to `length`, segment ids: 1 on tokens, 0 on padding)."""
    out = np.zeros(length, np.int32)
    out[:len(ids)] = ids
    return out, (np.arange(length) < len(ids)).astype(np.int32)


def classification_features(ids: np.ndarray, label: int, *, seq_len: int, cls: bool,
                            tokenizer, prefix: bool = False) -> dict[str, np.ndarray]:
    """A text's token ids and its class -> one classification row of `seq_len` tokens.

    With `cls` (BERT) the model reads [CLS] text [SEP] (the head reads [CLS]); otherwise (GPT)
    <eos> text (the head reads the last token; <eos> starts a document, as in pretraining).
    Long texts are cut. With `prefix` (a prefix LM) the whole text is the prefix
    ("prefix_lengths"): the model reads it bidirectionally.

    >>> tok = ByteTokenizer(num_sentinels=0)  # [CLS] = 5, [SEP] = 6, <eos> = 2
    >>> f = classification_features(np.array([11, 12, 13]), 2, seq_len=6, cls=True, tokenizer=tok)
    >>> f["inputs"].tolist(), f["segment_ids"].tolist(), int(f["targets"])
    ([5, 11, 12, 13, 6, 0], [1, 1, 1, 1, 1, 0], 2)
    >>> classification_features(np.array([11, 12, 13]), 2, seq_len=3, cls=False,
    ...                         tokenizer=tok)["inputs"]
    array([ 2, 11, 12], dtype=int32)
    """
    if cls:
        tokens = [tokenizer.require("cls", "for a [CLS] classifier"), *ids[:seq_len - 2],
                  tokenizer.require("sep", "for a [CLS] classifier")]
    else:
        tokens = [tokenizer.eos_id, *ids[:seq_len - 1]]
    inputs, segment_ids = _pad(tokens, seq_len)
    return {"inputs": inputs, "segment_ids": segment_ids,
            "positions": (np.arange(seq_len) * segment_ids).astype(np.int32),
            "targets": np.int32(label), "weights": np.float32(1.0),
            **({"prefix_lengths": np.int32(len(tokens))} if prefix else {})}


def text2text_features(ids: np.ndarray, label: int, target_ids: np.ndarray, *, seq_len: int,
                       target_len: int, tokenizer) -> dict[str, np.ndarray]:
    """A text, its class and the class name's token ids -> one T5 row: the encoder reads the
    text + <eos> (cut to `seq_len`), the decoder the name + <eos> behind <bos>.

    >>> f = text2text_features(np.array([11, 12]), 1, np.array([40, 41]), seq_len=4,
    ...                        target_len=4, tokenizer=ByteTokenizer(num_sentinels=0))
    >>> f["encoder_inputs"].tolist(), f["encoder_segment_ids"].tolist()
    ([11, 12, 2, 0], [1, 1, 1, 0])
    >>> f["decoder_inputs"].tolist(), f["targets"].tolist(), f["weights"].tolist()
    ([1, 40, 41, 2], [40, 41, 2, 0], [1.0, 1.0, 1.0, 0.0])
    """
    encoder_inputs, encoder_segment_ids = _pad([*ids[:seq_len - 1], tokenizer.eos_id], seq_len)
    return {"encoder_inputs": encoder_inputs, "encoder_segment_ids": encoder_segment_ids,
            **decoder_features(target_ids, target_len, tokenizer), "label": np.int32(label)}


def decoder_features(target_ids: np.ndarray, target_len: int,
                     tokenizer) -> dict[str, np.ndarray]:
    """A decoder's teacher-forced features for a target: targets = ids + <eos> (cut and padded
    to `target_len`), decoder_inputs = the targets shifted right behind <bos>, weights 1 on
    the target tokens. (<bos> is the tokenizer's `decoder_start_id`: T5's own vocabulary starts
    the decoder with <pad>.)

    >>> decoder_features(np.array([40, 41]), 4, ByteTokenizer(0))["decoder_inputs"].tolist()
    [1, 40, 41, 2]
    """
    targets, mask = _pad([*target_ids, tokenizer.eos_id][:target_len], target_len)
    return {"decoder_inputs": np.concatenate([[tokenizer.decoder_start_id],
                                              targets[:-1]]).astype(np.int32),
            "targets": targets, "weights": mask.astype(np.float32)}


def label_names(task: Task, tokenizer) -> tuple[list[np.ndarray], int]:
    """(each class name's token ids, the decoder length: the longest + 1 for <eos>)."""
    names = [np.asarray(tokenizer.encode(name), np.int32) for name in task.labels]
    return names, max(len(n) for n in names) + 1


# --- datasets -------------------------------------------------------------------------------


class PadBatch(grain.transforms.Map):
    """Pads a short (final evaluation) batch to `batch_size` rows of weight 0."""

    def __init__(self, batch_size: int):
        self.batch_size = batch_size

    def map(self, batch):
        missing = self.batch_size - len(batch["weights"])
        if not missing:
            return batch
        return {k: np.concatenate([v, np.zeros((missing, *v.shape[1:]), v.dtype)])
                for k, v in batch.items()}


def local_rows(batch_size: int, rows=None) -> list[int]:
    """`rows`, or this process's contiguous block of the global batch rows."""
    if rows is not None:
        return list(rows)
    per_process = batch_size // jax.process_count()
    return list(range(per_process * jax.process_index(),
                      per_process * (jax.process_index() + 1)))


def make_dataset(config: ml_collections.ConfigDict, tokenizer, split: str, *,
                 num_epochs: int | None = None, shuffle: bool = True,
                 rows=None) -> grain.IterDataset:
    """This process's `rows` of each global batch of the task's `split` (see module docstring).

    Training (`num_epochs=None`) repeats and reshuffles every epoch; evaluation (`num_epochs=1`,
    `shuffle=False`) reads every example once, the last batch padded with rows of weight 0.
    """
    objective = config.data.objective
    if objective not in OBJECTIVES:
        raise ValueError(f"data.objective={objective!r}: expected one of {OBJECTIVES}")
    if split not in SPLITS:
        raise ValueError(f"split={split!r}: expected one of {SPLITS}")
    task = task_for(config)
    batch_size, seq_len = config.batch_size, config.seq_len
    if objective == "text2text":
        names, target_len = label_names(task, tokenizer)
        featurize = lambda e: text2text_features(tokenizer.encode(e.text), e.label,
                                                 names[e.label], seq_len=seq_len,
                                                 target_len=target_len, tokenizer=tokenizer)
    else:
        family = family_of(config)
        featurize = lambda e: classification_features(
            tokenizer.encode(e.text), e.label, seq_len=seq_len, cls=family.cls_token,
            tokenizer=tokenizer, prefix="prefix_lengths" in family.features)
    dataset = grain.MapDataset.source(task.splits[split])
    if shuffle:
        dataset = pipeline.shuffle_each_epoch(dataset, config.seed)
    dataset = dataset.repeat(num_epochs)
    return batched(dataset.map(featurize), batch_size, local_rows(batch_size, rows),
                   training=num_epochs is None)


def batched(examples: grain.MapDataset, batch_size: int, rows: list[int], *,
            training: bool) -> grain.IterDataset:
    """Global batches of feature dicts (training: full ones; evaluation: the last padded with
    rows of weight 0), cut to this process's `rows`."""
    dataset = examples.batch(batch_size, drop_remainder=training).map(PadBatch(batch_size))
    dataset = dataset.map(lambda b: {k: v[rows] for k, v in b.items()})
    return dataset.to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))
