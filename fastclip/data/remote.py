"""Remote shards, streamed: `pipe:CMD` (CMD writes the shard to stdout), `s3://...`, `http(s)://...`.

The spellings are OpenCLIP's/webdataset's: `pipe:aws s3 cp s3://bucket/cc3m/{00000..00331}.tar -`,
`https://host/cc3m/{00000..00331}.tar`; `s3://bucket/x.tar` is read as `pipe:aws s3 cp s3://bucket/x.tar -`.
A shard is read front to back and never written to disk; a reader keeps the last `KEEP` bytes so tarfile's few
short backward seeks (re-reading a header block) work on a stream. The manifest is read from the same place by
the same transport: `manifest.json` beside the shard (the shard's last path component replaced, in the URL or in
the command's argument that names the shard).

A failure (a command that exits non-zero, an HTTP error, a connection that drops) raises `RemoteError` whose
message is one line: the location and the command's stderr tail or the HTTP status. One that happens before the
first byte and may pass (a command's non-zero exit, HTTP 5xx or 429, a refused or timed-out connection; not an HTTP
4xx) is retried after RETRY_DELAYS_S seconds (or the stream's `data.remote_retry_delays`), one delay per retry; the
message of the last failure says how many retries it had, and its `retries` attribute the number. (A stream that
breaks after bytes were served is not retried: the reader's position is gone.) The training stream counts them
under REMOTE_COUNTERS: the retries, and the shards given up on (their samples are skipped as unreadable_shard).
"""

from __future__ import annotations

import gzip
import http.client
import os
import posixpath
import shlex
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request

from fastclip.data.format import SHARD_SUFFIXES

REMOTE_PREFIXES = ("pipe:", "s3://", "http://", "https://")
KEEP = 1 << 16  # bytes kept behind the read position (tarfile seeks back at most one 512-byte block)
_CHUNK = 1 << 20
HTTP_TIMEOUT_S = 120
RETRY_DELAYS_S = (1.0, 3.0, 9.0)  # before each retry of a transient failure; then the shard's samples are skipped
REMOTE_COUNTERS = ("remote_retries", "remote_shards_skipped")  # the training stream's counters of remote reads


class RemoteError(OSError):
    """A remote shard or manifest could not be read; str() is one line naming the location. `transient`: it may pass
    on a retry."""

    transient = True
    retries = 0  # how many retries it had (the last failure of a retried read)


def _permanent(message: str) -> RemoteError:
    error = RemoteError(message)
    error.transient = False
    return error


def is_remote(location: str) -> bool:
    return isinstance(location, str) and location.startswith(REMOTE_PREFIXES)


def _shard_token(command: str) -> tuple[int, int]:
    """(start, end) of the argument of a pipe command that names the shard: the last one ending in a shard
    suffix (`aws s3 cp s3://b/x.tar -`: the URL, not the `-`)."""
    best = None
    pos = 0
    for token in command.split():
        start = command.index(token, pos)
        pos = start + len(token)
        if token.strip("'\"").endswith(SHARD_SUFFIXES):
            best = (start, pos)
    if best is None:
        raise RemoteError(
            f"pipe:{command}: no argument ends in {'/'.join(SHARD_SUFFIXES)}, so the shard (and the "
            f"manifest.json beside it) cannot be located"
        )
    return best


def shard_basename(location: str) -> str:
    """The shard's file name (its name in the manifest beside it)."""
    if location.startswith("pipe:"):
        a, b = _shard_token(location[5:])
        return posixpath.basename(location[5:][a:b].strip("'\""))
    return posixpath.basename(urllib.parse.urlsplit(location).path)


def sibling(location: str, name: str) -> str:
    """The location of `name` in the same folder as the shard at `location`, by the same transport."""
    if location.startswith("pipe:"):
        command = location[5:]
        a, b = _shard_token(command)
        token = command[a:b]
        trail = token[len(token.rstrip("'\"")) :]  # a closing quote stays where it was
        folder = posixpath.dirname(token[: len(token) - len(trail)])
        return "pipe:" + command[:a] + (folder + "/" if folder else "") + name + trail + command[b:]
    parts = urllib.parse.urlsplit(location)
    path = posixpath.join(posixpath.dirname(parts.path), name)
    return urllib.parse.urlunsplit(parts._replace(path=path))


def _gzipped(location: str) -> bool:
    try:
        return shard_basename(location).endswith((".tar.gz", ".tgz"))
    except RemoteError:  # a pipe that names no shard (a manifest's command): not a shard, not gzipped
        return False


def folder_of(location: str) -> str:
    """The shards' folder, for messages and grouping (the manifest's location with its name dropped)."""
    return sibling(location, "")


class _Pipe:
    """stdout of `sh -c CMD`; stderr goes to a temporary file (never a pipe: a chatty command cannot block)."""

    def __init__(self, command: str, where: str):
        self.where = where
        self._err = tempfile.TemporaryFile()
        try:
            self._proc = subprocess.Popen(
                command, shell=True, stdout=subprocess.PIPE, stderr=self._err, stdin=subprocess.DEVNULL
            )
        except OSError as e:
            self._err.close()
            raise RemoteError(f"{where}: cannot start the command ({e})") from None

    def read(self, n: int) -> bytes:
        data = self._proc.stdout.read(n)
        if not data:  # end of stdout: a command that failed part way ends its output early
            rc = self._proc.wait()
            if rc != 0:
                raise RemoteError(f"{self.where}: command exited with status {rc}: {self._stderr_tail()}")
        return data

    def _stderr_tail(self) -> str:
        self._err.seek(0, os.SEEK_END)
        size = self._err.tell()
        self._err.seek(max(0, size - 2000))
        text = self._err.read().decode("utf-8", "replace").strip()
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        return " | ".join(lines[-3:])[-500:] if lines else "(no stderr)"

    def close(self) -> None:
        if self._proc.poll() is None:  # stopped early (a worker that has its samples): do not wait for it
            self._proc.kill()
        self._proc.stdout.close()
        self._proc.wait()
        self._err.close()


class _Http:
    def __init__(self, url: str):
        self.where = url
        try:
            self._resp = urllib.request.urlopen(url, timeout=HTTP_TIMEOUT_S)
        except urllib.error.HTTPError as e:  # a server's trouble (5xx, 429) may pass; not found or refused does not
            error = RemoteError if e.code >= 500 or e.code == 429 else _permanent
            raise error(f"{url}: HTTP {e.code} {e.reason}") from None
        except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
            raise RemoteError(f"{url}: {getattr(e, 'reason', e)}") from None

    def read(self, n: int) -> bytes:
        try:
            return self._resp.read(n)
        except (OSError, http.client.HTTPException) as e:  # IncompleteRead is not an OSError
            raise RemoteError(f"{self.where}: connection broke ({type(e).__name__}: {e})") from None

    def close(self) -> None:
        self._resp.close()


def _open_raw(location: str):
    if location.startswith("pipe:"):
        return _Pipe(location[5:], location)
    if location.startswith("s3://"):
        return _Pipe(f"aws s3 cp {shlex.quote(location)} -", location)
    if location.startswith(("http://", "https://")):
        return _Http(location)
    raise RemoteError(f"{location}: not a remote location (pipe:, s3://, http(s)://)")


class StreamFile:
    """A forward-only remote stream as a file object for tarfile: read, tell, and seek (forward by reading and
    discarding, backward within the last KEEP bytes). Gzipped shards (.tar.gz, .tgz) are decompressed on the way.
    """

    def __init__(self, location: str, retry_delays: tuple[float, ...] | list[float] | None = None):
        self.name = location
        self.delays = tuple(RETRY_DELAYS_S if retry_delays is None else retry_delays)  # seconds before each retry
        self.retries = 0  # transient failures retried (before the first byte)
        self._open()
        self._pos = 0  # bytes taken from the source
        self._tail = bytearray()  # the last bytes taken, ending at _pos
        self._back = 0  # the read position is _pos - _back

    def _open(self) -> None:
        while True:
            try:
                self._raw = _open_raw(self.name)
                break
            except RemoteError as e:
                self._wait_or_raise(e)
        self._src = gzip.GzipFile(fileobj=self._raw, mode="rb") if _gzipped(self.name) else self._raw

    def _wait_or_raise(self, error: RemoteError) -> None:
        """Before the next try of a transient failure, its delay; else the error, saying how many retries it had."""
        if not error.transient or self.retries >= len(self.delays):
            if self.retries:
                error = RemoteError(f"{error} (after {self.retries} retries)")
                error.retries = self.retries
                raise error from None
            raise error
        time.sleep(self.delays[self.retries])
        self.retries += 1

    def _take(self, n: int) -> bytes:
        parts, got = [], 0
        while got < n:
            try:
                data = self._src.read(min(n - got, _CHUNK))
            except (EOFError, gzip.BadGzipFile) as e:  # a gzip stream cut short
                raise RemoteError(f"{self.name}: gzip stream broken ({e})") from None
            except RemoteError as e:
                if self._pos or got:  # bytes were served: a new stream would start over
                    raise
                self.close()
                self._wait_or_raise(e)
                self._open()
                continue
            if not data:
                break
            parts.append(data)
            got += len(data)
        data = b"".join(parts)
        self._pos += len(data)
        self._tail += data
        if len(self._tail) > 2 * KEEP:
            del self._tail[:-KEEP]
        return data

    def read(self, n: int = -1) -> bytes:
        out = b""
        if self._back:
            start = len(self._tail) - self._back
            out = bytes(self._tail[start : start + (self._back if n < 0 else min(n, self._back))])
            self._back -= len(out)
            if n >= 0:
                n -= len(out)
        if n < 0:
            while data := self._take(_CHUNK):
                out += data
            return out
        return out + self._take(n) if n else out

    def tell(self) -> int:
        return self._pos - self._back

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        target = offset if whence == os.SEEK_SET else self.tell() + offset
        if whence not in (os.SEEK_SET, os.SEEK_CUR):
            raise RemoteError(f"{self.name}: a stream cannot seek from its end")
        back = self._pos - target
        if back > len(self._tail) or target < 0:
            raise RemoteError(f"{self.name}: cannot seek back {back} bytes in a stream (kept: {len(self._tail)})")
        if back >= 0:
            self._back = back
        else:
            self._back = 0
            while self._pos < target:
                if not self._take(min(target - self._pos, _CHUNK)):
                    break  # past the end: the next read returns b"", as for a file
        return target

    def seekable(self) -> bool:
        return True  # within the limits above; tarfile only needs those

    def readable(self) -> bool:
        return True

    def close(self) -> None:
        if self._src is not self._raw:
            self._src.close()
        self._raw.close()


def read_bytes(location: str) -> bytes:
    """The whole object at a remote location (a manifest: small)."""
    f = StreamFile(location)
    try:
        return f.read()
    finally:
        f.close()
