"""CRIU image files of the kinds the plugin reads or rewrites: page maps and memory maps.

An image file is two 32-bit magics (CRIU's common one, then the kind's), then entries, each
a 32-bit little-endian length followed by one protobuf message. The messages are declared
here from CRIU's published image format (field numbers and types, nothing else); the
protobuf library encodes and decodes them. Fields left undeclared survive a read and a
write unchanged (protobuf keeps unknown fields), so only what the plugin uses is named.

A page map (``pagemap-<pid>.img``) lists the process's dumped pages as runs of addresses;
the data of every run flagged present follows, run after run, in ``pages-<id>.img``, which
has no header. A memory map (``mm-<pid>.img``) holds the process's areas with CRIU's own
classification of each (``status``).
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

IMG_COMMON_MAGIC = 0x54564319
PAGEMAP_MAGIC = 0x56084025
MM_MAGIC = 0x57492820

# Page map entry flags.
PE_PARENT = 1 << 0  # the pages are in a parent (incremental) image
PE_LAZY = 1 << 1  # the pages may be restored on demand
PE_PRESENT = 1 << 2  # the pages are in the pages image

# Memory area status bits (CRIU's classification).
VMA_AREA_REGULAR = 1 << 0
VMA_AREA_STACK = 1 << 1
VMA_AREA_VSYSCALL = 1 << 2
VMA_AREA_VDSO = 1 << 3
VMA_AREA_HEAP = 1 << 5
VMA_FILE_PRIVATE = 1 << 6
VMA_FILE_SHARED = 1 << 7
VMA_ANON_SHARED = 1 << 8
VMA_ANON_PRIVATE = 1 << 9
VMA_AREA_SYSVIPC = 1 << 10
VMA_AREA_SOCKET = 1 << 11
VMA_AREA_VVAR = 1 << 12
VMA_AREA_AIORING = 1 << 13
VMA_AREA_MEMFD = 1 << 14
VMA_AREA_SHSTK = 1 << 15
VMA_AREA_GUARD = 1 << 16
VMA_AREA_UPROBES = 1 << 17

PAGE = 4096

_U64, _U32, _BOOL, _MSG, _S64 = (
    descriptor_pb2.FieldDescriptorProto.TYPE_UINT64,
    descriptor_pb2.FieldDescriptorProto.TYPE_UINT32,
    descriptor_pb2.FieldDescriptorProto.TYPE_BOOL,
    descriptor_pb2.FieldDescriptorProto.TYPE_MESSAGE,
    descriptor_pb2.FieldDescriptorProto.TYPE_SINT64,
)

#: message -> (field, number, type[, message type, repeated]); every field optional here, so a
#: reader is lenient and a writer emits exactly the fields it sets.
_MESSAGES: dict[str, tuple[tuple[Any, ...], ...]] = {
    "PagemapHead": (("pages_id", 1, _U32),),
    "PagemapEntry": (("vaddr", 1, _U64), ("compat_nr_pages", 2, _U32), ("in_parent", 3, _BOOL), ("flags", 4, _U32), ("nr_pages", 5, _U64)),
    "VmaEntry": (
        ("start", 1, _U64),
        ("end", 2, _U64),
        ("pgoff", 3, _U64),
        ("shmid", 4, _U64),
        ("prot", 5, _U32),
        ("flags", 6, _U32),
        ("status", 7, _U32),
        ("fd", 8, _S64),
        ("madv", 9, _U64),
        ("fdflags", 10, _U32),
    ),  # fmt: skip
    "MmEntry": (("vmas", 14, _MSG, "VmaEntry", True),),
}


@functools.cache
def message(name: str) -> Any:
    """The protobuf class of one of the image messages above."""
    package = "coldsnap.criu_images"
    f = descriptor_pb2.FileDescriptorProto(name="coldsnap_criu_images.proto", package=package, syntax="proto2")
    for msg, fields in _MESSAGES.items():
        m = f.message_type.add(name=msg)
        for spec in fields:
            field = m.field.add(name=spec[0], number=spec[1], type=spec[2])
            field.label = descriptor_pb2.FieldDescriptorProto.LABEL_REPEATED if len(spec) > 4 and spec[4] else descriptor_pb2.FieldDescriptorProto.LABEL_OPTIONAL
            if spec[2] == _MSG:
                field.type_name = ".%s.%s" % (package, spec[3])
    pool = descriptor_pool.DescriptorPool()
    pool.Add(f)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("%s.%s" % (package, name)))


class ImageFormatError(ValueError):
    """An image file that is not what its name says."""


@dataclass
class ImageFile:
    magic: int
    entries: list[bytes]

    @classmethod
    def read(cls, path: Path, magic: int) -> ImageFile:
        data = path.read_bytes()
        if len(data) < 8:
            raise ImageFormatError("%s: too short for an image" % path.name)
        common, kind = struct.unpack_from("<II", data)
        if common != IMG_COMMON_MAGIC or kind != magic:
            raise ImageFormatError("%s: magic %#x/%#x, expected %#x/%#x" % (path.name, common, kind, IMG_COMMON_MAGIC, magic))
        entries, pos = [], 8
        while pos < len(data):
            if pos + 4 > len(data):
                raise ImageFormatError("%s: cut inside an entry's length" % path.name)
            (size,) = struct.unpack_from("<I", data, pos)
            pos += 4
            if pos + size > len(data):
                raise ImageFormatError("%s: an entry runs past the end" % path.name)
            entries.append(data[pos : pos + size])
            pos += size
        return cls(magic, entries)

    def to_bytes(self) -> bytes:
        return struct.pack("<II", IMG_COMMON_MAGIC, self.magic) + b"".join(struct.pack("<I", len(e)) + e for e in self.entries)


def parse(name: str, raw: bytes) -> Any:
    out = message(name)()
    out.ParseFromString(raw)
    return out


def entry_pages(entry: Any) -> int:
    """A page map entry's page count (CRIU 4 writes it in ``nr_pages``, older ones in the 32-bit field)."""
    return int(entry.nr_pages) if entry.HasField("nr_pages") else int(entry.compat_nr_pages)


def pagemap_entry(vaddr: int, pages: int, flags: int) -> bytes:
    """An entry as CRIU 4 writes one: the 64-bit count, the 32-bit one left 0."""
    return bytes(message("PagemapEntry")(vaddr=vaddr, compat_nr_pages=0, flags=flags, nr_pages=pages).SerializeToString())


def located_entries(pagemap: ImageFile, pages_size: int, names: str) -> Iterator[tuple[bytes, Any, int | None]]:
    """Each entry after the page map's head, parsed, with the offset of its pages in the pages
    image (None: its pages are not there, but in a parent image). Raises when the page map and
    the pages image (of *pages_size* bytes; *names* names the two) do not agree."""
    offset = 0
    for raw in pagemap.entries[1:]:
        e = parse("PagemapEntry", raw)
        if not e.flags & PE_PRESENT:
            yield raw, e, None
            continue
        end = offset + entry_pages(e) * PAGE
        if end > pages_size:
            raise ImageFormatError("%s: the page map lists more pages than the pages image holds" % names)
        yield raw, e, offset
        offset = end
    if offset != pages_size:
        raise ImageFormatError("%s: the pages image holds %d bytes, the page map lists %d" % (names, pages_size, offset))
