"""Compressed inputs cut short (issue #45, item 3): a `.jsonl.zst` truncated mid-frame, written
by the zstandard library and cut as a failed copy cuts it, is refused in one line naming the
file, as a cut `.gz` is, whether it is read whole or streamed in chunks, and by
`pipeline.prepare` itself; compressed files no reader decompresses (.xz, .bz2, ...) are refused
rather than read as raw bytes."""

import gzip
import json
from collections import Counter

import pytest
from corpora import prepare_args, run_prepare, synthetic_pairs
from sourcecfg import source_cfg

from common.configure import UserError
from pipeline.prepare.readers import read_unit
from pipeline.prepare.sources import expand_paths, plan_units
from pipeline.prepare.units import open_binary, stream_chunks

zstandard = pytest.importorskip("zstandard")

LINES = 1387


def jsonl(n: int = LINES) -> bytes:
    return "".join(
        json.dumps({"text": f"{en} ({i})"}) + "\n" for i, (en, _) in enumerate(synthetic_pairs(n))
    ).encode()


def cut(data: bytes, fraction: float = 0.2) -> bytes:
    return data[: int(len(data) * fraction)]


@pytest.fixture
def truncated(tmp_path):
    """{suffix: path} of the same jsonl, compressed and cut to a fifth."""
    data = jsonl()
    files = {
        ".zst": zstandard.ZstdCompressor().compress(data),
        ".gz": gzip.compress(data),
    }
    paths = {}
    for suffix, compressed in files.items():
        paths[suffix] = tmp_path / f"web.jsonl{suffix}"
        paths[suffix].write_bytes(cut(compressed))
    return paths


@pytest.mark.parametrize("suffix", [".zst", ".gz"])
@pytest.mark.parametrize("how", ["whole", "streamed"])
def test_a_truncated_compressed_file_is_refused_in_one_line(truncated, suffix, how):
    path = truncated[suffix]
    cfg = source_cfg(paths=f"[{path}]", format="jsonl")
    (unit,) = plan_units(expand_paths(cfg), cfg, 1 << 20 if how == "whole" else 256)
    assert unit.stream == (how == "streamed")
    with pytest.raises(UserError) as err:
        if how == "whole":
            list(read_unit(unit, cfg, Counter()))
        else:
            for chunk in stream_chunks(unit, 256):
                list(read_unit(chunk, cfg, Counter()))
    message = str(err.value)
    assert message.startswith(f"cannot read {path}: Compressed file ended before the end")
    assert "\n" not in message


def test_every_frame_of_a_zst_is_read_and_a_cut_at_any_point_in_a_frame_is_refused(tmp_path):
    data = jsonl(200)
    halves = data[: len(data) // 2], data[len(data) // 2 :]
    # Two frames, as `zstd` writes concatenated files and parallel compressors write one file.
    frames = [zstandard.ZstdCompressor(level=3).compress(half) for half in halves]
    whole = tmp_path / "two.zst"
    whole.write_bytes(b"".join(frames))
    with open_binary(str(whole)) as fh:
        assert fh.read() == data
    # A frame written by a streaming compressor does not declare its size.
    streamed = zstandard.ZstdCompressor().compressobj()
    (tmp_path / "s.zst").write_bytes(streamed.compress(data) + streamed.flush())
    with open_binary(str(tmp_path / "s.zst")) as fh:
        assert fh.read() == data
    blob = b"".join(frames)
    for end in (1, 6, len(frames[0]) - 1, len(frames[0]) + 3, len(blob) - 1):
        (tmp_path / "cut.zst").write_bytes(blob[:end])
        with (
            pytest.raises(EOFError, match="truncated"),
            open_binary(str(tmp_path / "cut.zst")) as fh,
        ):
            fh.read()


@pytest.mark.parametrize("suffix", [".xz", ".bz2", ".zip"])
def test_compression_no_reader_decompresses_is_refused_not_read_as_bytes(tmp_path, suffix):
    (tmp_path / "a.jsonl").write_bytes(jsonl(5))
    (tmp_path / f"b.jsonl{suffix}").write_bytes(b"\xfd7zXZ\x00 compressed bytes")
    cfg = source_cfg(paths=f"[{tmp_path}/*]", format="jsonl")
    with pytest.raises(UserError) as err:
        expand_paths(cfg)
    assert str(err.value).startswith(
        f"source.paths: {tmp_path}/b.jsonl{suffix} is compressed ({suffix}), which prepare does not "
        "decompress"
    )


def test_prepare_refuses_a_truncated_zst_and_leaves_nothing(truncated, tmp_path):
    """The issue's run: prepare exited 0, having read 274 of 1,387 lines and reported 1 line
    that was not JSON (the last, cut in half)."""
    out = tmp_path / "data"
    args = prepare_args(
        truncated[".zst"],
        out,
        **{"source.format": "jsonl", "tasks": "[causal_lm]", "ray.num_workers": 1},
    )
    run = run_prepare(args, timeout=300)
    assert run.returncode == 2, run.stderr[-3000:]
    errors = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in run.stderr, run.stderr[-3000:]
    assert f"cannot read {truncated['.zst']}: Compressed file ended" in errors[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["web.jsonl.gz", "web.jsonl.zst"]
