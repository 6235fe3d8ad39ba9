"""``triton-offload tier ROOT``: what an fs tier folder holds, every chunk's seal checked
offline, the refused files listed and, with ``--remove-refused``, removed.

ROOT is the ``root_dir`` of a ``{"type": "fs", ...}`` secondary tier. vLLM's fs tier
(``vllm/v1/kv_offload/file_mapper.py``, ``tiering/fs/``) lays it out as::

    ROOT/<model>_<digest>/config.json          the storage name's fields (model, dtype, ...)
    ROOT/<model>_<digest>_r<rank>/<hhh>/<hh>_g<group>/<hash>.bin     one chunk of one group

``<digest>`` is the first 12 hex digits of the SHA-256 of ``config.json``'s fields
(compact JSON, sorted keys), ``<hash>`` the chunk's block hash in hex (``hhh`` and ``hh``
its first five digits), and the chunk's offload key is the hash's bytes followed by the
group index as 4 big-endian bytes. Under ``TritonTieringOffloadingSpec`` the dtype field
carries this backend's layout tag (``float32+triton_offload-rows-v1:page576:bpc1:...``),
which names the row layout, the sealed page bytes, the checkpoint and the plane
arrangement; without the tag the rows are stock vLLM's (canonical or not) and carry no
seal.

What is checked offline, for a model folder whose rows carry seals: every page's seal
(format, header check), its place in the row (page index and count), the chunk's key
(the key digest against the file's name), the payload checksum, and that the file holds
all its pages. What only a serving engine can check: the configuration digest (it needs
the engine's configuration; the report counts the distinct digests a folder's chunks
carry) and the row layout digest (a worker fact). Every verdict an offline check makes
is one the engine makes too, so a file refused here is refused at every load.

Beside a live engine: vLLM writes each chunk to a temporary name and renames it into
place, so a ``.bin`` file is always whole; temporary files are counted as writes in
flight and never judged. A file or folder that vanishes between listing and reading
(vLLM removes a short file on its own read; another repair) is counted and skipped.
Every entry is reached through directory descriptors without following a link
(:class:`triton_offload.vllm.tier_repair.TierFolder`), and a refused file is removed the
way the engine's repair removes one: read and judged again through one descriptor,
renamed aside, and unlinked only if the renamed file is the one judged (a good chunk
published meanwhile stays).

Exit status: 0 when no refused file remains, 1 when some do, 2 when ROOT is not an fs
tier (one line naming why).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import errno
import hashlib
import json
import os
import re
import stat
import sys
from collections.abc import Callable
from typing import Any

from triton_offload.cli.args import UsageError, format_bytes

__all__ = [
    "ModelReport",
    "RankReport",
    "RefusedFile",
    "TierReport",
    "chunk_key",
    "configure_parser",
    "offline_problem",
    "run",
    "scan_tier",
]

#: ``<model>_<digest>``: a model folder (vLLM's ``FileMapper._compute_base_path``).
MODEL_FOLDER = re.compile(r"^(?P<model>.+)_(?P<digest>[0-9a-f]{12})$")
#: ``<model>_<digest>_r<rank>``: one rank's chunks (``FileMapper.get_file_name``).
RANK_FOLDER = re.compile(r"^(?P<base>.+_[0-9a-f]{12})_r(?P<rank>[0-9]+)$")
PREFIX_FOLDER = re.compile(r"^[0-9a-f]{3}$")
GROUP_FOLDER = re.compile(r"^(?P<next>[0-9a-f]{2})_g(?P<group>[0-9]+)$")
CHUNK_FILE = re.compile(r"^(?P<hash>(?:[0-9a-f]{2}){3,})\.bin$")
#: vLLM's writer: ``<chunk file>_<random>.tmp`` until it renames it into place; its
#: O_DIRECT probe: ``.o_direct_probe_<random>.tmp`` in the model folder.
TEMPORARY_FILE = re.compile(r"(\.bin_[0-9]+|^\.o_direct_probe_[0-9]+)\.tmp$")
#: The name of vLLM's file of a model folder's storage fields.
CONFIG_FILE = "config.json"
#: Bytes of a config.json read at most (vLLM's are a few hundred).
MAX_CONFIG_BYTES = 1 << 20
#: This backend's layout tag, after the ``+`` of the dtype field.
TAG_PREFIX = "triton_offload-rows-v"


@dataclasses.dataclass
class RefusedFile:
    """A chunk file whose bytes fail the check: its path below ROOT, why, and what
    ``--remove-refused`` did (empty when not asked)."""

    path: str
    problem: str
    outcome: str = ""


@dataclasses.dataclass
class RankReport:
    chunks: int = 0
    bytes: int = 0
    oldest_ns: int | None = None
    newest_ns: int | None = None
    good: int = 0
    #: Keyed chunks not checked: no ``--seal-key-file`` given (never refused or removed).
    keyed: int = 0
    refused: list[RefusedFile] = dataclasses.field(default_factory=list)

    def add(self, status: os.stat_result) -> None:
        self.chunks += 1
        self.bytes += status.st_size
        mtime = status.st_mtime_ns
        self.oldest_ns = mtime if self.oldest_ns is None else min(self.oldest_ns, mtime)
        self.newest_ns = mtime if self.newest_ns is None else max(self.newest_ns, mtime)


@dataclasses.dataclass
class ModelReport:
    """One model folder of the tier (and its ranks' chunk folders)."""

    folder: str
    model: str | None = None
    config_problem: str | None = None
    dtype: str | None = None
    layout: str = "unknown (no config.json)"
    checkpoint: str = "unknown"
    groups: list[int] = dataclasses.field(default_factory=list)
    page_bytes: int | None = None
    #: Whether its chunks carry seals: True, False, or None before any chunk was seen.
    sealed: bool | None = None
    #: The configuration digests its chunks' seals carry (hex; one for a folder of one
    #: configuration, which only a serving engine can check).
    config_digests: list[str] = dataclasses.field(default_factory=list)
    ranks: dict[int, RankReport] = dataclasses.field(default_factory=dict)

    @property
    def chunks(self) -> int:
        return sum(rank.chunks for rank in self.ranks.values())

    @property
    def bytes(self) -> int:
        return sum(rank.bytes for rank in self.ranks.values())


@dataclasses.dataclass
class TierReport:
    root: str
    mode: int
    owner: int
    models: dict[str, ModelReport] = dataclasses.field(default_factory=dict)
    in_flight: int = 0  # vLLM's temporary files: stores being written
    set_aside: int = 0  # files a repair renamed aside and has not unlinked (yet)
    vanished: int = 0  # listed, gone before they were read
    links: int = 0  # symbolic links and other non-files: never followed
    other: list[str] = dataclasses.field(default_factory=list)  # names vLLM never writes

    @property
    def refused(self) -> list[RefusedFile]:
        return [f for m in self.models.values() for r in m.ranks.values() for f in r.refused]


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("root", metavar="ROOT", help="the fs tier's root_dir")
    parser.add_argument(
        "--remove-refused",
        action="store_true",
        help="remove every refused chunk file (judged again as it is removed; safe beside "
        "a live engine, whose next store of the chunk writes a good file)",
    )
    parser.add_argument(
        "--seal-key-file",
        metavar="PATH",
        help="the engines' seal_key_file: keyed chunks are checked under it (without it "
        "they are counted, never judged or removed)",
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")


# ----------------------------------------------------------------------- the judge


def chunk_key(hash_hex: str, group: int) -> bytes:
    """The offload key of a chunk file: its block hash, then the group as 4 big-endian
    bytes (vLLM's ``make_offload_key``)."""
    return bytes.fromhex(hash_hex) + int(group).to_bytes(4, "big")


def offline_problem(data: bytes, key: bytes, page_bytes: int, seal_key: Any = None) -> str | None:
    """Why the chunk file ``data`` of ``key`` is refused whatever the engine's
    configuration, or None: every page's seal, place, key and payload checksum, and that
    every page is there. The configuration digest is taken from page 0 (all pages must
    carry the same); the row layout digest is not checked (a worker fact). ``seal_key``
    (a ``SealKey``): keyed seals are checked under it, and only they pass."""
    import numpy as np

    from triton_offload.transfer.seal import SealFormat, key_digest, read_seal, seal_problem

    if len(data) < page_bytes:
        return f"{len(data)} bytes, shorter than one page of {page_bytes} bytes"
    row = np.frombuffer(data, dtype=np.uint8)
    first = read_seal(row[:page_bytes])
    if isinstance(first, str):
        return f"page 0: {first}"
    count = first.page_count
    if len(data) < count * page_bytes:
        return f"{len(data)} bytes, shorter than its {count} pages of {page_bytes} bytes"
    digest = key_digest(key, seal_key)
    for index in range(count):
        fmt = SealFormat(first.config_digest, bytes(8), index, count)
        page = row[index * page_bytes : (index + 1) * page_bytes]
        problem = seal_problem(page, fmt, digest, check_layout=False, seal_key=seal_key)
        if problem is not None:
            return f"page {index}: {problem}"
    return None


def _carries_a_seal(data: bytes, page_bytes: int) -> bool:
    """Whether page 0's last 64 bytes start with the seal's name (any format version)."""
    from triton_offload.transfer.seal import SEAL_BYTES, SEAL_NAME

    start = page_bytes - SEAL_BYTES
    return len(data) >= page_bytes and data[start : start + len(SEAL_NAME)] == SEAL_NAME


def _config_digest(data: bytes, page_bytes: int) -> str:
    """Page 0's configuration digest (hex), from a file that holds page 0."""
    from triton_offload.transfer.seal import SEAL_BYTES

    start = page_bytes - SEAL_BYTES + 8
    return data[start : start + 8].hex()


# ------------------------------------------------------------------ model folders


def _describe_layout(model: ModelReport, fields: dict[str, Any]) -> None:
    """Layout, checkpoint, dtype and page bytes from a model folder's storage fields."""
    dtype = str(fields.get("dtype", ""))
    base, _, tag = dtype.partition("+")
    model.dtype = base or None
    model.groups = [
        int(group.get("tokens_per_block", 0))
        for group in fields.get("kv_cache_groups") or []
        if isinstance(group, dict)
    ]
    if tag.startswith(TAG_PREFIX):
        parts = tag.split(":")
        named = {p.split("-", 1)[0]: p for p in parts[1:] if "-" in p}
        page = next((p for p in parts if re.fullmatch(r"page[0-9]+", p)), None)
        chunk = next((p for p in parts if re.fullmatch(r"bpc[0-9]+", p)), None)
        model.page_bytes = int(page[4:]) if page else None
        words = [f"triton_offload rows v{parts[0][len(TAG_PREFIX) :]}"]
        if page:
            words.append(f"pages of {model.page_bytes} B (seal included)")
        if chunk:
            words.append(f"{_count(int(chunk[3:]), 'block')} per chunk")
        parallel = next((p for p in parts if p.startswith("tp")), None)
        words.append(parallel or "replicated (one copy per chunk)")
        words += [named[k] for k in ("kv", "planes") if k in named]
        model.layout = ", ".join(words)
        checkpoint = named.get("ckpt", "unknown")
        model.checkpoint = (
            "none (no checkpoint identity: chunks known by the model name)"
            if checkpoint == "ckpt-none"
            else checkpoint
        )
    elif "canonical_format" in fields:
        model.layout = f"stock vLLM canonical rows ({fields['canonical_format']}), no seal"
        model.checkpoint = "not in the name (vLLM's storage names)"
    else:
        model.layout = "stock vLLM rows (this backend's unsealed stock rows too), no seal"
        model.checkpoint = "not in the name (vLLM's storage names)"


def _read_config(tier: Any, model: ModelReport, unreachable: type[Exception]) -> None:
    try:
        _, data = tier.read((model.folder, CONFIG_FILE), MAX_CONFIG_BYTES)
    except unreachable as error:
        model.config_problem = f"no readable {CONFIG_FILE} ({error})"
        return
    try:
        fields = json.loads(data)
        if not isinstance(fields, dict):
            raise ValueError("not a JSON object")
    except ValueError as error:
        model.config_problem = f"{CONFIG_FILE} is not vLLM's ({error})"
        return
    model.model = str(fields.get("model_name", "")) or None
    _describe_layout(model, fields)
    canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    digest = hashlib.sha256(canonical.encode()).hexdigest()[:12]
    expected = f"{(model.model or '').replace('/', '_')}_{digest}"
    if expected != model.folder:
        model.config_problem = (
            f"{CONFIG_FILE} names folder {expected}, not {model.folder} (edited, or not "
            "written by vLLM's fs tier)"
        )


# ------------------------------------------------------------------------ the scan


def _open_root(path: str) -> Any:
    """The tier folder, or UsageError naming why it cannot be one."""
    from triton_offload.vllm.tier_repair import TierFolder

    try:
        return TierFolder(path)
    except FileNotFoundError:
        raise UsageError(f"{path}: no such folder") from None
    except OSError as error:
        if error.errno in (errno.ELOOP, errno.ENOTDIR) and os.path.islink(path):
            raise UsageError(
                f"{path}: a symbolic link (to {os.readlink(path)!r}); give the folder "
                "itself: no link in a tier is followed"
            ) from None
        if error.errno == errno.ENOTDIR:
            raise UsageError(f"{path}: not a folder") from None
        raise UsageError(f"{path}: cannot open it ({error.strerror or error})") from None


def _not_a_tier(path: str, names: list[str]) -> UsageError:
    why = (
        f"{path}: not an fs tier: no <model>_<12 hex digits> folder (with vLLM's "
        f"{CONFIG_FILE}) or <model>_<12 hex digits>_r<rank> chunk folder in it"
    )
    parent = os.path.dirname(os.path.abspath(path))
    if not names:
        why += " (it is empty: vLLM's fs tier writes a model folder when an engine starts)"
    elif CONFIG_FILE in names:
        why += f"; it holds a {CONFIG_FILE}: one model's folder? give the tier's root, {parent}"
    elif any(PREFIX_FOLDER.match(name) for name in names):
        why += f"; it looks like one rank's chunk folder: give the tier's root, {parent}"
    return UsageError(why)


def _classify_root(tier: Any, report: TierReport) -> list[tuple[str, int]]:
    """Model folders into ``report.models``; the rank folders to scan, as (name, rank)."""
    entries = tier.entries(())
    ranks: list[tuple[str, int]] = []
    for entry in sorted(entries, key=lambda e: e.name):
        name = entry.name
        if entry.is_symlink() or not entry.is_dir(follow_symlinks=False):
            if entry.is_symlink():
                report.links += 1
            else:
                report.other.append(name)
            continue
        rank = RANK_FOLDER.match(name)
        if rank:
            ranks.append((name, int(rank["rank"])))
            report.models.setdefault(rank["base"], ModelReport(rank["base"]))
        elif MODEL_FOLDER.match(name):
            report.models.setdefault(name, ModelReport(name))
        else:
            report.other.append(name)
    if not report.models:
        raise _not_a_tier(report.root, [entry.name for entry in entries])
    return ranks


def _scan_rank(
    tier: Any, report: TierReport, model: ModelReport, folder: str, rank: int, seal_key: Any
) -> list[tuple[tuple[str, ...], bytes, str]]:
    """Count and judge one rank's chunk files; the refused ones as (parts, key, problem)."""
    from triton_offload.transfer.seal import KEYED_WITHOUT_KEY
    from triton_offload.vllm.tier_repair import REFUSED_INFIX, RemovalOutcome, Unreachable

    books = model.ranks.setdefault(rank, RankReport())
    refused: list[tuple[tuple[str, ...], bytes, str]] = []
    digests = set(model.config_digests)
    page = model.page_bytes

    def listing(parts: tuple[str, ...]) -> list[os.DirEntry[str]]:
        try:
            return tier.entries(parts)  # type: ignore[no-any-return]
        except Unreachable as unreachable:
            if unreachable.outcome is RemovalOutcome.ABSENT:
                report.vanished += 1
            else:
                report.links += 1
            return []

    for prefix in listing((folder,)):
        if not PREFIX_FOLDER.match(prefix.name):
            report.other.append(f"{folder}/{prefix.name}")
            continue
        for group_folder in listing((folder, prefix.name)):
            group = GROUP_FOLDER.match(group_folder.name)
            if not group:
                report.other.append(f"{folder}/{prefix.name}/{group_folder.name}")
                continue
            parts = (folder, prefix.name, group_folder.name)
            for entry in listing(parts):
                name = entry.name
                chunk = CHUNK_FILE.match(name)
                placed = chunk and chunk["hash"][:5] == prefix.name + group["next"]
                if TEMPORARY_FILE.search(name):
                    report.in_flight += 1
                    continue
                if REFUSED_INFIX in name:
                    report.set_aside += 1
                    continue
                if not chunk or not placed:
                    report.other.append("/".join((*parts, name)))
                    continue
                try:
                    status, data = tier.read((*parts, name))
                except Unreachable as unreachable:
                    if unreachable.outcome is RemovalOutcome.ABSENT:
                        report.vanished += 1
                    else:
                        report.links += 1
                    continue
                books.add(status)
                if page is None:
                    continue  # stock rows: no seal to check
                key = chunk_key(chunk["hash"], int(group["group"]))
                if _carries_a_seal(data, page):
                    model.sealed = True
                    digests.add(_config_digest(data, page))
                problem = offline_problem(data, key, page, seal_key)
                if problem is None:
                    books.good += 1
                elif seal_key is None and KEYED_WITHOUT_KEY in problem:
                    books.keyed += 1  # sealed under a key this run was not given
                else:
                    refused.append(((*parts, name), key, problem))
    model.config_digests = sorted(digests)
    return refused


def scan_tier(path: str, *, remove_refused: bool = False, seal_key: Any = None) -> TierReport:
    """The report on the fs tier at ``path`` (UsageError when it is none), with the
    refused files removed when ``remove_refused``; keyed chunks checked under
    ``seal_key`` (a ``SealKey``), or counted unchecked without one."""
    from triton_offload.vllm.tier_repair import Unreachable

    tier = _open_root(path)
    with tier:
        status = os.fstat(tier.descriptor)
        report = TierReport(path, stat.S_IMODE(status.st_mode), status.st_uid)
        found: dict[str, list[tuple[tuple[str, ...], bytes, str]]] = {}
        for folder, rank in _classify_root(tier, report):
            model = report.models[RANK_FOLDER.match(folder)["base"]]  # type: ignore[index]
            if model.dtype is None and model.config_problem is None:
                _read_config(tier, model, Unreachable)
            found.setdefault(model.folder, []).extend(
                _scan_rank(tier, report, model, folder, rank, seal_key)
            )
        for model in report.models.values():
            if model.dtype is None and model.config_problem is None:
                _read_config(tier, model, Unreachable)
            _settle_verdicts(tier, model, found.get(model.folder, []), remove_refused, seal_key)
    return report


def _settle_verdicts(
    tier: Any,
    model: ModelReport,
    refused: list[tuple[tuple[str, ...], bytes, str]],
    remove_refused: bool,
    seal_key: Any,
) -> None:
    """Refusals stand in a folder whose chunks carry seals; in one where none does (rows
    written with ``verify_chunks`` false) no chunk is judged."""
    page = model.page_bytes
    if page is None or not refused:
        return
    if model.sealed is None:
        model.sealed = False
        return
    for parts, key, problem in refused:
        entry = RefusedFile("/".join(parts), problem)
        if remove_refused:
            judge = _judge(key, page, seal_key)
            entry.outcome = tier.remove_if_refused(parts, None, judge).value
        rank = RANK_FOLDER.match(parts[0])
        assert rank is not None  # only rank folders are scanned
        model.ranks[int(rank["rank"])].refused.append(entry)


def _judge(key: bytes, page: int, seal_key: Any) -> Callable[[bytes], str | None]:
    return lambda data: offline_problem(data, key, page, seal_key)


# ------------------------------------------------------------------------- output


def _when(ns: int | None) -> str:
    if ns is None:
        return "-"
    moment = datetime.datetime.fromtimestamp(ns / 1e9, tz=datetime.timezone.utc)
    return moment.strftime("%Y-%m-%d %H:%M:%S UTC")


def _size(count: int) -> str:
    return f"{format_bytes(count)} ({count:,} bytes)"


def _count(number: int, word: str) -> str:
    return f"{number:,} {word}{'' if number == 1 else 's'}"


def _model_lines(model: ModelReport) -> list[str]:
    lines = [f"model {model.model or '(unknown)'}  (folder {model.folder})"]
    if model.config_problem:
        lines.append(f"  WARNING     {model.config_problem}")
    lines.append(f"  layout      {model.layout}")
    lines.append(f"  checkpoint  {model.checkpoint}")
    groups = ", ".join(f"{tokens}-token blocks" for tokens in model.groups) or "-"
    lines.append(f"  kv          {model.dtype or '-'}; groups: {groups}")
    for rank, books in sorted(model.ranks.items()):
        lines.append(
            f"  rank {rank}      {_count(books.chunks, 'chunk')}, {_size(books.bytes)}; oldest "
            f"{_when(books.oldest_ns)}, newest {_when(books.newest_ns)}"
        )
    good = sum(books.good for books in model.ranks.values())
    keyed = sum(books.keyed for books in model.ranks.values())
    refused = sum(len(books.refused) for books in model.ranks.values())
    if model.page_bytes is None:
        seals = "not checked: stock rows carry no seal"
    elif model.sealed is False:
        seals = "not checked: no chunk carries a seal (written with verify_chunks false)"
    elif model.sealed is None:
        seals = "no chunk yet"
    else:
        seals = (
            f"{good} good, {refused} refused"
            + (f", {keyed} keyed (not checked: --seal-key-file)" if keyed else "")
            + "; "
            f"{_count(len(model.config_digests), 'configuration digest')} (checked by a "
            "serving engine)"
        )
    lines.append(f"  seals       {seals}")
    return lines


def describe(report: TierReport) -> list[str]:
    private = (
        "no other local user may enter it"
        if not report.mode & 0o077
        else "other local users may enter it: make it private (chmod 700; see docs/sharing.md)"
    )
    lines = [f"fs tier {report.root} (mode 0o{report.mode:o}, owner uid {report.owner}: {private})"]
    for model in report.models.values():
        lines += _model_lines(model)
    refused = report.refused
    if refused:
        lines.append(f"refused: {_count(len(refused), 'file')}")
        for entry in refused:
            lines.append(f"  {entry.path}: {entry.problem}")
            if entry.outcome:
                lines.append(f"    -> {entry.outcome}")
    other = ", ".join(report.other[:5]) + (", ..." if len(report.other) > 5 else "")
    lines.append(
        f"also: {_count(report.in_flight, 'file')} being written (vLLM's temporary names), "
        f"{report.set_aside} set aside by a repair, {report.vanished} vanished during the "
        f"scan; links or non-files (not followed): {report.links}; names vLLM's fs tier "
        f"does not write: {len(report.other)}" + (f" ({other})" if other else "")
    )
    chunks = sum(model.chunks for model in report.models.values())
    size = sum(model.bytes for model in report.models.values())
    left = [entry for entry in refused if entry.outcome != "removed"]
    summary = (
        f"total: {_count(len(report.models), 'model')}, {_count(chunks, 'chunk')}, {_size(size)}"
    )
    removed = len(refused) - len(left)
    if removed:
        summary += f"; refused files removed: {removed}"
    if left:
        asked = any(entry.outcome for entry in refused)
        summary += f"; refused files still there: {len(left)}"
        summary += "" if asked else " (--remove-refused removes them)"
    lines.append(summary)
    return lines


def as_json(report: TierReport) -> dict[str, Any]:
    data = dataclasses.asdict(report)
    for folder, model in report.models.items():
        data["models"][folder]["chunks"] = model.chunks
        data["models"][folder]["bytes"] = model.bytes
    data["refused"] = [dataclasses.asdict(entry) for entry in report.refused]
    return data


def run(args: argparse.Namespace) -> int:
    try:
        import triton_offload.vllm.tier_repair  # noqa: F401
    except ImportError as error:
        print(
            f"triton-offload tier: error: tier needs the vLLM integration, which does not "
            f"import here ({error}); install: pip install 'triton-offload[vllm]'",
            file=sys.stderr,
        )
        return 1
    seal_key = None
    if args.seal_key_file is not None:
        from triton_offload.transfer.seal_key import SealKey

        try:
            seal_key = SealKey.from_file(args.seal_key_file, "--seal-key-file")
        except ValueError as error:
            raise UsageError(str(error)) from None
    report = scan_tier(args.root, remove_refused=args.remove_refused, seal_key=seal_key)
    if args.json:
        print(json.dumps(as_json(report), indent=2, sort_keys=True))
    else:
        print("\n".join(describe(report)))
    return 1 if any(entry.outcome != "removed" for entry in report.refused) else 0
