"""Training data: a seeded synthetic long-range retrieval task, and byte-level text.

Retrieval (:class:`RetrievalTask`): every sequence is random filler with ``num_pairs`` key-value
pairs planted ``distance`` tokens before its end; the tail asks for each key in turn::

    filler ... k1 v1 k2 v2 ... filler ... Q k2 v2 Q k1 v1
               ^ planted block starts distance tokens before the end

Only the answers (the value after each queried key) are trained and scored; filler is uniform
noise and carries no signal. Keys, values, filler and ``Q`` use disjoint token ranges, so a
model that cannot see the planted block is at chance, ``1 / num_values``. ``distance`` is drawn
uniformly from ``[min_distance, max_distance]`` per sequence, or fixed for accuracy-vs-distance
evaluation. Batches are a pure function of ``(seed, step)``, so a resumed run sees the same data.

Text (:class:`ByteText`): random crops of a file's bytes (vocab 256), next-byte prediction.
:class:`StdlibBytes`: the same over the Python standard library's own source files, a corpus
present on every machine (the file list and the train/validation split are defined by a rule, see
:func:`stdlib_source_files`).

A batch is ``(x, y)``: x (B, N) int64 inputs, y (B, N) int64 targets with -100 = ignored.

Packing (:func:`pack_documents`): documents of any lengths concatenated into rows of ``seq_len``
tokens with the ``cu_seqlens`` offsets that ``LongNetLM.forward(x, y, cu_seqlens=...)`` and
:func:`dilated_attention.dilated_attention_varlen` take, instead of padding every document.
"""

from __future__ import annotations

import itertools
import os
import sysconfig
import zlib
from dataclasses import dataclass

import torch

IGNORE = -100


def _mix(seed: int, step: int, stream: int) -> int:
    """A generator seed from (seed, step, stream); stable across processes (no str hashing)."""
    return (int(seed) * 1_000_003 + int(step) * 4 + int(stream)) & 0x7FFF_FFFF_FFFF_FFFF


@dataclass
class RetrievalTask:
    seq_len: int = 256
    num_pairs: int = 2
    num_keys: int = 16
    num_values: int = 16
    num_filler: int = 64
    min_distance: int = 32
    max_distance: int = 256

    def __post_init__(self):
        if self.num_pairs > self.num_keys:
            raise ValueError(
                f"num_pairs ({self.num_pairs}) > num_keys ({self.num_keys}): keys must be distinct"
            )
        need = 5 * self.num_pairs  # planted block (2P) + question tail (3P)
        if self.min_distance < need:
            raise ValueError(
                f"min_distance ({self.min_distance}) must be >= 5 * num_pairs = {need}"
            )
        if self.max_distance > self.seq_len:
            raise ValueError(
                f"max_distance ({self.max_distance}) must be <= seq_len ({self.seq_len})"
            )
        if self.min_distance > self.max_distance:
            raise ValueError(f"min_distance {self.min_distance} > max_distance {self.max_distance}")

    # token ranges: [filler | keys | values | Q]
    @property
    def key0(self) -> int:
        return self.num_filler

    @property
    def value0(self) -> int:
        return self.num_filler + self.num_keys

    @property
    def query_token(self) -> int:
        return self.num_filler + self.num_keys + self.num_values

    @property
    def vocab_size(self) -> int:
        return self.query_token + 1

    @property
    def chance(self) -> float:
        return 1.0 / self.num_values

    def batch(self, batch_size: int, seed: int, step: int, distance: int | torch.Tensor | None = None):
        """(x, y), each (batch_size, seq_len) int64 on CPU; ``distance`` fixes the distance: an
        int for every row, or an integer tensor of shape (batch_size,) with one per row."""
        g = torch.Generator().manual_seed(_mix(seed, step, 0))
        n, p = self.seq_len, self.num_pairs
        tok = torch.randint(0, self.num_filler, (batch_size, n + 1), generator=g)  # (B, N+1)
        keys = torch.stack(
            [torch.randperm(self.num_keys, generator=g)[:p] for _ in range(batch_size)]
        )  # (B, P)
        vals = torch.randint(0, self.num_values, (batch_size, p), generator=g)  # (B, P)
        if distance is None:
            dist = torch.randint(
                self.min_distance, self.max_distance + 1, (batch_size,), generator=g
            )
        elif isinstance(distance, torch.Tensor):
            integer = not (distance.dtype.is_floating_point or distance.dtype.is_complex
                           or distance.dtype == torch.bool)  # fmt: skip
            if distance.shape != (batch_size,) or not integer:
                raise ValueError(f"distance as a tensor must be integer of shape (batch_size,) = "
                                 f"({batch_size},), got {distance.dtype} {tuple(distance.shape)}")  # fmt: skip
            dist = distance.to("cpu", torch.long)
            bad = (dist < 5 * p) | (dist > n)
            if bool(bad.any()):
                raise ValueError(f"distance {int(dist[bad][0])} must be in [{5 * p}, {n}]")
        else:
            if not 5 * p <= distance <= n:
                raise ValueError(f"distance {distance} must be in [{5 * p}, {n}]")
            dist = torch.full((batch_size,), int(distance))
        order = torch.stack([torch.randperm(p, generator=g) for _ in range(batch_size)])  # (B, P)
        y = torch.full((batch_size, n), IGNORE, dtype=torch.long)
        for b in range(batch_size):
            s = n + 1 - int(dist[b])  # start of the planted block (token index)
            for j in range(p):
                tok[b, s + 2 * j] = self.key0 + keys[b, j]
                tok[b, s + 2 * j + 1] = self.value0 + vals[b, j]
            t0 = n + 1 - 3 * p  # question tail
            for qi, j in enumerate(order[b].tolist()):
                a = t0 + 3 * qi
                tok[b, a] = self.query_token
                tok[b, a + 1] = self.key0 + keys[b, j]
                tok[b, a + 2] = self.value0 + vals[b, j]
                y[b, a + 1] = self.value0 + vals[b, j]  # predicted at the key's position
        return tok[:, :-1].contiguous(), y

    @staticmethod
    def accuracy(logits: torch.Tensor, y: torch.Tensor) -> tuple[int, int]:
        """(correct, total) over the scored positions; logits (B, N, V), y (B, N)."""
        mask = y != IGNORE
        pred = logits.argmax(-1)
        return int((pred[mask] == y[mask]).sum()), int(mask.sum())


class ByteText:
    """Byte-level LM on a file: random crops of ``seq_len + 1`` bytes, seeded per step."""

    vocab_size = 256

    def __init__(self, path: str, seq_len: int, val_fraction: float = 0.05):
        with open(path, "rb") as f:
            data = torch.frombuffer(bytearray(f.read()), dtype=torch.uint8).long()
        if len(data) < 2 * (seq_len + 1):
            raise ValueError(
                f"{path} has {len(data)} bytes; need at least {2 * (seq_len + 1)} for seq_len {seq_len}"
            )
        cut = max(seq_len + 1, int(len(data) * (1 - val_fraction)))
        if len(data) - cut < seq_len + 1:
            cut = len(data) - (seq_len + 1)
        self.train_data, self.val_data = data[:cut], data[cut:]
        self.seq_len = seq_len

    def batch(self, batch_size: int, seed: int, step: int, split: str = "train"):
        data = self.train_data if split == "train" else self.val_data
        g = torch.Generator().manual_seed(_mix(seed, step, 0 if split == "train" else 1))
        hi = max(1, len(data) - self.seq_len - 1)
        starts = torch.randint(0, hi, (batch_size,), generator=g)
        chunks = torch.stack([data[s : s + self.seq_len + 1] for s in starts.tolist()])  # (B, N+1)
        return chunks[:, :-1].contiguous(), chunks[:, 1:].contiguous()


# Directories of the standard library left out of the corpus: test suites (large, repetitive
# data files in .py form) and installed third-party packages.
STDLIB_SKIP_DIRS = frozenset(
    {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
)


def stdlib_source_files(root: str | None = None) -> tuple[str, list[str], list[str]]:
    """(root, train files, validation files) of the standard-library corpus.

    The rule: every ``*.py`` file under ``root`` (default ``sysconfig.get_paths()["stdlib"]``)
    whose directory path has no component in :data:`STDLIB_SKIP_DIRS`, as POSIX paths relative
    to ``root``, sorted. A file is in the validation split when ``zlib.crc32(relative path) %
    20 == 0`` (about 5% of the files), so a file's split depends only on its own name, not on
    which other files a Python version ships. The files themselves differ between Python
    versions: record ``platform.python_version()`` next to any result.
    """
    root = root or sysconfig.get_paths()["stdlib"]
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = os.path.relpath(dirpath, root)
        parts = [] if rel_dir == "." else rel_dir.split(os.sep)
        if STDLIB_SKIP_DIRS.intersection(parts):
            dirnames[:] = []
            continue
        files += ["/".join([*parts, f]) for f in filenames if f.endswith(".py")]
    files.sort()
    val = [f for f in files if zlib.crc32(f.encode()) % 20 == 0]
    train = [f for f in files if zlib.crc32(f.encode()) % 20 != 0]
    return root, train, val


def _read_concat(root: str, files: list[str], starts: list[int] | None = None) -> torch.Tensor:
    """The files' bytes in list order, each followed by one newline, as int64 (vocab 256).
    ``starts``, when given, receives each file's offset in the result."""
    buf = bytearray()
    for f in files:
        if starts is not None:
            starts.append(len(buf))
        with open(os.path.join(root, *f.split("/")), "rb") as fh:
            buf += fh.read()
        buf += b"\n"
    return torch.frombuffer(buf, dtype=torch.uint8).long() if buf else torch.zeros(0).long()


class StdlibBytes:
    """Byte-level LM data from the standard library's source (:func:`stdlib_source_files`).

    Train batches: random crops of ``seq_len + 1`` bytes of the concatenated train files, a pure
    function of ``(seed, step)``. Validation: ``val_batches()`` gives fixed crops at evenly
    spaced offsets of the concatenated validation files (the same for every model and seed).
    """

    vocab_size = 256

    def __init__(self, seq_len: int, root: str | None = None):
        self.root, self.train_files, self.val_files = stdlib_source_files(root)
        self.train_starts: list[int] = []  # offset of each train file in train_data
        self.train_data = _read_concat(self.root, self.train_files, self.train_starts)
        self.val_starts: list[int] = []  # offset of each validation file in val_data
        self.val_data = _read_concat(self.root, self.val_files, self.val_starts)
        for name, d in (("train", self.train_data), ("validation", self.val_data)):
            if len(d) < seq_len + 1:
                raise ValueError(
                    f"the stdlib {name} split has {len(d)} bytes, fewer than seq_len + 1 = "
                    f"{seq_len + 1}; use a shorter --seq-len"
                )
        self.seq_len = seq_len

    def batch(self, batch_size: int, seed: int, step: int):
        g = torch.Generator().manual_seed(_mix(seed, step, 0))
        hi = len(self.train_data) - self.seq_len - 1
        starts = torch.randint(0, hi + 1, (batch_size,), generator=g).tolist()
        chunks = torch.stack([self.train_data[s : s + self.seq_len + 1] for s in starts])
        return chunks[:, :-1].contiguous(), chunks[:, 1:].contiguous()  # (B, N), (B, N)

    def packed_batch(self, batch_size: int, seed: int, step: int):
        """A train batch of packed documents: ``(x, y, cu_seqlens, max_seqlen)`` as
        :func:`pack_documents` returns them, the documents being the source files.

        The same random crop as :meth:`batch` per row (a pure function of ``(seed, step)``), but
        each file in a crop is its own document (``LongNetLM.forward(x, y, cu_seqlens=...)``):
        no byte attends to or predicts a byte of another file.
        """
        g = torch.Generator().manual_seed(_mix(seed, step, 0))
        n = self.seq_len
        hi = len(self.train_data) - n - 1
        starts = torch.randint(0, hi + 1, (batch_size,), generator=g).tolist()
        file_starts = torch.tensor(self.train_starts, dtype=torch.long)
        xs, ys, doc_starts = [], [], []
        for row, s0 in enumerate(starts):
            c = self.train_data[s0 : s0 + n + 1]
            x, y = c[:-1].clone(), c[1:].clone()
            inside = file_starts[(file_starts > s0) & (file_starts < s0 + n + 1)] - s0  # file starts in the crop
            y[inside[inside <= n] - 1] = IGNORE  # the byte before a file start predicts nothing
            inside = inside[inside < n]
            doc_starts += [row * n + int(t) for t in inside]
            xs.append(x)
            ys.append(y)
        bounds = sorted(set(doc_starts) | set(range(0, (batch_size + 1) * n, n)))
        cu = torch.tensor(bounds, dtype=torch.int32)
        return torch.stack(xs), torch.stack(ys), cu, int((cu[1:] - cu[:-1]).max())

    def val_batches(self, num_seqs: int):
        """``num_seqs`` (x, y) pairs of shape (1, N), evenly spaced over the validation bytes
        (overlapping when the split is shorter than ``num_seqs * (N + 1)``)."""
        hi = len(self.val_data) - self.seq_len - 1
        starts = [round(i * hi / max(1, num_seqs - 1)) for i in range(num_seqs)]
        for s in starts:
            c = self.val_data[s : s + self.seq_len + 1][None]
            yield c[:, :-1].contiguous(), c[:, 1:].contiguous()


    def val_documents(self, max_len: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each validation file as one document, cut to its first ``max_len`` bytes: ``(x, y)``
        int64 pairs of equal length, ``y`` the next byte of the same file (``IGNORE`` after the
        file's last byte). Position ``p`` of a document is position ``p`` of its file."""
        if isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 1:
            raise ValueError(f"max_len must be a positive int, got {max_len!r}")
        ends = [*self.val_starts[1:], len(self.val_data)]
        docs = []
        for a, b in zip(self.val_starts, ends, strict=True):
            f = self.val_data[a : b - 1]  # the file's bytes (the separating newline left out)
            if f.numel() == 0:
                continue
            x = f[:max_len]
            y = torch.cat([f[1 : max_len + 1], f.new_full((max(0, max_len + 1 - f.numel()),), IGNORE)])
            docs.append((x, y[: x.numel()]))
        return docs

    def val_packed(self, seq_len: int) -> list[tuple[torch.Tensor, ...]]:
        """The validation files as packed rows of ``seq_len`` bytes, no file split across rows:
        :meth:`val_documents` (each file cut to ``seq_len`` bytes), longest first, each into the
        first row with room (first-fit decreasing); the rest of a row is one padding document
        with ignored targets. A list of ``(x (1, N), y (1, N), cu_seqlens (docs + 1,) int32,
        max_seqlen, pos (N,))`` for ``LongNetLM.forward(x, y, cu_seqlens=..., max_seqlen=...)``;
        ``pos`` is each byte's position in its file (-1 on padding). The same rows for every
        model: a pure function of the corpus and ``seq_len``."""
        docs = sorted(self.val_documents(seq_len), key=lambda d: -d[0].numel())
        rows: list[list[tuple[torch.Tensor, torch.Tensor]]] = []
        room: list[int] = []
        for d in docs:
            n = d[0].numel()
            i = next((j for j, r in enumerate(room) if r >= n), None)
            if i is None:
                rows.append([])
                room.append(seq_len)
                i = len(rows) - 1
            rows[i].append(d)
            room[i] -= n
        out = []
        for row, left in zip(rows, room, strict=True):
            xs = [d[0] for d in row]
            ys = [d[1] for d in row]
            ps = [torch.arange(d[0].numel()) for d in row]
            lens = [d[0].numel() for d in row]
            if left:
                xs.append(torch.zeros(left, dtype=torch.long))
                ys.append(torch.full((left,), IGNORE, dtype=torch.long))
                ps.append(torch.full((left,), -1, dtype=torch.long))
                lens.append(left)
            cu = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32)
            out.append((torch.cat(xs)[None], torch.cat(ys)[None], cu, max(lens), torch.cat(ps)))
        return out


def pack_documents(documents, seq_len: int, *, pad_id: int = 0):
    """Pack token documents into rows of ``seq_len`` tokens: ``(x, y, cu_seqlens, max_seqlen)``.

    The documents (1-D int tensors or lists of ints) are concatenated in order and cut into rows
    of ``seq_len``; a document that crosses a row end continues at the start of the next row as a
    new document (its positions restart there). The last row is filled with ``pad_id`` tokens,
    which form one document of their own with ignored targets.

    Returns:
        x: (rows, seq_len) int64 inputs.
        y: (rows, seq_len) int64 targets: the next token of the same document, -100 at each
            document's last token and on padding (nothing is predicted across documents).
        cu_seqlens: (docs + 1,) int32 offsets into the flattened ``rows * seq_len`` tokens
            (document starts, row starts included), for ``LongNetLM.forward(x, y,
            cu_seqlens=cu_seqlens)``.
        max_seqlen: the longest packed document (an int, <= seq_len).
    """
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"seq_len must be a positive int, got {seq_len!r}")
    toks, tgts, starts = [], [], []
    total = 0
    for i, d in enumerate(documents):
        d = torch.as_tensor(d)
        if d.dim() != 1 or d.dtype.is_floating_point or d.dtype == torch.bool:
            raise ValueError(f"document {i} must be a 1-D integer sequence of tokens, got {d.dtype} shape {tuple(d.shape)}")
        if d.numel() == 0:
            continue
        d = d.long()
        starts.append(total)
        toks.append(d)
        tgts.append(torch.cat([d[1:], d.new_full((1,), IGNORE)]))
        total += d.numel()
    rows = max(1, -(-total // seq_len))
    pad = rows * seq_len - total
    if pad:
        starts.append(total)
        toks.append(torch.full((pad,), pad_id, dtype=torch.long))
        tgts.append(torch.full((pad,), IGNORE, dtype=torch.long))
    x = torch.cat(toks).view(rows, seq_len)
    y = torch.cat(tgts).view(rows, seq_len)
    bounds = sorted(set(starts) | set(range(0, rows * seq_len, seq_len)) | {rows * seq_len})
    cu = torch.tensor(bounds, dtype=torch.int32)
    max_seqlen = int((cu[1:] - cu[:-1]).max())
    return x, y, cu, max_seqlen
