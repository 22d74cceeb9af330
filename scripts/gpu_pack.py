"""Build ``.gpu-pack/pack.tar.gz``: what a GPU machine without a package index lacks to run
``scripts/gpu-check`` (run through ``scripts/gpu-pack``; docs/engine.md, "GPU check").

The GPU image has CUDA torch, Python 3.12, aiohttp, numpy, pytest and the rest of tspd's
imports, but not pyzmq, simpy, multiprocessing-logging, gguf, Mooncake, or the system libraries
Mooncake's engine links (libibverbs, librdmacm, ...). The pack holds::

    site/       the wheels (cp312, manylinux x86-64) unpacked: importable from PYTHONPATH;
                of Mooncake's CUDA 13 wheel only the transfer engine (mooncake/engine.so and
                the libraries it links, found by walking ELF NEEDED entries)
    lib/        libibverbs, librdmacm, libmlx5 (and libnl) from Debian .debs: one rdma-core
                set, used together (gpu-check takes them unless the system has its own)
    fallback/   every other library the engine needs that a system may lack (libnuma, libcurl
                and what libcurl links): gpu-check uses one only where the system has none
    MANIFEST.json   sources (name, version, sha256), every file's sha256, the glibc needed

Reproducible: every wheel and .deb is pinned by version and sha256 (a mismatch stops the
build), and the archive is written with sorted entries, zero times and owners (same inputs,
same bytes). Debian drops superseded versions; ``--refresh-debs`` takes the versions it serves
now and prints the pins to paste here.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / ".gpu-pack"
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_26_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64"]  # fmt: skip

#: (distribution, version, sha256 of the wheel)
WHEELS = [
    ("pyzmq", "27.3.0", "858fe25231e0fd8612da142efde019faa5ef63fa150a821a27870e791b38c798"),
    ("simpy", "4.1.2", "43071f84b6512c9b4fcb33ef057f240ccb1d1f3b263f9b4f9229d072e310b372"),
    ("multiprocessing-logging", "0.4.0",
     "0d76dae0f187343d9009aec4cada11e7323ba8189869e11797ddeab3c90dc687"),
    ("gguf", "0.19.0", "70bcd10edfe697fb2dad6e40af2234b9d8ece9a41a99761405121ebda1c3c1cd"),
]  # fmt: skip
#: Mooncake built for CUDA 13 (the GPU image's torch is cu130: libcudart.so.13 is there).
MOONCAKE = ("mooncake-transfer-engine-cuda13", "0.3.14",
            "74fa5f0684b143167503e33f85cccb9ca687d3f9843d4b594dbd5342c7df3e17")  # fmt: skip

#: Debian bookworm (glibc 2.36): (package, version, sha256 of the .deb)
RDMA_DEBS = [
    ("libibverbs1", "44.0-2", "35054815259fee46173240254246d03b673a5cd5c528aaac96fd15ac428a8d59"),
    ("librdmacm1", "44.0-2", "16b18625834371d023b81477823074ea0d34c478d58dbef3f01107984f47d034"),
    ("ibverbs-providers", "44.0-2",
     "3c9907fd96a4ae7effb5faa178bd3648344a521f6bcca2c23c9f2dd214cf1192"),
    ("libnl-3-200", "3.7.0-0.2+b1",
     "d1fc3e9eb8e79b4c96b0a64c3d8c9e068ae2f665cab71bd19f417ffd0453a890"),
    ("libnl-route-3-200", "3.7.0-0.2+b1",
     "0fdcc425ae2982788c085c76a7cb0eda3e3db99d41bd1ce56082ee18e9f1e21f"),
]  # fmt: skip
FALLBACK_DEBS = [
    ("libnuma1", "2.0.16-1", "639e1ab6bd66ead40db8a22c332d7199679fa22db261cac34444eb8eb4c17dda"),
    ("libcurl4", "7.88.1-10+deb12u15",
     "3042904de01f9c4fbdcf1452b8f81abedcf2b015f9b9deba109063322b5bd68b"),
    ("libnghttp2-14", "1.52.0-1+deb12u3",
     "5a5736cee57e51c1baed869979e6ecdbc6495e939e33203d6cfe3b6e5a149e3f"),
    ("libidn2-0", "2.3.3-1+b1", "d50716d5824083d667427817d506b45d3f59dc77e1ca52de000f3f62d4918afa"),
    ("librtmp1", "2.4+20151223.gitfa8646d.1-2+b2",
     "e1f69020dc2c466e421ec6a58406b643be8b5c382abf0f8989011c1d3df91c87"),
    ("libssh2-1", "1.10.0-3+deb12u1",
     "fff72a194e493f88e100a2567e22472bb4ab828d429c2956965c6f2f134f1b3a"),
    ("libpsl5", "0.21.2-1", "4f0d35610204e4e754b057748719744114621f2f6f4202d846c314860a981afb"),
    ("libssl3", "3.0.22-1~deb12u2",
     "cb4784740daa9b3b0eaea2b444bbefa686794afbbf3d678d238c1fd9875f2efd"),
    ("libgssapi-krb5-2", "1.20.1-2+deb12u5",
     "d8b87aea91b956b416c01a28c44ff6228315ae3b73de40acddac3dc5043607d2"),
    ("libldap-2.5-0", "2.5.13+dfsg-5",
     "4b6c30f6554149c594628d945edc6003f0eea8d0cc1341638c0e71375db147ed"),
    ("libzstd1", "1.5.4+dfsg2-5+deb12u1",
     "67dc1ee693e5c22b1a2be2bb70d8244b040836ce3f5dd79e006f7806bc3d9f1c"),
    ("libbrotli1", "1.0.9-2+deb12u1",
     "e27b3d655fa6fadd7a56f706687e94573c0af68b7d6df394a32a381a3a6c6d8b"),
    ("zlib1g", "1:1.2.13.dfsg-1+deb12u1",
     "ad9f1ea0537a32c9eaecc619563a9db596a5dee33afce8393b1083f22d301e1d"),
    ("libunistring2", "1.0-2", "d466bbfe011d764d793c1d9d777cad9c7cf65b938e11598f27408171ad95a951"),
    ("libgnutls30", "3.7.9-2+deb12u7",
     "30abec8c824feb1d2d7e9000a34083cccd19d139625e1b21547e3ac53b922f8e"),
    ("libhogweed6", "3.8.1-2", "ed8185c28b2cb519744a5a462dcd720d3b332c9b88a1d0002eac06dc8550cb94"),
    ("libnettle8", "3.8.1-2", "45922e6e289ffd92f0f92d2bb9159e84236ff202d552a461bf10e5335b3f0261"),
    ("libgmp10", "2:6.2.1+dfsg1-1.1",
     "187aedef2ed763f425c1e523753b9719677633c7eede660401739e9c893482bd"),
    ("libkrb5-3", "1.20.1-2+deb12u5",
     "c90801be09701af221b54dd502a59cb378b7284ff31e480738baca317d2f7653"),
    ("libk5crypto3", "1.20.1-2+deb12u5",
     "7b6e47d15c5c9cdcd456137533d8308aeba608a54cec73b28bd59bfc4b54cf06"),
    ("libcom-err2", "1.47.0-2+b2",
     "a2bac7015e78fbc0c504df3e441f3a22292f1d2d77f9ccda760057f3690e22f2"),
    ("libkrb5support0", "1.20.1-2+deb12u5",
     "8b9c05f2d8d461a10d657b118f572af5bf8fd6c8f93dcef81e852c5ab0f428ab"),
    ("libsasl2-2", "2.1.28+dfsg-10+deb12u1",
     "d6f20408e2be92ebd9f5e3b1c1935b075efb3f03abb5f48f7b991a0ad3e2d6a5"),
    ("libp11-kit0", "0.24.1-2", "251330faddbf013f060fcdb41f4b0c037c8a6e89ba7c09b04bfcc4e3f0807b22"),
    ("libtasn1-6", "4.19.0-2+deb12u1",
     "2c27c613b69be248d09432839ea3d3382f6ee27fabaa65987aa2d884cd00afda"),
    ("libkeyutils1", "1.6.3-2", "cfac89e6a7a54ff3c6a4f843310e25efeddaa771baeae470bd98bd588c373563"),
    ("libffi8", "3.4.4-1", "6d9f6c25c30efccce6d4bceaa48ea86c329a3432abb360a141f76ac223a4c34a"),
]  # fmt: skip

#: Libraries every glibc system, or the GPU image itself, provides: never carried.
SYSTEM = {"libc.so.6", "libm.so.6", "libdl.so.2", "libpthread.so.0", "librt.so.1",
          "libresolv.so.2", "ld-linux-x86-64.so.2", "libstdc++.so.6", "libgcc_s.so.1",
          "libcuda.so.1", "libcudart.so.13"}  # fmt: skip
#: The Mooncake files that are not ELF libraries but belong with the engine.
MOONCAKE_KEEP = ["mooncake/__init__.py", "mooncake/engine.pyi", "mooncake/py.typed"]


class PackError(RuntimeError):
    """The pack cannot be built as pinned (a download, a hash, a missing library)."""


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def run(*argv: str, cwd: Path | None = None) -> str:
    proc = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise PackError(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc.stdout


# ---- downloads -------------------------------------------------------------------------------


def download_wheels(dest: Path) -> dict[str, Path]:
    """Every pinned wheel, hash-checked by pip itself (``--require-hashes``)."""
    pins = dest / "requirements.txt"
    pins.write_text("".join(f"{n}=={v} --hash=sha256:{h}\n" for n, v, h in [*WHEELS, MOONCAKE]))
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    run(sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
        "--python-version", "3.12", "--implementation", "cp", *platforms, "--require-hashes",
        "-r", str(pins), "-d", str(dest))  # fmt: skip
    found: dict[str, Path] = {}
    for name, _, digest in [*WHEELS, MOONCAKE]:
        stem = name.replace("-", "_")
        (path,) = [p for p in dest.glob("*.whl") if p.name.lower().startswith(stem + "-")]
        if sha256(path) != digest:
            raise PackError(f"{path.name}: sha256 differs from the pin")
        found[name] = path
    return found


def download_debs(dest: Path, refresh: bool) -> dict[str, Path]:
    """Every pinned .deb (``apt-get download``), hash-checked; with ``refresh`` the versions
    Debian serves now, their pins printed."""
    debs = [*RDMA_DEBS, *FALLBACK_DEBS]
    specs = [n if refresh else f"{n}={v}" for n, v, _ in debs]
    try:
        run("apt-get", "download", "-qq", *specs, cwd=dest)
    except PackError as exc:
        raise PackError(
            f"{exc}\nDebian may no longer serve a pinned version (run apt-get update first, or "
            "scripts/gpu-pack --refresh-debs to take the current ones and print their pins)"
        ) from exc
    found: dict[str, Path] = {}
    for name, _, digest in debs:
        (path,) = [p for p in dest.glob("*.deb") if p.name.split("_")[0] == name]
        got = sha256(path)
        if refresh:
            served = run("dpkg-deb", "-f", str(path), "Version").strip()
            print(f'    ("{name}", "{served}", "{got}"),')
        elif got != digest:
            raise PackError(f"{path.name}: sha256 {got} differs from the pin {digest}")
        found[name] = path
    return found


# ---- ELF closure -----------------------------------------------------------------------------


def needed(path: Path) -> tuple[list[str], list[str]]:
    """(NEEDED sonames, RPATH/RUNPATH entries) of an ELF file."""
    out = run("readelf", "-d", str(path))
    libs = re.findall(r"\(NEEDED\)\s+Shared library: \[([^]]+)\]", out)
    paths = [p for m in re.findall(r"\((?:RPATH|RUNPATH)\)\s+Library r\w*path: \[([^]]+)\]", out)
             for p in m.split(":")]  # fmt: skip
    return libs, paths


def closure(start: Path, search: list[Path]) -> tuple[dict[str, Path], set[str]]:
    """Every library ``start`` loads, resolved like the dynamic loader would: its RPATH (with
    ``$ORIGIN``), then ``search``. Returns ({soname: file}, unresolved sonames)."""
    found: dict[str, Path] = {}
    missing: set[str] = set()
    todo = [start]
    while todo:
        elf = todo.pop()
        libs, rpath = needed(elf)
        dirs = [Path(p.replace("$ORIGIN", str(elf.parent))) for p in rpath] + search
        for lib in libs:
            if lib in found or lib in SYSTEM:
                continue
            hit = next((d / lib for d in dirs if (d / lib).exists()), None)
            if hit is None:
                missing.add(lib)
                continue
            found[lib] = hit.resolve()
            todo.append(found[lib])
    return found, missing


def glibc_needed(files: list[Path]) -> str:
    """The newest GLIBC_x.y symbol version any of ``files`` asks for."""
    versions = set()
    for f in files:
        versions |= set(re.findall(r"GLIBC_(\d+\.\d+(?:\.\d+)?)", run("readelf", "-V", str(f))))
    newest = max(versions, key=lambda v: tuple(int(x) for x in v.split(".")))
    return newest


# ---- assembling ------------------------------------------------------------------------------


def unpack_wheels(wheels: dict[str, Path], site: Path, scratch: Path) -> list[Path]:
    """Pure and pyzmq wheels whole; of Mooncake the engine and the libraries it links that the
    wheel holds (the rest come from the .debs or the system). Returns the engine's ELF files
    (to check their glibc needs)."""
    for name, _, _ in WHEELS:
        with zipfile.ZipFile(wheels[name]) as z:
            z.extractall(site)
    full = (scratch / "mooncake").resolve()
    with zipfile.ZipFile(wheels[MOONCAKE[0]]) as z:
        z.extractall(full)
        info = [n for n in z.namelist() if ".dist-info/" in n and n.endswith("METADATA")]
    engine = full / "mooncake" / "engine.so"
    libs, _ = closure(engine, [])  # only the wheel's own: the RPATH points into the wheel
    elves = [engine, *libs.values()]
    for src in [*elves, *(full / rel for rel in [*MOONCAKE_KEEP, *info])]:
        dst = site / src.relative_to(full)
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dst)
    return [site / p.relative_to(full) for p in elves]


def add_debs(debs: dict[str, Path], pack: Path, scratch: Path) -> dict[str, str]:
    """Unpack every .deb (dpkg -x into a private root) and copy the libraries the engine's
    closure needs into lib/ (the rdma-core set) or fallback/ (the rest). Returns
    {soname: "lib" or "fallback"}."""
    roots = []
    for name, path in debs.items():
        roots.append(scratch / "debs" / name)
        roots[-1].mkdir(parents=True)
        run("dpkg-deb", "-x", str(path), str(roots[-1]))
    rdma = {n for n, _, _ in RDMA_DEBS}
    subs = ("usr/lib/x86_64-linux-gnu", "lib/x86_64-linux-gnu")
    dirs = [root / sub for root in roots for sub in subs if (root / sub).is_dir()]
    engine = pack / "site" / "mooncake" / "engine.so"
    libs, missing = closure(engine, dirs)
    if missing:
        raise PackError(f"no package provides {sorted(missing)} (add its .deb to the pins)")
    where: dict[str, str] = {}
    for soname, src in libs.items():
        if "/debs/" not in str(src):
            continue  # one of the wheel's own
        owner = src.relative_to((scratch / "debs").resolve()).parts[0]
        kind = "lib" if owner in rdma else "fallback"
        (pack / kind).mkdir(exist_ok=True)
        shutil.copy2(src, pack / kind / soname)
        where[soname] = kind
    return where


def manifest(pack: Path, wheels: dict[str, Path], debs: dict[str, Path], glibc: str,
             where: dict[str, str]) -> None:  # fmt: skip
    files = sorted(p for p in pack.rglob("*") if p.is_file())
    body = {
        "wheels": [{"name": n, "version": v, "sha256": h} for n, v, h in [*WHEELS, MOONCAKE]],
        "debs": [{"name": n, "version": v, "sha256": h}
                 for n, v, h in [*RDMA_DEBS, *FALLBACK_DEBS]],
        "libraries": dict(sorted(where.items())),
        "system_libraries": sorted(SYSTEM),
        "glibc_needed": glibc,
        "files": {str(f.relative_to(pack)): {"bytes": f.stat().st_size, "sha256": sha256(f)}
                  for f in files},
    }  # fmt: skip
    (pack / "MANIFEST.json").write_text(json.dumps(body, indent=1, sort_keys=True) + "\n")


def archive(pack: Path, dest: Path) -> None:
    """A byte-reproducible .tar.gz of ``pack`` (sorted, no times, no owners)."""

    def norm(info: tarfile.TarInfo) -> tarfile.TarInfo:
        info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
        executable = info.isdir() or ".so" in info.name or info.mode & 0o111
        info.mode = 0o755 if executable else 0o644
        return info

    with (
        dest.open("wb") as raw,
        gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as gz,
        tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as tar,
    ):
        for path in sorted(pack.rglob("*")):
            if path.is_symlink():
                raise PackError(f"{path}: a link in the pack (it must hold plain files)")
            tar.add(path, arcname=str(path.relative_to(pack)), recursive=False, filter=norm)


def tree_bytes() -> int:
    """What travels to the GPU machine besides carried paths: tracked and untracked files that
    git does not ignore."""
    listed = run("git", "ls-files", "-z", "--cached", "--others", "--exclude-standard", cwd=ROOT)
    return sum((ROOT / p).stat().st_size for p in listed.split("\0") if p and (ROOT / p).is_file())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--refresh-debs",
        action="store_true",
        help="take the .deb versions Debian serves now and print their pins",
    )
    opts = parser.parse_args()
    OUT.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="gpu-pack-") as tmp:
        scratch = Path(tmp)
        (scratch / "dl").mkdir()
        (scratch / "deb").mkdir()
        print("gpu-pack: downloading the pinned wheels ...", flush=True)
        wheels = download_wheels(scratch / "dl")
        print("gpu-pack: downloading the pinned .debs ...", flush=True)
        debs = download_debs(scratch / "deb", opts.refresh_debs)
        pack = scratch / "pack"
        elves = unpack_wheels(wheels, pack / "site", scratch)
        where = add_debs(debs, pack, scratch)
        elves += [pack / kind / so for so, kind in where.items()]
        manifest(pack, wheels, debs, glibc_needed(elves), where)
        target = OUT / "pack.tar.gz"
        archive(pack, target)
        shutil.rmtree(OUT / "root", ignore_errors=True)
        shutil.copytree(pack, OUT / "root")  # the same files, unpacked, for a look here
    unpacked = sum(p.stat().st_size for p in (OUT / "root").rglob("*") if p.is_file())
    tree, size = tree_bytes(), target.stat().st_size
    print(f"gpu-pack: {target.relative_to(ROOT)}: {size / 2**20:.1f} MiB "
          f"({unpacked / 2**20:.1f} MiB unpacked), sha256 {sha256(target)}")  # fmt: skip
    print(f"gpu-pack: the tree that travels: {tree / 2**20:.1f} MiB + the pack = "
          f"{(tree + size) / 2**20:.1f} MiB of the 64 MiB allowed")  # fmt: skip
    print(f"gpu-pack: libraries: {json.dumps(where, sort_keys=True)}")
    if tree + size > 64 * 2**20:
        raise PackError("the tree and the pack exceed 64 MiB: the GPU machine would refuse them")
    return 0


if __name__ == "__main__":
    try:
        raise SystemExit(main())
    except PackError as exc:
        print(f"gpu-pack: {exc}", file=sys.stderr)
        raise SystemExit(1) from None
