"""The offline GPU check's bundle (docs/gpu.md), made where PyPI is reachable (`make gpu-bundle`).

    python benchmarks/gpu_bundle.py wheelhouse PYTHON_VERSION GLIBC "SKIP ..." OUT
    python benchmarks/gpu_bundle.py corpus CHARACTERS OUT.txt

wheelhouse: wheels, for the node's Python on manylinux x86_64, of the closure of this project's
runtime requirements (and pytest) at the versions installed here, less torch and its CUDA stack
(the node's own torch is used), less ray (the data is prepared here) and the packages named in
SKIP; sdist-only packages are built into wheels here (deepspeed with DS_BUILD_OPS=0: no ops
prebuilt, they JIT on first use). Writes requirements.txt (what benchmarks/gpu_check.sh installs)
and bundle.txt (what it was built for) beside them.
corpus: this Python's standard library sources (tests left out) in path order, as text whose
paragraphs are the documents, up to CHARACTERS characters: the text of the bundle's dataset.
"""

from __future__ import annotations

import fnmatch
import os
import re
import subprocess
import sys
import sysconfig
import time
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename


def wheelhouse(argv: list[str]) -> None:
    pyver, glibc, skip_arg, out = argv[0], argv[1], argv[2], Path(argv[3])
    never = ["torch", "triton", "nvidia-*", "ray", "pretrain-pipeline"]
    skip = never + [canonicalize_name(n) for n in skip_arg.split()]
    env = {
        "python_version": pyver,
        "python_full_version": pyver + ".0",
        "sys_platform": "linux",
        "platform_system": "Linux",
        "platform_machine": "x86_64",
        "os_name": "posix",
        "implementation_name": "cpython",
        "platform_python_implementation": "CPython",
    }

    def wanted(req, extras=("",)):
        return req.marker is None or any(req.marker.evaluate({**env, "extra": e}) for e in extras)

    def skipped(name):
        return any(fnmatch.fnmatch(canonicalize_name(name), pattern) for pattern in skip)

    project = [Requirement(r) for r in metadata.requires("pretrain-pipeline")]
    roots = [r for r in project if wanted(r) and not skipped(r.name)]
    roots += [r for r in project if canonicalize_name(r.name) == "pytest" and wanted(r, ("dev",))]
    # transformers (and the tokenizers library it brings) for a dataset of a Hugging Face
    # tokenizer and for ours-against-HF on the GPU; lm-eval, the rest of the hf extra, stays out.
    roots += [
        r for r in project if canonicalize_name(r.name) == "transformers" and wanted(r, ("hf",))
    ]
    pins, extras_seen, todo, unpinned = {}, {}, [(r, set(r.extras)) for r in roots], {}
    while todo:
        req, extras = todo.pop()
        name = canonicalize_name(req.name)
        if skipped(name) or (name in extras_seen and extras <= extras_seen[name]):
            continue
        extras_seen.setdefault(name, set()).update(extras)
        try:
            dist = metadata.distribution(name)
        # needed on the node's Python only: the newest that fits
        except metadata.PackageNotFoundError:
            unpinned[name] = str(req.specifier)
            continue
        pins[name] = dist.version
        for line in dist.requires or []:
            sub = Requirement(line)
            if wanted(sub, sorted(extras_seen[name]) or [""]):
                todo.append((sub, set(sub.extras)))

    out.mkdir(parents=True)
    tag = "cp" + pyver.replace(".", "")
    major, minor = (int(x) for x in glibc.split("."))
    platforms = [f"manylinux_{major}_{m}_x86_64" for m in range(minor, 4, -1)]
    platforms += ["manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64"]
    download = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--python-version",
        pyver,
        "--implementation",
        "cp",
        "--abi",
        tag,
        "--abi",
        "abi3",
        "--abi",
        "none",
        "-d",
        str(out),
    ]
    for platform in platforms:
        download += ["--platform", platform]
    binary = {n: f"{n}=={v}" for n, v in pins.items()}
    binary.update({n: n + spec for n, spec in unpinned.items()})
    sdist_only = {}
    # pip names the first requirement it finds no wheel for: build that one from its sdist
    while binary:
        listing = out / "download.txt"
        listing.write_text("\n".join(sorted(binary.values())) + "\n")
        run = subprocess.run([*download, "-r", str(listing)], capture_output=True, text=True)
        listing.unlink()
        if run.returncode == 0:
            break
        found = re.search(r"satisfies the requirement ([A-Za-z0-9_.-]+)", run.stderr)
        if not found or canonicalize_name(found.group(1)) not in binary:
            sys.exit("pip download failed:\n" + run.stderr[-3000:])
        name = canonicalize_name(found.group(1))
        sdist_only[name] = binary.pop(name)
        print(
            f"{name}: no wheel for CPython {pyver} on manylinux x86_64; building one from its sdist",
            flush=True,
        )
    for name, spec in sorted(sdist_only.items()):
        # deepspeed: built against .venv's torch with no ops prebuilt (they JIT on the node), so its
        # wheel is pure Python; other sdists are built in pip's usual isolated environment
        isolation = ["--no-build-isolation"] if name == "deepspeed" else []
        build_env = {**os.environ, "DS_BUILD_OPS": "0"}
        before = set(out.iterdir())
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "wheel",
                "-q",
                "--no-deps",
                "--no-cache-dir",
                "--no-binary",
                name,
                *isolation,
                "-w",
                str(out),
                spec,
            ],
            check=True,
            env=build_env,
        )
        for wheel in set(out.iterdir()) - before:
            tags = parse_wheel_filename(wheel.name)[3]
            if not any(
                t.interpreter.startswith("py3") and t.abi == "none" and t.platform == "any"
                for t in tags
            ):
                sys.exit(
                    f"{wheel.name}: built for this Python only, not a pure-Python wheel the node can use"
                )
    wheels = sorted(out.glob("*.whl"))
    names = {canonicalize_name(parse_wheel_filename(w.name)[0]) for w in wheels}
    missing = sorted((set(pins) | set(unpinned)) - names)
    if missing:
        sys.exit(f"no wheel for: {', '.join(missing)}")
    top = sorted(str(Requirement(str(r).split(";")[0])) for r in roots)
    (out / "requirements.txt").write_text(
        "# What benchmarks/gpu_check.sh installs from this folder: this project's requirements less torch,\n"
        f"# ray and {skip_arg}. Made by `make gpu-wheelhouse` from .venv's versions.\n"
        + "\n".join(top)
        + "\n"
    )
    size = sum(w.stat().st_size for w in wheels)
    (out / "bundle.txt").write_text(
        f"python={pyver}\nglibc={glibc}\nskipped={skip_arg}\nwheels={len(wheels)}\nmib={size / 2**20:.1f}\n"
        f"built={time.strftime('%Y-%m-%d %H:%M:%S %z')}\nsdist_built={' '.join(sorted(sdist_only))}\n"
    )
    print(
        f"{out}: {len(wheels)} wheels, {size / 2**20:.1f} MiB, for CPython {pyver} manylinux_{glibc.replace('.', '_')} x86_64; "
        f"largest: "
        + ", ".join(
            f"{w.name.split('-')[0]} {w.stat().st_size / 2**20:.1f}"
            for w in sorted(wheels, key=lambda w: -w.stat().st_size)[:5]
        )
        + " MiB"
    )


def corpus(argv: list[str]) -> None:
    limit, out = int(argv[0]), Path(argv[1])
    stdlib, n = Path(sysconfig.get_paths()["stdlib"]), 0
    with out.open("w", encoding="utf-8") as fh:
        for path in sorted(stdlib.rglob("*.py")):
            parts = path.relative_to(stdlib).parts
            if {"test", "tests", "site-packages", "idlelib"} & set(parts):
                continue
            try:
                text = path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError):
                continue
            fh.write(text + "\n\n")
            n += len(text)
            if n >= limit:
                break
    print(f"{out}: {n:,} characters of {stdlib}")


if __name__ == "__main__":
    command, *rest = sys.argv[1:] or ["--help"]
    if command not in ("wheelhouse", "corpus"):
        sys.exit(__doc__)
    {"wheelhouse": wheelhouse, "corpus": corpus}[command](rest)
