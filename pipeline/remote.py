"""A prepared dataset read from a URL (`http(s)://`, `s3://`, any fsspec protocol): fetched
through a shared on-disk cache, with retries, and prefetched ahead of the reader.

The design and its reasons: docs/design.md#pipelineremotepy.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import itertools
import logging
import os
import random
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from common.configure import UserError

log = logging.getLogger(__name__)

_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
_GB = 1 << 30


class FetchError(Exception):
    """A file that could not be fetched after the retries; the message says why."""


@dataclass(frozen=True)
class FetchConfig:
    """How remote files are fetched and cached; picklable, so it travels to DataLoader
    workers with the shards."""

    cache_dir: str = ""  # "" = default_cache_dir()
    max_bytes: int = 50 * _GB
    retries: int = 3
    backoff_s: float = 1.0
    timeout_s: float = 60.0
    prefetch: int = 2

    @classmethod
    def from_loader_config(cls, cfg) -> FetchConfig:
        """The fetch settings of a `pipeline.load.config.LoaderConfig`."""
        return cls(
            cache_dir=cfg.cache_dir,
            max_bytes=int(cfg.cache_max_gb * _GB),
            retries=cfg.fetch_retries,
            backoff_s=cfg.fetch_backoff_s,
            timeout_s=cfg.fetch_timeout_s,
            prefetch=cfg.prefetch_shards,
        )

    def directory(self) -> Path:
        return Path(self.cache_dir or default_cache_dir())


def default_cache_dir() -> str:
    return os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"),
        "pretrain-pipeline",
        "shards",
    )


def is_url(path: str | os.PathLike) -> bool:
    return isinstance(path, str) and _URL.match(path) is not None


def join(base: str | os.PathLike, relative: str) -> str:
    """`base`/`relative` for a local directory or a URL (a Path would turn
    "http://" into "http:/")."""
    if is_url(base):
        return base.rstrip("/") + "/" + relative.lstrip("/")
    return str(Path(base) / relative)


# One filesystem object per (process, protocol): fsspec's async filesystems refuse to be used
# after a fork, and DataLoader workers are forked.
_filesystems: dict[tuple[int, str, float], object] = {}


def filesystem(url: str, timeout_s: float = 60.0):
    """The fsspec filesystem serving `url`; a one-line UserError if its protocol is unknown or
    its package is not installed."""
    import fsspec
    from fsspec.registry import known_implementations

    protocol = url.split("://", 1)[0].lower()
    key = (os.getpid(), protocol, timeout_s)
    if key not in _filesystems:
        options = {}
        try:
            if protocol in ("http", "https"):
                import aiohttp

                # A server that stops sending would otherwise hold the reader, and every rank,
                # forever.
                options["client_kwargs"] = {
                    "timeout": aiohttp.ClientTimeout(
                        total=None, sock_connect=timeout_s, sock_read=timeout_s
                    )
                }
            _filesystems[key] = fsspec.filesystem(protocol, skip_instance_cache=True, **options)
        except ValueError as err:
            raise UserError(f"{url}: unknown protocol {protocol!r} ({err})") from err
        except ImportError as err:
            hint = known_implementations.get(protocol, {}).get("err") or str(err)
            raise UserError(
                f"{url}: the {protocol!r} protocol needs a package that is not installed: {hint}"
            ) from err
    return _filesystems[key]


def read_bytes(path: str | os.PathLike, fetch: FetchConfig | None = None) -> bytes:
    """A small file's bytes (a manifest), read afresh with retries, not cached. FileNotFoundError
    if it does not exist, FetchError if it could not be read."""
    if not is_url(path):
        return Path(path).read_bytes()
    fetch = fetch or FetchConfig()
    fs = filesystem(path, fetch.timeout_s)
    return _with_retries(path, fetch, lambda: fs.cat_file(path))


def local_file(
    path: str | os.PathLike,
    fetch: FetchConfig | None = None,
    *,
    size: int | None = None,
    sha256: str | None = None,
) -> str:
    """A local path holding `path`'s bytes: `path` itself, or its copy in the cache (fetched if
    needed; a one-line UserError if it cannot be). With `sha256`, a local file is checked against
    it as a download is: a damaged or replaced file (a truncated tokenizer) is a UserError."""
    if not is_url(path):
        if sha256 is not None:
            from common.hashing import file_sha256

            if not Path(path).is_file():
                raise UserError(f"{path}: not found")
            if (actual := file_sha256(path)) != sha256:
                raise UserError(
                    f"{path}: sha256 {actual[:12]}... differs from the manifest's {sha256[:12]}... "
                    "(a damaged or replaced file)"
                )
        return str(path)
    try:
        with cached(path, fetch or FetchConfig(), size=size, sha256=sha256) as local:
            return local
    except FetchError as err:
        raise UserError(f"{path}: cannot fetch: {err}") from err


# Fetches that failed in this process's prefetch thread: the reader that comes for them takes the
# verdict (once) instead of retrying all over again.
_failed: dict[str, str] = {}
stats = {"downloads": 0, "cache_hits": 0, "retries": 0, "evictions": 0}  # this process's counters


@contextlib.contextmanager
def cached(
    url: str,
    fetch: FetchConfig,
    *,
    size: int | None = None,
    sha256: str | None = None,
    _prefetching: bool = False,
):
    """The local path of `url`'s copy in the cache, downloaded first if needed; the entry is
    locked (shared) for the duration of the `with`, so it is not evicted while being read."""
    directory = fetch.directory()
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UserError(f"data.cache_dir: cannot create {directory}: {err}") from err
    key = _entry_key(url, size, sha256)
    data = directory / f"{key}.data"
    with open(directory / f"{key}.lock", "a+b") as lock:
        while True:
            fcntl.flock(lock, fcntl.LOCK_SH)
            if data.exists():
                os.utime(data)  # last use, for the LRU order
                stats["cache_hits"] += 1
                yield str(data)
                return
            fcntl.flock(lock, fcntl.LOCK_UN)
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not data.exists():  # another process may have fetched it while this one waited
                failed = None if _prefetching else _failed.pop(key, None)
                if failed is not None:
                    raise FetchError(failed)
                # left by downloads that died: only the lock holder writes them
                _remove_partials(directory, key)
                _make_room(directory, fetch.max_bytes - (size or 0), keep=key)
                _download(url, directory, key, fetch, size, sha256)
                _make_room(directory, fetch.max_bytes, keep=key)
            # Back to a shared lock to read; between the two, the entry may go, so look again.
            fcntl.flock(lock, fcntl.LOCK_UN)


def _entry_key(url: str, size: int | None, sha256: str | None) -> str:
    identity = hashlib.sha256(
        f"{url}\0{sha256 or ''}\0{size if size is not None else ''}".encode()
    ).hexdigest()
    name = re.sub(r"[^A-Za-z0-9_-]", "_", url.rstrip("/").rsplit("/", 1)[-1])[-48:]
    return f"{identity[:32]}-{name}"


def _download(
    url: str, directory: Path, key: str, fetch: FetchConfig, size: int | None, sha256: str | None
) -> None:
    fs = filesystem(url, fetch.timeout_s)
    partial = directory / f"{key}.{os.getpid()}-{threading.get_ident()}.part"

    def attempt():
        try:
            fs.get_file(url, str(partial))
            got = partial.stat().st_size
            if size is not None and got != size:
                raise FetchError(f"{got} bytes arrived, the manifest says {size}")
            if sha256 is not None:
                from common.hashing import file_sha256

                if (actual := file_sha256(partial)) != sha256:
                    raise FetchError(
                        f"sha256 {actual[:12]}... differs from the manifest's {sha256[:12]}..."
                    )
            os.replace(partial, directory / f"{key}.data")
        finally:
            with contextlib.suppress(FileNotFoundError):
                partial.unlink()

    try:
        _with_retries(url, fetch, attempt)
    except FileNotFoundError as err:
        raise FetchError(f"not found ({err})") from err
    stats["downloads"] += 1


def _with_retries(url: str, fetch: FetchConfig, attempt):
    attempts = max(fetch.retries, 0) + 1
    for number in range(1, attempts + 1):
        try:
            return attempt()
        except FileNotFoundError:
            raise  # a missing file stays missing: no retry
        # network, server and storage errors alike: retried, then one verdict
        except Exception as err:
            message = f"{type(err).__name__}: {err}".strip().splitlines()[0]
            if number == attempts:
                raise FetchError(f"{message} (after {attempts} attempts)") from err
            # Exponential back-off, jittered so the ranks of a node do not retry in lockstep.
            delay = fetch.backoff_s * 2 ** (number - 1) * random.uniform(1.0, 1.5)
            stats["retries"] += 1
            log.warning(
                "fetching %s failed (attempt %d of %d): %s; retrying in %.1f s",
                url,
                number,
                attempts,
                message,
                delay,
            )
            time.sleep(delay)


def _make_room(directory: Path, budget: int, keep: str) -> None:
    """Remove least recently used entries (not `keep`, not one being read) until the entries take
    at most `budget` bytes; remove the partial files of dead downloads on the way."""
    entries = []
    for path in directory.iterdir():
        try:
            status = path.stat()
        except FileNotFoundError:
            continue
        key, _, suffix = path.name.partition(".")
        if suffix == "data":
            entries.append((status.st_mtime, status.st_size, key, path))
        elif suffix.endswith(".part") and key != keep:
            with _try_lock(directory, key) as locked:
                if locked:  # nobody downloads it: the download that wrote this file is dead
                    with contextlib.suppress(FileNotFoundError):
                        path.unlink()
    total = sum(size for _, size, _, _ in entries)
    for _, size, key, path in sorted(entries):
        if total <= budget:
            break
        if key == keep:
            continue
        with _try_lock(directory, key) as locked:
            if locked:
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
                    stats["evictions"] += 1
                    log.info("shard cache: evicted %s (%d bytes)", path.name, size)
                total -= size


@contextlib.contextmanager
def _try_lock(directory: Path, key: str):
    """Whether the entry's exclusive lock could be taken at once (held for the `with` if so)."""
    try:
        lock = open(directory / f"{key}.lock", "a+b")
    except OSError:
        yield False
        return
    with lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            if err.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise
            yield False
            return
        yield True


def _remove_partials(directory: Path, key: str) -> None:
    for path in directory.glob(f"{key}.*.part"):
        log.info("shard cache: removing %s, left by a download that did not finish", path.name)
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def prefetch(shards) -> None:
    """Keep the next shards of `shards` (an iterable, possibly lazy, of the shards this process
    will read, in order, each with `path`, `bytes`, `sha256` and `fetch`) downloaded ahead of the
    reader, in a background thread; replaces the shards of an earlier call. A dataset whose first
    shard is local costs nothing more."""
    global _prefetcher
    shards = iter(shards)
    first = next(shards, None)
    if first is None or not is_url(first.path) or (first.fetch or FetchConfig()).prefetch < 1:
        if _prefetcher is not None and _prefetcher.pid == os.getpid():
            _prefetcher.follow(iter(()), 0)
        return
    if _prefetcher is None or _prefetcher.pid != os.getpid():  # a forked worker inherits no thread
        _prefetcher = _Prefetcher()
    _prefetcher.follow(itertools.chain([first], shards), (first.fetch or FetchConfig()).prefetch)


def reading(url: str) -> None:
    """Tell the prefetcher that the reader has come to `url`: it fetches up to
    `prefetch` shards past it."""
    if _prefetcher is not None and _prefetcher.pid == os.getpid():
        _prefetcher.reached(url)


class _Prefetcher:
    """One thread per process: draws the distinct shards from the stream it follows, as far as
    `prefetch` shards past the one the reader is at, and fetches them into the cache in order."""

    def __init__(self):
        self.pid = os.getpid()
        self.changed = threading.Condition()
        self.follow(iter(()), 0)
        threading.Thread(target=self._run, name="shard-prefetch", daemon=True).start()

    def follow(self, stream, lookahead: int) -> None:
        with self.changed:
            # verdicts stand for the stream they were reached in (an epoch): the next one tries
            # again
            _failed.clear()
            self.stream, self.lookahead = stream, lookahead
            self.shards: list = []  # drawn from the stream so far, each path once
            self.place: dict[str, int] = {}
            self.position = -1  # the latest shard the reader has come to
            self.next = 0  # the next shard to fetch
            self.sought: str | None = None  # a shard the reader came to before it was drawn
            self.changed.notify()

    def reached(self, url: str) -> None:
        with self.changed:
            self.sought = url
            self.changed.notify()

    def _draw(self, until: int) -> None:
        """Draw from the stream until shard `until` exists, or the stream ends."""
        while len(self.shards) <= until:
            shard = next(self.stream, None)
            if shard is None:
                return
            if shard.path not in self.place:
                self.place[shard.path] = len(self.shards)
                self.shards.append(shard)

    def _due(self) -> object | None:
        """The next shard to fetch, if one is due (caller holds the condition)."""
        if self.sought is not None:
            # the reader is a little ahead; a filler's shard is not in the stream
            if self.sought not in self.place:
                self._draw(len(self.shards) + self.lookahead)
            i = self.place.get(self.sought, -1)
            if i > self.position:
                self.position = i
                self.next = max(self.next, i + 1)  # the reader fetches its own shard
            self.sought = None
        self._draw(self.position + self.lookahead)
        if self.next < len(self.shards) and self.next <= self.position + self.lookahead:
            self.next += 1
            return self.shards[self.next - 1]
        return None

    def _run(self) -> None:
        while True:
            with self.changed:
                while (shard := self._safe_due()) is None:
                    self.changed.wait()
            fetch = shard.fetch or FetchConfig()
            try:
                with cached(
                    shard.path, fetch, size=shard.bytes, sha256=shard.sha256, _prefetching=True
                ):
                    pass
            except FetchError as err:
                _failed[_entry_key(shard.path, shard.bytes, shard.sha256)] = str(err)
            except Exception as err:  # the reader meets it again and reports it
                log.debug("prefetching %s: %s", shard.path, err)

    def _safe_due(self):
        try:
            return self._due()
        # a stream that cannot be drawn from: prefetching stops, reading goes on
        except Exception as err:
            log.debug("shard prefetch stopped: %s", err)
            self.follow(iter(()), 0)
            return None


_prefetcher: _Prefetcher | None = None
