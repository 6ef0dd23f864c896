"""Which prompt prefixes each pod was sent: the block-hash index behind `prefix-cache` routing.

An engine with prefix caching (vLLM's automatic prefix caching) keeps the KV of prompts it served
and skips the prefill of a new prompt's longest cached prefix. The gateway cannot see those
caches, so it remembers what it sent where (AIBrix's local `PrefixHashTable` does the same,
`pkg/utils/prefixcacheindexer/hash.go`: `AddPrefix` after routing, `MatchPrefix` before).

A prompt (its text parts joined by a separator) is cut into blocks of `block_chars` characters;
a trailing partial block is left out, as AIBrix's `getPrefixHashes` and the engines' own block
caches leave it. Each block's hash is chained with the previous one's, the chain starting from
the model's name, so one hash names the model and the whole prefix up to the end of its block:
a block seen after another start never matches. Python's `hash` of a (previous, block) tuple is
the hash: 64 bits, salted per process like AIBrix's seeded xxhash, so the index stays private to
this gateway. An index shared with other gateway replicas (`share`) hashes with BLAKE2b instead
(64 bits of it, each block's digest keyed by the previous one), the same in every process: a
prefix one replica routed then matches at every replica, about 0.4 us a block dearer.

Shared, the index keeps what it records in an outbox (`take_recorded`: pod key and block hashes
per routed prompt, bounded) for the shared-state sync to publish, and adds what the other
replicas routed (`add`) as if it had routed it, most recent.

The index maps each hash to the pods the prefix was sent to. Its memory is bounded by
`max_blocks` hashes over all models (AIBrix's `AIBRIX_PREFIX_CACHE_BLOCK_NUMBER`, one entry per
distinct hash, like its LRU store), least recently recorded first out; about 190 bytes a hash
with a pod or two (CPython 3.11), so the default 200,000 hold at most ~40 MB. A prompt's blocks
are recorded from its last to its first, so its start is the most recent: eviction takes the
ends of old prompts before the shared beginnings (which keep the chains after them reachable).

Costs on the request path (Python, so they matter):
- hashing: O(prompt length), one C-level join and a slice + tuple hash per block (about 0.15 us
  a block: ~24 us for a 20,000-character prompt in 128-character blocks), once per request
  (`hashes` keeps the last request's list, so scoring, picking and recording share it);
- matching: walks the chain from the first block until no pod that matched every block so far
  holds the next one; each step costs a dict lookup plus a step per pod holding that block, so
  O(matched blocks x pods holding them), independent of the pool's size (~14 us for a
  15-block match on 8 pods, hashing included);
- recording: one ordered-dict update per block of the routed prompt;
- `forget`: one pass over the whole index plus a delete per block the pods held: ~35 ms for a
  pod holding 25,000 of a full 200,000 (a pod leaving is rare; a list of blocks per pod to
  avoid the pass would cost memory on every block).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from hashlib import blake2b

__all__ = ["PART_SEPARATOR", "PrefixIndex", "block_hashes", "stable_block_hashes"]

# Prompts recorded but not yet published, at most (the oldest go first while the sync fails).
MAX_OUTBOX = 10_000

# Between a prompt's parts (chat messages, text parts), standing for the chat template's markers
# the engine sees there: ["ab", "c"] and ["a", "bc"] are different prompts.
PART_SEPARATOR = "\x1e"


def _prompt(parts: Sequence[str]) -> str:
    return parts[0] if len(parts) == 1 else PART_SEPARATOR.join(parts)


def block_hashes(model: str, parts: Sequence[str], block_chars: int) -> list[int]:
    """The chained hash of each full block of the prompt `parts` make for `model`."""
    text = _prompt(parts)
    end = len(text) - len(text) % block_chars
    chained = hash(model)
    return [
        chained := hash((chained, text[start : start + block_chars]))
        for start in range(0, end, block_chars)
    ]


def stable_block_hashes(model: str, parts: Sequence[str], block_chars: int) -> list[int]:
    """`block_hashes` with BLAKE2b: the same chain in every process (blocks of the UTF-8 text)."""
    data = _prompt(parts).encode()
    end = len(data) - len(data) % block_chars
    digest = blake2b(model.encode(), digest_size=8).digest()
    found = []
    for start in range(0, end, block_chars):
        digest = blake2b(data[start : start + block_chars], digest_size=8, key=digest).digest()
        found.append(int.from_bytes(digest))
    return found


class PrefixIndex:
    """Per model, the prompt prefixes (as block-hash chains) each pod was sent, LRU-bounded.

    Pods are named by key (`Pod.key`). Not thread-safe: the router uses it from one thread.
    """

    __slots__ = (
        "_blocks",
        "_depth",
        "_hash",
        "_hashes",
        "_model",
        "_outbox",
        "_parts",
        "block_chars",
        "max_blocks",
    )

    def __init__(self, block_chars: int = 128, max_blocks: int = 200_000) -> None:
        if block_chars < 1 or max_blocks < 1:
            raise ValueError("block_chars and max_blocks must be at least 1")
        self.block_chars = block_chars
        self.max_blocks = max_blocks
        # chained hash -> keys of the pods the prefix ending with that block was sent to;
        # least recently recorded first
        self._blocks: OrderedDict[int, tuple[str, ...]] = OrderedDict()
        # The last request's hashes (and its match until the index changes): a request is
        # hashed once though scored, picked and recorded. Keyed by the parts' identity: a
        # RequestInfo's tuple is not rebuilt between those calls.
        self._parts: Sequence[str] | None = None
        self._model = ""
        self._hashes: list[int] = []
        self._depth: dict[str, int] | None = None
        self._hash = block_hashes
        # Shared (`share`): what was recorded since the last `take_recorded`.
        self._outbox: list[tuple[str, list[int]]] | None = None

    def share(self) -> None:
        """Take part in an index shared by gateway replicas: stable hashes from now on (the
        index starts empty) and an outbox of what is recorded."""
        self._hash = stable_block_hashes
        self._blocks.clear()
        self._parts, self._hashes, self._depth = None, [], None
        self._outbox = []

    def take_recorded(self) -> list[tuple[str, list[int]]]:
        """(pod key, block hashes) of each prompt recorded since the last call, oldest first."""
        taken = self._outbox
        if not taken:
            return []
        self._outbox = []
        return taken

    def return_recorded(self, taken: list[tuple[str, list[int]]]) -> None:
        """What `take_recorded` gave and could not be published: sent with the next (bounded)."""
        if self._outbox is not None and taken:
            self._outbox[:0] = taken
            if len(self._outbox) > MAX_OUTBOX:
                del self._outbox[: len(self._outbox) - MAX_OUTBOX]

    def add(self, pod_key: str, hashes: list[int]) -> None:
        """Another replica sent a prompt with these block hashes to `pod_key`."""
        self._parts, self._hashes, self._depth = None, [], None  # the index changes
        self._insert(pod_key, hashes)

    def __len__(self) -> int:
        """Block hashes held (at most `max_blocks`)."""
        return len(self._blocks)

    def hashes(self, model: str, parts: Sequence[str]) -> list[int]:
        """The prompt's chained block hashes (`block_hashes`); the last request's are kept."""
        if parts is self._parts and model == self._model:
            return self._hashes
        found = self._hash(model, parts, self.block_chars)
        self._parts, self._model, self._hashes, self._depth = parts, model, found, None
        return found

    def match(self, model: str, parts: Sequence[str]) -> dict[str, int]:
        """Pod key -> how many of the prompt's first blocks it was sent (its longest cached
        prefix, in blocks); pods with none are left out. The dict is shared: do not change it."""
        hashes = self.hashes(model, parts)
        depth = self._depth
        if depth is None:
            depth = self._depth = self._walk(hashes)
        return depth

    def _walk(self, hashes: list[int]) -> dict[str, int]:
        blocks = self._blocks
        holders = blocks.get(hashes[0]) if hashes else None
        if holders is None:
            return {}
        depth = dict.fromkeys(holders, 1)
        for i in range(1, len(hashes)):
            holders = blocks.get(hashes[i])
            if holders is None:
                break
            # a pod matches one block further only if it matched every block before
            deeper = [pod for pod in holders if depth.get(pod) == i]
            if not deeper:
                break
            for pod in deeper:
                depth[pod] = i + 1
        return depth

    def record(self, model: str, pod_key: str, parts: Sequence[str]) -> None:
        """The prompt was sent to `pod_key`: its blocks now count as cached there, most recent."""
        hashes = self.hashes(model, parts)
        self._parts, self._hashes, self._depth = None, [], None  # the index changes
        self._insert(pod_key, hashes)
        outbox = self._outbox
        if outbox is not None and hashes:
            if len(outbox) >= MAX_OUTBOX:
                del outbox[: MAX_OUTBOX // 10]
            outbox.append((pod_key, hashes))

    def _insert(self, pod_key: str, hashes: list[int]) -> None:
        blocks = self._blocks
        cap = self.max_blocks
        # last block first, so the prompt's start is the most recent and the last evicted; a
        # prompt longer than the whole budget keeps its first `max_blocks` blocks
        for h in reversed(hashes[:cap] if len(hashes) > cap else hashes):
            holders = blocks.get(h)
            if holders is None:
                blocks[h] = (pod_key,)
                if len(blocks) > cap:
                    blocks.popitem(last=False)
            else:
                if pod_key not in holders:
                    blocks[h] = (*holders, pod_key)
                blocks.move_to_end(h)

    def forget(self, *pod_keys: str) -> int:
        """The pods left (or restarted with an empty cache): drop them from every block, and
        blocks no pod holds any more. One pass over the index for any number of pods; returns
        how many blocks held one of them."""
        self._parts, self._hashes, self._depth = None, [], None
        gone = set(pod_keys)
        blocks = self._blocks
        held = [h for h, holders in blocks.items() if not gone.isdisjoint(holders)]
        for h in held:
            rest = tuple(pod for pod in blocks[h] if pod not in gone)
            if rest:
                blocks[h] = rest  # keeps its place in the LRU order
            else:
                del blocks[h]
        return len(held)
