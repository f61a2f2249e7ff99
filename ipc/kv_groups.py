"""How the KV cache's pages map to layers when some layers slide (hybrid KV groups).

Without sliding windows a KV block is one page holding `block_size` token slots of every
layer, and a sequence has one block table. With them, a sliding layer never reads a key
more than `window` positions back, so the blocks behind every sliding layer's window can
go back to the pool while the global layers keep theirs. That needs the sliding layers'
KV in pages of its own:

- The layers are cut into *groups* of `page_layers` layers of the same window: `g`, the
  greatest common divisor of the layer counts of each window (global counts as window
  0), so every group is full. A page holds `block_size` slots of `g` layers, and every
  page is the same size, so one pool serves all groups (the scheduler's block manager
  hands out pages; `BlockManager(windows=...)`).
- A sequence's logical block `j` is one page in each group: its block table is flat,
  `table[j * num_groups + k]` is group `k`'s page (`-1` where the block manager has
  released it, behind a sliding group's window; the worker never reads those).
- Layer `l` reads and writes group `layer_group[l]`'s pages, at slot `layer_slot[l]` of
  each page: the worker keeps `page_layers` caches of `[pages, block_size, heads, dim]`,
  shared by the groups (`worker/kv_cache.py`).
- Group 0 has the longest window (global layers first): its pages hold the prefix
  cache's hash chain (`scheduler/prefix_cache.py`), and it releases last.

Gemma 3 270M (15 sliding layers of window 512, 3 global): g = 3, 6 groups of 3 layers.
One group (`page_layers` = all layers) is the layout without windows, unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import gcd

MAX_KV_GROUPS = 4096  # a worker reporting more is refused (a group has a layer at least)


@dataclass(frozen=True)
class KVGroups:
    windows: tuple[int, ...]  # per group: its layers' window, 0 for global; longest first
    layer_group: tuple[int, ...]  # per layer: its group
    layer_slot: tuple[int, ...]  # per layer: its slot within its group's pages

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def page_layers(self) -> int:
        """Layers a page holds (every group has this many)."""
        return len(self.layer_group) // len(self.windows)


def single_group(num_layers: int, window: int = 0) -> KVGroups:
    return KVGroups((window,), (0,) * num_layers, tuple(range(num_layers)))


def plan_groups(layer_windows: list[int] | tuple[int, ...], max_model_len: int) -> KVGroups:
    """Groups for layers with these windows (0: global). A window at least `max_model_len`
    never slides past a key, so its layers count as global; with one window left the
    layout is a single group (`single_group`)."""
    n = len(layer_windows)
    if n == 0:
        raise ValueError("a model without layers")
    eff = [w if 0 < w < max_model_len else 0 for w in layer_windows]
    kinds = sorted(set(eff), key=lambda w: (w != 0, -w))  # global, then longest window
    if len(kinds) == 1:
        return single_group(n, kinds[0])
    members = {w: [i for i, x in enumerate(eff) if x == w] for w in kinds}
    g = 0
    for layers in members.values():
        g = gcd(g, len(layers))
    windows: list[int] = []
    group = [0] * n
    slot = [0] * n
    for w in kinds:
        layers = members[w]
        for a in range(0, len(layers), g):
            for s, layer in enumerate(layers[a : a + g]):
                group[layer] = len(windows)
                slot[layer] = s
            windows.append(w)
    return KVGroups(tuple(windows), tuple(group), tuple(slot))


def check_windows(windows: list[int], max_groups: int) -> str | None:
    """Why a worker's reported group windows are not usable (None: they are)."""
    if not windows:
        return None  # one global group
    if len(windows) > max_groups or min(windows) < 0:
        return f"bad KV group windows {windows[:8]}"
    return None
