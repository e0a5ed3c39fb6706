"""Reading and writing tar shards, one sample (key group) at a time.

The reader addresses samples by ordinal (position of the key group in tar order) and can skip groups by
reading their headers only, so a worker can start in the middle of a shard. A shard that breaks (truncated
file, bad header) raises `TarBroken`; the group being read when it broke is lost, since we cannot tell whether
it was complete. A remote shard (`pipe:`, `s3://`, `http(s)://`; fastclip/data/remote.py) is streamed front
to back: skipping reads and discards, and a failure's message is the remote one (location, stderr tail).
"""

from __future__ import annotations

import io
import os
import re
import tarfile
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from fastclip.data.format import split_member_name
from fastclip.data.remote import RemoteError, StreamFile, is_remote

_BLOCK = 512


class TarBroken(Exception):
    """The tar ends early or is corrupt; str() says where, on one line."""

    def __init__(self, message: str, retries: int = 0):
        super().__init__(one_line(message))
        self.retries = retries  # a remote shard's retries before it was given up on


def one_line(text: str) -> str:
    """An error's text on one line; tarfile's open error lists every method it tried on its own line: the tar
    one is what matters."""
    text = re.sub(
        r"file could not be opened successfully:\s*(?:- method \w+: .*\n\s*)*- method tar: (.*)",
        r"not a tar file (\1)",
        text,
    )
    return re.sub(r"\s*\n\s*", " ", text).strip()


@dataclass
class RawSample:
    key: str
    ordinal: int  # position of the key group in the tar
    files: dict[str, bytes]  # extension -> bytes, for the extensions asked for
    exts: tuple[str, ...]  # every extension present, loaded or not


class ShardReader:
    """Walks one tar shard group by group. `want`: extensions to load (None: all). `retry_delays`: a remote shard's
    (fastclip/data/remote.py)."""

    def __init__(self, path: str | os.PathLike, want: frozenset[str] | None = None, retry_delays=None):
        self.path = str(path)
        self.want = want
        self._tar = None
        self.ordinal = 0  # ordinal of the next group
        self.last_key: str | None = None
        self._ahead: tarfile.TarInfo | None = None
        self._stream = None  # a remote shard's stream (fastclip/data/remote.py): read front to back
        self.retries = 0  # a remote shard's retries: all before its first byte, so all while opening here
        try:
            if is_remote(self.path):
                self._stream = StreamFile(self.path, retry_delays)
                self._tar = tarfile.open(fileobj=self._stream, mode="r:")
                self.retries = self._stream.retries
            else:
                self._tar = tarfile.open(self.path, mode="r:*")
        except (tarfile.TarError, OSError, EOFError, zlib.error) as e:
            # StreamFile's own failure carries its retries; one after it opened (not a tar), the stream's
            retries = self._stream.retries if self._stream is not None else getattr(e, "retries", 0)
            self.close()
            if isinstance(e, RemoteError):  # already one line naming the location
                raise TarBroken(str(e), retries) from None
            raise TarBroken(f"cannot open as tar: {e}", retries) from None

    def close(self) -> None:
        if getattr(self, "_tar", None) is not None:
            self._tar.close()
        if self._stream is not None:
            self._stream.close()  # tarfile leaves a passed file object open; this also stops a pipe's command
            self._stream = None

    def __enter__(self) -> ShardReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _peek(self) -> tarfile.TarInfo | None:
        while self._ahead is None:
            try:
                member = self._tar.next()
            except (tarfile.TarError, OSError, EOFError, zlib.error) as e:
                raise TarBroken(f"{e} {self._where(e)}, after key {self.last_key!r}") from None
            if member is None:
                if not self._clean_end():
                    raise TarBroken(
                        f"tar ends without an end-of-archive block at byte {self._tar.offset}, "
                        f"after key {self.last_key!r}"
                    )
                return None
            if member.isfile():
                self._ahead = member
        return self._ahead

    def _where(self, error: Exception) -> str:
        """Where the tar broke, for an operator to look: tarfile's "unexpected end of data" means the data of the
        last member whose header it read is cut; otherwise the header at its current offset is bad."""
        members = self._tar.members
        if str(error) == "unexpected end of data" and members:
            return f"in member {members[-1].name!r} at byte {members[-1].offset}"
        return f"at byte {self._tar.offset}"

    def _clean_end(self) -> bool:
        # tarfile stops quietly on a truncated or corrupt header; a real end is a full zero block there.
        fileobj = self._tar.fileobj
        try:
            fileobj.seek(self._tar.offset)
            block = fileobj.read(_BLOCK)
        except RemoteError as e:  # a remote command that failed at the very end: say so, not "truncated"
            raise TarBroken(str(e)) from None
        except (OSError, EOFError, zlib.error):
            return False
        return len(block) == _BLOCK and block.count(0) == _BLOCK

    def next_group(self, load: bool = True) -> RawSample | None:
        """The next sample, or None at a clean end; raises TarBroken."""
        member = self._peek()
        if member is None:
            return None
        key = split_member_name(member.name)[0]
        files: dict[str, bytes] = {}
        exts: list[str] = []
        while member is not None and split_member_name(member.name)[0] == key:
            ext = split_member_name(member.name)[1]
            exts.append(ext)
            if load and (self.want is None or ext in self.want):
                try:
                    files[ext] = self._tar.extractfile(member).read()
                except (tarfile.TarError, OSError, EOFError, zlib.error) as e:
                    raise TarBroken(f"{e} in member {member.name!r} at byte {member.offset}") from None
            self._ahead = None
            member = self._peek()  # a break here loses this group too: it may be incomplete
        sample = RawSample(key, self.ordinal, files, tuple(exts))
        self.ordinal += 1
        self.last_key = key
        return sample

    def skip_to(self, ordinal: int) -> bool:
        """Skip groups (headers only) until the next one has this ordinal; False if the tar ends first."""
        while self.ordinal < ordinal:
            if self.next_group(load=False) is None:
                return False
        return True


def iter_shard(path: str | os.PathLike, want: frozenset[str] | None = None):
    """All samples of a shard; raises TarBroken at the point where it breaks."""
    with ShardReader(path, want) as reader:
        while (sample := reader.next_group()) is not None:
            yield sample


class TarWriter:
    """Writes members with fixed metadata so the same samples give byte-identical shards."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._tmp = self.path.with_name(self.path.name + ".tmp")
        self._tar = tarfile.open(self._tmp, mode="w", format=tarfile.USTAR_FORMAT)

    def add(self, key: str, files: dict[str, bytes]) -> None:
        for ext, data in files.items():
            info = tarfile.TarInfo(f"{key}.{ext}")
            info.size, info.mtime, info.mode = len(data), 0, 0o644
            self._tar.addfile(info, io.BytesIO(data))

    def close(self) -> None:
        self._tar.close()
        os.replace(self._tmp, self.path)  # only complete shards get their final name


def write_tar(path: str | os.PathLike, groups: Iterable[tuple[str, dict[str, bytes]]]) -> None:
    writer = TarWriter(path)
    for key, files in groups:
        writer.add(key, files)
    writer.close()
