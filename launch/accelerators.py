"""Cloud TPU slice types: chips, hosts, HBM per chip, the default runtime image and the
topology name that ahead-of-time compilation targets.

An accelerator type is what `gcloud --accelerator-type` takes: `v5p-32` (v4 and v5p count
TensorCores, two per chip: 16 chips), `v6e-8` and `v5litepod-16` (v5e and v6e count chips).
"""

from __future__ import annotations

import dataclasses
import math
import re


@dataclasses.dataclass(frozen=True)
class Generation:
    name: str  # the prefix of the accelerator type
    cores_per_chip: int  # what the type's number counts per chip
    chips_per_host: int  # on multi-host slices
    max_single_host_chips: int  # slices up to this many chips run on one host
    hbm_gib: float  # per chip
    runtime_version: str  # default TPU VM image
    topology_dims: int  # 3-D torus (v4, v5p) or 2-D (v5e, v6e)
    topology_prefix: str  # for jax.experimental.topologies ("v5p:2x2x1")
    chip_counts: tuple[int, ...]  # the slice sizes Cloud TPU offers, in chips


def _powers_of_two(smallest: int, largest: int) -> tuple[int, ...]:
    return tuple(2**i for i in range(smallest.bit_length() - 1, largest.bit_length()))


GENERATIONS = {
    # HBM: what XLA:TPU reports as available to a program (a little under the nominal size).
    # Slice sizes: the Cloud TPU docs' tables of each generation. v4 and v5p also offer some
    # shapes that are not powers of two (v4's 12x12x24, "most but not all" v5p full-cube
    # shapes) whose type names the docs do not list: not offered here. The largest v5p slice
    # is 16x16x24 (v5p-12288, 6144 chips; its pod has 8960); v5e and v6e have no 2-chip slice.
    "v4": Generation("v4", 2, 4, 4, 30.75, "tpu-ubuntu2204-base", 3, "v4",
                     _powers_of_two(4, 4096)),
    "v5p": Generation("v5p", 2, 4, 4, 95.74, "v2-alpha-tpuv5", 3, "v5p",
                      (*_powers_of_two(4, 4096), 6144)),
    "v5litepod": Generation("v5litepod", 1, 4, 8, 15.75, "v2-alpha-tpuv5-lite", 2, "v5e",
                            (1, *_powers_of_two(4, 256))),
    "v6e": Generation("v6e", 1, 4, 8, 31.25, "v2-alpha-tpuv6e", 2, "v6e",
                      (1, *_powers_of_two(4, 256))),
}
# Slices whose chip grid is not the near-cubic one of their (non power of two) chip count.
_TOPOLOGIES = {("v5p", 6144): (16, 16, 24)}
_ALIASES = {"v5e": "v5litepod"}


@dataclasses.dataclass(frozen=True)
class Accelerator:
    """One slice type, e.g. `parse("v5p-32")`: 16 chips on 4 hosts, 95.74 GiB HBM per chip."""

    name: str
    generation: Generation
    chips: int

    @property
    def hosts(self) -> int:
        g = self.generation
        return 1 if self.chips <= g.max_single_host_chips else self.chips // g.chips_per_host

    @property
    def chips_per_host(self) -> int:
        return self.chips // self.hosts

    @property
    def hbm_bytes(self) -> int:
        return int(self.generation.hbm_gib * 2**30)

    @property
    def topology(self) -> str:
        """The chip grid, e.g. "2x2x4" for v5p-32: the smallest near-cubic torus."""
        grid = _TOPOLOGIES.get((self.generation.name, self.chips)) or \
            _grid(self.chips, self.generation.topology_dims)
        return "x".join(map(str, grid))

    @property
    def topology_name(self) -> str:
        """What `jax.experimental.topologies.get_topology_desc` takes, e.g. "v5p:2x2x4"."""
        return f"{self.generation.topology_prefix}:{self.topology}"


def _grid(chips: int, dims: int) -> list[int]:
    """Powers of two multiplying to `chips`, as even as possible, smallest first.

    >>> _grid(16, 3), _grid(8, 2), _grid(4, 3), _grid(1, 2)
    ([2, 2, 4], [2, 4], [2, 2, 1], [1, 1])
    """
    sizes = [1] * dims
    for i in range(int(math.log2(chips))):
        sizes[i % dims] *= 2
    if dims == 3 and chips == 4:  # v4-8 / v5p-8 are a 2x2x1 slice
        return [2, 2, 1]
    return sorted(sizes)


def parse(name: str, flag: str = "accelerator") -> Accelerator:
    """The accelerator type `name` ("v5p-32"), with a one-line error for unknown ones naming
    `flag` (the flag that gave it).

    >>> a = parse("v5p-32"); (a.chips, a.hosts, a.topology_name)
    (16, 4, 'v5p:2x2x4')
    >>> a = parse("v6e-8"); (a.chips, a.hosts, a.topology_name, a.generation.hbm_gib)
    (8, 1, 'v6e:2x4', 31.25)
    """
    match = re.fullmatch(r"([a-z0-9]+)-(\d+)", name or "")
    known = ", ".join(f"{g}-N" for g in GENERATIONS)
    if not match:
        raise ValueError(f"{flag}={name!r}: expected a TPU type like v5p-32 or v6e-8 "
                         f"({known})")
    prefix, count = _ALIASES.get(match[1], match[1]), int(match[2])
    if prefix not in GENERATIONS:
        raise ValueError(f"{flag}={name!r}: unknown TPU generation {match[1]!r}: expected "
                         f"one of {known}")
    g = GENERATIONS[prefix]
    chips, remainder = divmod(count, g.cores_per_chip)
    if remainder or chips not in g.chip_counts:
        sizes = ", ".join(str(n * g.cores_per_chip) for n in g.chip_counts)
        raise ValueError(f"{flag}={name!r}: expected {prefix}-N with N one of {sizes} "
                         "(the slice sizes Cloud TPU offers)")
    return Accelerator(f"{prefix}-{count}", g, chips)
