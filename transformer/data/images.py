"""Image data that ships with a package: scikit-learn's 8x8 handwritten digits (1,797 images,
10 classes, no download), as Grain datasets for ViT classification and CLIP pairs.

Splits by a hash of each image's pixels: hash < f (`data.validation_fraction`) is "test",
[f, 2f) "validation", the rest "train"; identical images share a split.

Objectives (`data.objective`):
* `"image_classification"` (vit): images [B, 8, 8, 1] in [0, 1], targets [B], weights [B];
* `"contrastive"` (clip): the images with captions (byte tokens, padded: `texts`,
  `text_segment_ids`), one of several templates drawn per example and epoch in training
  ("a photo of the digit three", "a handwritten 3", ...), the first template in evaluation;
* `"captioning"` (captioner): the images, the caption "a photo of the digit N" as the
  decoder's target (`decoder_inputs`, `targets`, `weights` over seq_len tokens) and the class
  under `label`.
"""

from __future__ import annotations

import functools
import hashlib

import grain
import ml_collections
import numpy as np

from transformer.data import pipeline, tasks

OBJECTIVES = pipeline.IMAGE_OBJECTIVES  # image_classification, contrastive, captioning
SPLITS = ("train", "validation", "test")
DIGIT_NAMES = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
TEMPLATES = ("a photo of the digit {name}", "a handwritten {digit}", "the number {name}",
             "a drawing of a {name}", "{name}", "an image of the digit {digit}")


@functools.cache
def digits() -> tuple[np.ndarray, np.ndarray]:
    """All 1,797 digits: (images float32 [N, 8, 8, 1] in [0, 1], labels int32 [N])."""
    from sklearn.datasets import load_digits

    data = load_digits()
    return (data.images[..., None] / 16.0).astype(np.float32), data.target.astype(np.int32)


def _unit_hash(image: np.ndarray) -> float:
    digest = hashlib.sha256(np.ascontiguousarray(image).tobytes()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def split_digits(split: str, fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """(images, labels) of one split of the digits (see the module docstring)."""
    if split not in SPLITS:
        raise ValueError(f"split={split!r}: expected one of {SPLITS}")
    if not 0.0 < fraction < 0.5:
        raise ValueError(f"data.validation_fraction={fraction}: expected a number in (0, 0.5) "
                         "(test and validation take that fraction each)")
    images, labels = digits()
    h = np.array([_unit_hash(image) for image in images])
    keep = {"test": h < fraction, "validation": (h >= fraction) & (h < 2 * fraction),
            "train": h >= 2 * fraction}[split]
    return images[keep], labels[keep]


def digits_task(config: ml_collections.ConfigDict) -> tasks.Task:
    """The digits as a labeled task (class names "0".."9"): its class balance per split and
    the labels of its confusion matrices."""
    fraction = config.data.validation_fraction
    return tasks.Task("digits", tuple(str(d) for d in range(len(DIGIT_NAMES))), {
        split: tuple(tasks.Example("", int(label), "") for label in
                     split_digits(split, fraction)[1]) for split in SPLITS})


def caption(label: int, template: int = 0) -> str:
    """A caption of a digit from one of `TEMPLATES`.

    >>> caption(3), caption(3, 1)
    ('a photo of the digit three', 'a handwritten 3')
    """
    return TEMPLATES[template].format(name=DIGIT_NAMES[label], digit=label)


def caption_length(objective: str, tokenizer=None) -> tuple[int, str]:
    """(the tokens of the longest caption `objective` feeds, + 1 for <eos>; that caption):
    every template's in contrastive training, the first template's in captioning (and in
    either's evaluation). Counted in `tokenizer`'s tokens, or without one in UTF-8 bytes (the
    byte tokenizer's count).

    >>> caption_length("captioning")
    (27, 'a photo of the digit three')
    """
    templates = range(len(TEMPLATES)) if objective == "contrastive" else (0,)
    texts = [caption(c, t) for t in templates for c in range(len(DIGIT_NAMES))]
    count = (lambda text: len(text.encode())) if tokenizer is None else \
        (lambda text: len(tokenizer.encode(text)))
    longest = max(texts, key=count)
    return count(longest) + 1, longest


def check_seq_len(seq_len: int, objective: str, tokenizer=None) -> None:
    """Refuses a seq_len that would cut a caption (`caption_length`): cut, two classes'
    captions can read the same ("a photo of the d"), and zero-shot or rank classification
    can no longer tell them apart."""
    need, longest = caption_length(objective, tokenizer)
    if seq_len < need:
        counted = "bytes" if tokenizer is None else "tokens"
        raise ValueError(f"seq_len={seq_len}: data.objective={objective!r} feeds captions of up "
                         f"to {need} {counted} ({longest!r} + <eos>): expected seq_len >= "
                         f"{need}, or its captions are cut")


def caption_features(text: str, tokenizer, seq_len: int) -> dict[str, np.ndarray]:
    """A caption -> byte tokens + <eos> (the text tower reads the last token), padded.

    >>> from transformer.data.tokenizers import build_tokenizer
    >>> f = caption_features("hi", build_tokenizer("byte", num_sentinels=0), 5)
    >>> f["texts"].tolist(), f["text_segment_ids"].tolist()
    ([111, 112, 2, 0, 0], [1, 1, 1, 0, 0])
    """
    ids = [*tokenizer.encode(text)[:seq_len - 1], tokenizer.eos_id]
    texts = np.zeros(seq_len, np.int32)
    texts[:len(ids)] = ids
    return {"texts": texts, "text_segment_ids": (np.arange(seq_len) < len(ids)).astype(np.int32)}


def class_captions(tokenizer, seq_len: int, *, decoder: bool = False) -> dict[str, np.ndarray]:
    """Each class's caption in the first template, [10, seq_len] rows: text-tower inputs
    (zero-shot CLIP), or with `decoder` the captioner's targets (rank classification).
    Refuses a seq_len that would cut its objective's captions (`check_seq_len`)."""
    check_seq_len(seq_len, "captioning" if decoder else "contrastive", tokenizer)
    rows = [tasks.decoder_features(tokenizer.encode(caption(c)), seq_len, tokenizer) if decoder else
            caption_features(caption(c), tokenizer, seq_len) for c in range(len(DIGIT_NAMES))]
    return {k: np.stack([r[k] for r in rows]) for k in rows[0]}


class _Featurize(grain.transforms.RandomMap):
    def __init__(self, objective, tokenizer, seq_len, training):
        self.objective, self.tokenizer = objective, tokenizer
        self.seq_len, self.training = seq_len, training

    def random_map(self, example, rng: np.random.Generator):
        image, label = example
        if self.objective == "captioning":
            return {"images": image, "label": np.int32(label), **tasks.decoder_features(
                self.tokenizer.encode(caption(int(label))), self.seq_len, self.tokenizer)}
        out = {"images": image, "targets": np.int32(label), "weights": np.float32(1.0)}
        if self.objective == "contrastive":
            template = int(rng.integers(len(TEMPLATES))) if self.training else 0
            out.update(caption_features(caption(int(label), template), self.tokenizer,
                                        self.seq_len))
        return out


def make_dataset(config: ml_collections.ConfigDict, tokenizer, split: str, *,
                 num_epochs: int | None = None, shuffle: bool = True,
                 rows=None) -> grain.IterDataset:
    """This process's `rows` of each global batch of `split` (see the module docstring).

    Training (`num_epochs=None`) repeats and reshuffles every epoch; evaluation reads every
    image once, the last batch padded with rows of weight 0. Refuses a seq_len that would cut
    the captions (`check_seq_len`).
    """
    objective = config.data.objective
    if objective not in OBJECTIVES:
        raise ValueError(f"data.objective={objective!r}: expected one of {OBJECTIVES}")
    if objective != "image_classification":
        check_seq_len(config.seq_len, objective, tokenizer)
    images, labels = split_digits(split, config.data.validation_fraction)
    dataset = grain.MapDataset.source(list(zip(images, labels, strict=True)))
    if shuffle:
        dataset = pipeline.shuffle_each_epoch(dataset, config.seed)
    dataset = dataset.repeat(num_epochs)
    dataset = dataset.random_map(_Featurize(objective, tokenizer, config.seq_len,
                                            training=num_epochs is None), seed=config.seed)
    return tasks.batched(dataset, config.batch_size, tasks.local_rows(config.batch_size, rows),
                         training=num_epochs is None)
