"""Config key declarations: each key's default, allowed values (its check) and meaning, said
once. Dataclass fields declare theirs with `key(...)` (a `dataclasses.field` carrying a `Key`);
the run config's other keys are `Key`s in a table (`transformer.config_keys`). Validation, the
config reference (docs/config.md) and the checkpoint's structural comparison read them.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import re
from collections.abc import Callable, Iterator, Sequence
from typing import Any

# A check: (test of one value, what the value is expected to be). `test` never raises.
Check = tuple[Callable[[Any], bool], str]

NO_DEFAULT = object()  # a table entry whose default lives elsewhere (the model group's code)


@dataclasses.dataclass(frozen=True)
class Key:
    """One key: its default, its check, what it means, whether it is structural (a
    checkpoint's params or optimizer state depend on it, so a resume must keep it), and, for a
    model key, whether it is export-neutral (it changes how the model is computed, stored,
    initialised or trained, not the function a Hugging Face export maps: every exporter
    accepts it at any value; `hf.allowlist`), and whether it is a setting of softmax attention
    alone (`attention_only`: a model key no other token mixer reads, refused off its default
    on a stack without full or sliding attention layers, where it would do nothing;
    `TransformerConfig._check_mixers`), and what it needs to act at all (`needs`: (test of the
    config holding it, what the test asks for), e.g. a WSD knob needs optimizer.decay='wsd'):
    off its default where the test fails, the run's start warns that it has no effect
    (`config_keys.idle_settings`; legal, as a sweep's shared base config may hold
    it for the variants that set the other). A group of keys (`model.moe`) says the same for
    all of its keys by a class attribute `NEEDS` of the same form."""

    default: Any
    meaning: str
    check: Check
    structural: bool = True
    export_neutral: bool = False
    attention_only: bool = False
    needs: Check | None = None

    def __post_init__(self):
        if not (isinstance(self.meaning, str) and self.meaning.strip()):
            raise ValueError(f"a key with default {self.default!r}: expected a meaning")
        if not (isinstance(self.check, tuple) and len(self.check) == 2 and
                callable(self.check[0]) and isinstance(self.check[1], str) and self.check[1]):
            raise ValueError(f"a key with default {self.default!r} ({self.meaning!r}): expected "
                             "a check, (test, what the value is expected to be)")


def key(default, meaning: str, check: Check, *, structural: bool = True,
        export_neutral: bool = False, attention_only: bool = False, needs: Check | None = None):
    """A dataclass field with its declaration in `metadata["key"]`."""
    declaration = Key(default, meaning, check, structural, export_neutral, attention_only, needs)
    return dataclasses.field(default=default, metadata={"key": declaration})


def dotted(tree, prefix: str = "", *, empty_groups: bool = False) -> dict[str, Any]:
    """{dotted key: leaf} of a nested dict or ConfigDict; an empty group is dropped, or kept as
    a leaf with `empty_groups`.

    >>> dotted({"steps": 10, "model": {"moe": {"top_k": 2}, "lora": {}}})
    {'steps': 10, 'model.moe.top_k': 2}
    """
    flat = {}
    for name, value in tree.items():
        if hasattr(value, "items") and (len(value) or not empty_groups):
            flat.update(dotted(value, f"{prefix}{name}.", empty_groups=empty_groups))
        else:
            flat[prefix + name] = value
    return flat


def declarations(cls, prefix: str = "", needs: Check | None = None
                 ) -> Iterator[tuple[str, Key]]:
    """(dotted name, Key) of a dataclass's declared fields, in order; a field whose default is a
    dataclass (a group, e.g. `moe`) contributes its own, under `group.`, each needing what the
    group's class says it `NEEDS` (`Key.needs`) where it says nothing itself."""
    for field in dataclasses.fields(cls):
        if "key" in field.metadata:
            declared = field.metadata["key"]
            yield prefix + field.name, (dataclasses.replace(declared, needs=needs)
                                        if needs and not declared.needs else declared)
        elif dataclasses.is_dataclass(field.default):
            group = type(field.default)
            yield from declarations(group, f"{prefix}{field.name}.", getattr(group, "NEEDS", None))


def check_fields(obj, prefix: str = "", skip: Sequence[str] = ()) -> None:
    """Runs the declared check of each of `obj`'s fields (but `skip`): `NAME=VALUE: expected
    ...` for the first that fails."""
    for field in dataclasses.fields(obj):
        if "key" in field.metadata and field.name not in skip:
            test, expected = field.metadata["key"].check
            value = getattr(obj, field.name)
            if not test(value):
                raise ValueError(f"{prefix}{field.name}={value!r}: expected {expected}")


# --- checks --------------------------------------------------------------------------------------


def is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_number(value) -> bool:
    """Ints count as numbers (ml_collections may give an int for a float key); bools do not."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and \
        math.isfinite(value)


def bounded(kind: str, is_kind, ge=None, gt=None, le=None, lt=None, note: str = "") -> Check:
    """`kind` ("an int" | "a number") within the given bounds: "a number > 0", "an int >= 1",
    or with two bounds an interval, "a number in [0, 1)"."""
    low = f"[{ge}" if ge is not None else f"({gt}" if gt is not None else ""
    high = f"{le}]" if le is not None else f"{lt})" if lt is not None else ""
    if low and high:
        text = f"{kind} in {low}, {high}"
    else:
        text = kind + "".join(f" {op} {bound}" for op, bound in
                              ((">=", ge), (">", gt), ("<=", le), ("<", lt)) if bound is not None)

    def test(v):
        return is_kind(v) and (ge is None or v >= ge) and (gt is None or v > gt) and \
            (le is None or v <= le) and (lt is None or v < lt)

    return test, text + (f" ({note})" if note else "")


def int_(note: str = "", **bounds) -> Check:
    return bounded("an int", is_int, note=note, **bounds)


def number(note: str = "", **bounds) -> Check:
    return bounded("a number", is_number, note=note, **bounds)


def one_of(choices: Sequence[str]) -> Check:
    """"one of ('a', 'b')", the run config's wording."""
    return (lambda v: isinstance(v, str) and v in choices), f"one of {tuple(choices)}"


def choice(choices: Sequence[str]) -> Check:
    """"one of 'a', 'b'", the model's wording (its errors name the field, not the group)."""
    return (lambda v: v in choices), f"one of {', '.join(map(repr, choices))}"


def optional(check: Check, text: str = "") -> Check:
    """None or what `check` allows; `text` replaces the generated "None, or ..."."""
    test, expected = check
    return (lambda v: v is None or test(v)), text or f"None, or {expected}"


def described(check: Check, text: str) -> Check:
    """`check` with its allowed values said in other words (what a reader needs to know)."""
    return check[0], text


def is_regex(value) -> bool:
    try:
        re.compile(value)
    except (re.error, TypeError):
        return False
    return True


STR: Check = (lambda v: isinstance(v, str), "a str")
BOOL: Check = (lambda v: isinstance(v, bool), "a bool")
POSITIVE_INT: Check = (lambda v: is_int(v) and v > 0, "a positive int")
REGEX: Check = (lambda v: isinstance(v, str) and is_regex(v),
                "a regular expression of param names (\"\": none)")
