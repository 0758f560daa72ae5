"""The shard reader: a scan of the tar headers serves well-formed shards; webdataset's reader (over
Python's tarfile) is the reference, and must be asked for anything the scan does not vouch for."""

from __future__ import annotations

import json
from pathlib import Path

from pipeline.load import shards
from tests.shardtools import make_dataset

REAL_DATA = Path(__file__).resolve().parents[2] / "data" / "gettext-en-de"


def shards_of(data_dir, dataset, split="train", *, check_size=True):
    records = json.loads((Path(data_dir) / "manifest.json").read_text())["datasets"][dataset][
        "splits"
    ][split]["shards"]
    return [
        shards.Shard(
            i, str(Path(data_dir) / r["path"]), r["samples"], r["bytes"] if check_size else None
        )
        for i, r in enumerate(records)
    ]


def read_both(shard, fields):
    """What `read_shard` and the reference reader make of all of `shard`: the members, or the error message."""
    answers = []
    for read in (shards.read_shard, shards.read_shard_with_webdataset):
        try:
            answers.append(read(shard, fields, set(range(shard.samples))))
        except shards.ShardError as err:
            answers.append(str(err))
    return answers


def test_tar_scan_reads_written_shards_as_webdataset_does(tmp_path):
    make_dataset(tmp_path, packed=[1, 40], translation=[30])
    cases = [(shard, ("input_ids",)) for shard in shards_of(tmp_path, "packed")]
    cases += [(shard, ("src_ids", "tgt_ids")) for shard in shards_of(tmp_path, "translation")]
    if (REAL_DATA / "manifest.json").is_file():  # the prepared dataset, when this checkout has it
        # A dataset prepared before `doc_starts` holds token ids only: its manifest says which.
        packed_fields = shards.stored_fields(
            json.loads((REAL_DATA / "manifest.json").read_text()), "causal_lm"
        )
        cases += [(shard, packed_fields) for shard in shards_of(REAL_DATA, "packed", "valid")[:3]]
        cases += [
            (shard, ("src_ids", "tgt_ids"))
            for shard in shards_of(REAL_DATA, "translation", "valid")[:3]
        ]
    for shard, fields in cases:
        scanned = shards.scan_tar(Path(shard.path).read_bytes(), fields)
        # served by the scan, not the fallback
        assert scanned is not None and len(scanned) == shard.samples
        fast, reference = read_both(shard, fields)
        assert isinstance(fast, dict) and fast == reference and len(fast) == shard.samples


def rewrite_header(data: bytearray, offset: int, start: int, value: bytes) -> None:
    """Put `value` at `start` in the tar header at `offset` and fix its checksum, as a writer would."""
    data[offset + start : offset + start + len(value)] = value
    data[offset + 148 : offset + 156] = b" " * 8
    data[offset + 148 : offset + 156] = b"%06o\0 " % sum(data[offset : offset + 512])


def test_tar_scan_leaves_damaged_or_unusual_shards_to_webdataset(tmp_path):
    import tarfile

    make_dataset(tmp_path, translation=[4])
    # the tar readers decide, not the size check
    (shard,) = shards_of(tmp_path, "translation", check_size=False)
    fields = ("src_ids", "tgt_ids")
    good = Path(shard.path).read_bytes()
    with tarfile.open(shard.path) as tar:
        headers = [member.offset for member in tar.getmembers()]
    # the end-of-archive block: each member here is one header and one data block
    end = headers[-1] + 1024

    def verdict(data: bytes):
        Path(shard.path).write_bytes(data)
        fast, reference = read_both(shard, fields)
        assert fast == reference  # the same members, or the same error message
        return shards.scan_tar(data, fields), fast

    # Cut short anywhere before the end-of-archive block: rejected, by the reference reader's
    # verdict.
    for cut in sorted({*range(0, end, 512), *range(100, end, 512), end - 1}):
        scanned, answer = verdict(good[:cut])
        assert scanned is None and isinstance(answer, str), cut
    # Cut just before it: every member is whole and tarfile takes the end of the file for the end.
    scanned, answer = verdict(good[:end])
    assert scanned is None and isinstance(answer, dict)
    # Cut only in the zero padding after it: whole, and read by the scan.
    scanned, answer = verdict(good[: end + 512])
    assert scanned is not None and isinstance(answer, dict)

    # A byte changed in a header (checksum left as it was), at the first member or a later one.
    for header in (headers[0], headers[3]):
        for start in (0, 20, 100, 124, 135, 148, 156, 257, 345):
            data = bytearray(good)
            data[header + start] ^= 0x41
            scanned, answer = verdict(bytes(data))
            assert scanned is None and isinstance(answer, str), (header, start)

    # Headers that are valid but not what the scan reads itself: other member types, names it does
    # not split, a ustar name prefix, numbers in forms it leaves to tarfile.
    name = good[headers[2] : headers[2] + 100].split(b"\0")[0]  # "<key>.src_ids.npy"
    unusual = [
        (156, b"5"),
        (156, b"2"),
        (156, b"x"),
        (0, b"noext\0"),
        (345, b"dir\0"),
        (124, b"\x80" + bytes(10) + b"\x01"),
        (100, b"07 7\0"),
        (100, b"0000644\n"),
    ]
    for start, value in unusual:
        data = bytearray(good)
        rewrite_header(data, headers[2], start, value)
        scanned, _ = verdict(bytes(data))
        assert scanned is None, value

    # Both members of a sample moved under "__meta__/", which webdataset skips as metadata: a sample
    # short.
    data = bytearray(good)
    for header in headers[2:4]:
        rewrite_header(data, header, 0, b"__meta__/" + good[header : header + 100].split(b"\0")[0])
    scanned, answer = verdict(bytes(data))
    assert scanned is None and answer == "3 samples, the manifest says 4"

    # A first sample whose key Python's stream reader takes for the magic number of a bzip2 stream.
    data = bytearray(good)
    for header in headers[:2]:
        suffix = good[header : header + 100].split(b"\0")[0].split(b".", 1)[1]
        rewrite_header(data, header, 0, b"BZh91AY&SY." + suffix + b"\0")
    scanned, answer = verdict(bytes(data))
    assert scanned is None and answer.startswith("unreadable: ReadError")

    # What both readers take as it is: an upper-case suffix (webdataset lowercases it), numbers
    # padded with spaces.
    for start, value in [
        (0, name.upper()),
        (124, b" " + good[headers[2] + 125 : headers[2] + 135] + b" "),
    ]:
        data = bytearray(good)
        rewrite_header(data, headers[2], start, value)
        scanned, answer = verdict(bytes(data))
        assert scanned is not None and isinstance(answer, dict), value
