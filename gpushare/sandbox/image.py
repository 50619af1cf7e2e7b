"""The gpushare container image, built here from Debian's packages: no registry, no base image, no docker.

``mmdebstrap`` assembles a Debian root filesystem with Python; a customize hook installs the project's
wheel and its dependencies (manylinux wheels for that Python) into a venv at ``/opt/gpushare``, and the
kube-scheduler that build_kube.sh built into ``/usr/local/bin`` (:data:`KUBE_BINARIES`); :func:`pack`
writes the tar as a one-layer OCI image archive that ``ctr images import`` loads under the name that
deploy/*.yaml give (:data:`IMAGE`). The archive is cached by a hash of every input (:class:`Inputs`) in a
directory beside the Kubernetes binaries, so an unchanged tree costs a package resolution and a wheel
resolution, not a build. The same inputs give a bit-identical archive (a fixed ``SOURCE_DATE_EPOCH``).
Each checkout records the archive its own sources gave in ``build/gpushare.oci.tar`` (a link into the
cache), so checkouts sharing the cache each test their own image; the cache keeps the
:data:`KEEP` archives used last.

kube-scheduler is what the chart's own scheduler Deployment runs (``gpushare kube-scheduler`` execs it), the
same build the tests' clusters run. It goes into this image rather than one of its own: the launcher
needs this image's Python anyway, so a second image would repeat its ~90 MB base to save the ~20 MB
(zstd) the binary adds here, and would be a second archive to build, cache and import on every node.

The project's source is the working tree as ``git add -A`` would record it: the tracked files with their
changes and the untracked ones git doesn't ignore, which is what the checkout's editable install runs (a new
module included). It is exported to a temporary directory and built there, so nothing is written into the
checkout, its index included.

    python3 -m gpushare.sandbox.image [--key]    (as root; prints the archive's path, or only the key)
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import importlib.util
import io
import json
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import tomllib
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from gpushare.process import Terminated, end_group, signals_raise
from gpushare.sandbox import binaries
from gpushare.sandbox.containerd import GO_ARCH

ROOT = Path(__file__).resolve().parents[2]
#: the name deploy/*.yaml give the image, and the one it is imported under
IMAGE = f"gpushare:{importlib.metadata.version('gpushare')}"
#: Debian release, and the Python it ships (the dependency wheels are chosen for it)
SUITE = "bookworm"
PYTHON_VERSION = "3.11"
#: bookworm's glibc is 2.36: any manylinux wheel from 2.17 (manylinux2014) to it fits
GLIBC_MINORS = range(17, 37)
VENV = "/opt/gpushare"
#: Kubernetes binaries from build_kube.sh's cache put in the image, at /usr/local/bin/<name>
KUBE_BINARIES = ("kube-scheduler",)
#: every file's time in the image (2025-05-20): rebuilding the same inputs gives the same bytes
SOURCE_DATE_EPOCH = 1747699200
#: the host's apt sources, used when they are for SUITE: they carry its updates and security suites
HOST_SOURCES = Path("/etc/apt/sources.list.d/debian.sources")
ARCHIVE_NAME = "gpushare.oci.tar"
#: this checkout's record of its archive: a link into the cache, not a cache-wide "latest" that would
#: follow whichever checkout built last
RECORD = ROOT / "build" / ARCHIVE_NAME
#: archives the cache keeps, the most recently built or found first: one per checkout sharing it
KEEP = 3
ZSTD_LEVEL = 3


class ImageError(RuntimeError):
    """The image could not be built: says which step failed and its output's tail."""


def containerd_name(ref: str) -> str:
    """The name containerd's CRI looks ``ref`` up under (``gpushare:0.1.0`` is
    ``docker.io/library/gpushare:0.1.0``), so the imported image is the one kubelet asks for."""
    first, _, rest = ref.partition("/")
    if rest and ("." in first or ":" in first or first == "localhost"):
        return ref
    return f"docker.io/{ref if rest else 'library/' + ref}"


def cache_dir() -> Path:
    """Beside the Kubernetes binaries' cache (``$GPUSHARE_KUBE_BIN`` moves both)."""
    return binaries.bin_dir().parent / "image"


def built(record: Path = RECORD) -> Path:
    """The archive this checkout's last build made or found (which may not exist: see :func:`missing`)."""
    return record.resolve()


def missing(record: Path = RECORD) -> str | None:
    """None when this checkout's image is in the cache, else one line saying what is missing and how to build it."""
    how = f"./install.sh builds it as root: python3 -m {__name__}"
    if built(record).is_file():
        return None
    if record.is_symlink():
        return f"{built(record)}, the image this checkout built, is gone from the cache ({how})"
    return f"the gpushare image is not built for this checkout: no {record} ({how})"


def keep(archive: Path, record: Path = RECORD, newest: int = KEEP) -> None:
    """Point ``record`` at ``archive``, mark it used, and remove the cache's archives beyond the ``newest``
    used last (never ``archive``)."""
    os.utime(archive)
    record.parent.mkdir(parents=True, exist_ok=True)
    partial = record.with_name(f"{record.name}.{os.getpid()}")
    partial.unlink(missing_ok=True)
    partial.symlink_to(archive)
    partial.rename(record)  # atomic: a reader sees the old archive or the new one
    cache = archive.parent
    for link in cache.glob("*.oci.tar"):
        if link.is_symlink():  # the cache holds archives only (a shared link would follow the last build)
            link.unlink()
    archives = sorted(cache.glob("*.oci.tar"), key=lambda path: path.stat().st_mtime, reverse=True)
    for old in archives[newest:]:
        if old != archive:
            old.unlink(missing_ok=True)


# --- the inputs and their hash ------------------------------------------------------------------------------


def mmdebstrap_args(work: Path) -> list[str]:
    """mmdebstrap's options, before the suite; ``work`` holds the wheels, pip and the Kubernetes binaries (``bin/``)
    that the hook installs from."""
    excludes = [f"--dpkgopt=path-exclude=/usr/share/{d}/*" for d in ("man", "locale", "doc")]
    includes = [f"--dpkgopt=path-include=/usr/share/{p}" for p in ("locale/locale.alias", "doc/*/copyright")]
    install = (
        f'set -e; mkdir "$1/tmp/wheels" "$1/tmp/pipboot"; cp {work}/wheels/*.whl "$1/tmp/wheels/";'
        f' cp -r {work}/pip "$1/tmp/pipboot/pip"; chroot "$1" python3 -m venv --without-pip {VENV};'
        f' chroot "$1" env PYTHONPATH=/tmp/pipboot SOURCE_DATE_EPOCH={SOURCE_DATE_EPOCH} {VENV}/bin/python -m pip'
        " install -q --no-index --find-links /tmp/wheels --no-cache-dir --disable-pip-version-check gpushare;"
        ' rm -rf "$1/tmp/wheels" "$1/tmp/pipboot";'
        f' chroot "$1" env PYTHONDONTWRITEBYTECODE=1 {VENV}/bin/gpushare --help >/dev/null'
    )
    # each one owned by root, executable by the pods' non-root users
    kube = "".join(f'; install -m 0755 {work}/bin/{name} "$1/usr/local/bin/{name}"' for name in KUBE_BINARIES)
    return [
        "--variant=essential",
        "--include=python3,libstdc++6",  # grpc needs libstdc++
        "--mode=unshare",  # its mounts go with its namespace, however it ends
        *excludes,
        *includes,
        "--skip=output/dev",  # the runtime mounts /dev
        # not the build host's
        '--customize-hook=echo localhost > "$1/etc/hostname"; : > "$1/etc/resolv.conf"',
        f"--customize-hook={install}{kube}",
    ]


def mirror() -> list[str]:
    """The host's sources when they are for SUITE, else mmdebstrap's default (which adds updates and
    security for a stable suite; a bare mirror URL would not)."""
    with contextlib.suppress(OSError):
        if SUITE in HOST_SOURCES.read_text():
            return [str(HOST_SOURCES)]
    return []


@dataclass(frozen=True)
class Inputs:
    """Everything the image's bytes depend on."""

    #: apt's resolved packages, ``Inst name (version ...)`` lines
    packages: tuple[str, ...]
    #: (file name, sha256) of each dependency wheel pip resolved
    wheels: tuple[tuple[str, str], ...]
    #: git's tree id of the project's source
    source_tree: str
    #: the pip that installs the wheels into the image
    pip_version: str
    #: (name, sha256) of each of :data:`KUBE_BINARIES`
    kube_binaries: tuple[tuple[str, str], ...]
    #: this module's text: the mmdebstrap options, the hook and the packer
    recipe: str


def cache_key(inputs: Inputs) -> str:
    return hashlib.sha256(json.dumps(asdict(inputs), sort_keys=True).encode()).hexdigest()[:16]


def inst_lines(simulate_output: str) -> tuple[str, ...]:
    """The ``Inst`` lines of apt's simulated install, sorted and without repeats."""
    return tuple(sorted({line.strip() for line in simulate_output.splitlines() if line.startswith("Inst ")}))


def pip_platform_args() -> list[str]:
    machine = platform.machine()
    return [
        "--only-binary=:all:",
        f"--python-version={PYTHON_VERSION}",
        "--implementation=cp",
        f"--platform=manylinux2014_{machine}",
        *(f"--platform=manylinux_2_{minor}_{machine}" for minor in GLIBC_MINORS),
    ]


# --- the OCI archive ---------------------------------------------------------------------------------------


def _json(obj: object) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def _descriptor(media_type: str, data: bytes) -> dict[str, object]:
    return {"mediaType": media_type, "digest": "sha256:" + hashlib.sha256(data).hexdigest(), "size": len(data)}


def oci_documents(
    ref: str, layer: dict[str, object], diff_id: str, arch: str, epoch: int
) -> tuple[bytes, bytes, bytes]:
    """The image config, manifest and index (in that order) of a one-layer image named ``ref``.

    ``layer`` is the compressed layer's descriptor, ``diff_id`` the sha256 of its uncompressed tar."""
    created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(epoch))
    path = f"PATH={VENV}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    config = _json(
        {
            "architecture": arch,
            "os": "linux",
            "created": created,
            "config": {"Env": [path, "PYTHONDONTWRITEBYTECODE=1"], "Cmd": ["gpushare", "--help"], "WorkingDir": "/"},
            "rootfs": {"type": "layers", "diff_ids": [diff_id]},
            "history": [{"created": created, "created_by": f"{__name__}: mmdebstrap {SUITE} + pip"}],
        }
    )
    manifest = _json(
        {
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": _descriptor("application/vnd.oci.image.config.v1+json", config),
            "layers": [layer],
        }
    )
    name = containerd_name(ref)
    index = _json(
        {
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.index.v1+json",
            "manifests": [
                {
                    **_descriptor("application/vnd.oci.image.manifest.v1+json", manifest),
                    "platform": {"architecture": arch, "os": "linux"},
                    "annotations": {
                        "io.containerd.image.name": name,
                        "org.opencontainers.image.ref.name": name.rpartition(":")[2],
                    },
                }
            ],
        }
    )
    return config, manifest, index


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def pack(rootfs_tar: Path, out: Path, ref: str = IMAGE, epoch: int = SOURCE_DATE_EPOCH) -> None:
    """Write ``rootfs_tar`` as a one-layer, zstd-compressed OCI image-layout archive named ``ref``.

    Written here rather than with umoci and skopeo: those are two more packages (and their
    dependencies) for what is a compressed layer, three small JSON documents and a tar, and umoci
    stamps the current time where this takes ``epoch``, which keeps rebuilds bit-identical."""
    layer_file = out.with_name(out.name + ".layer")
    try:
        subprocess.run(
            ["zstd", "-q", "-T0", f"-{ZSTD_LEVEL}", "-f", "-o", str(layer_file), str(rootfs_tar)], check=True
        )
        layer = {
            "mediaType": "application/vnd.oci.image.layer.v1.tar+zstd",
            "digest": "sha256:" + _sha256_file(layer_file),
            "size": layer_file.stat().st_size,
        }
        arch = GO_ARCH.get(platform.machine(), platform.machine())
        config, manifest, index = oci_documents(ref, layer, "sha256:" + _sha256_file(rootfs_tar), arch, epoch)
        blobs: list[tuple[str, bytes | Path]] = [(str(layer["digest"]), layer_file)]
        blobs += [("sha256:" + hashlib.sha256(doc).hexdigest(), doc) for doc in (config, manifest)]
        with tarfile.open(out, "w", format=tarfile.PAX_FORMAT) as tar:
            for name, content in [("oci-layout", _json({"imageLayoutVersion": "1.0.0"})), ("index.json", index)]:
                _add(tar, name, content, epoch)
            for directory in ("blobs", "blobs/sha256"):
                _add(tar, directory, None, epoch)
            for digest, content in sorted(blobs, key=lambda blob: blob[0]):
                _add(tar, "blobs/sha256/" + digest.removeprefix("sha256:"), content, epoch)
    finally:
        layer_file.unlink(missing_ok=True)


def _add(tar: tarfile.TarFile, name: str, content: bytes | Path | None, epoch: int) -> None:
    """One member, owned by root with time ``epoch``: a directory (None), bytes or a file's contents."""
    info = tarfile.TarInfo(name)
    info.mtime = epoch
    if content is None:
        info.type, info.mode = tarfile.DIRTYPE, 0o755
        tar.addfile(info)
    elif isinstance(content, bytes):
        info.size, info.mode = len(content), 0o644
        tar.addfile(info, io.BytesIO(content))
    else:
        info.size, info.mode = content.stat().st_size, 0o644
        with content.open("rb") as f:
            tar.addfile(info, f)


# --- the build ----------------------------------------------------------------------------------------------


def _run(step: str, command: Sequence[str], **kwargs: object) -> str:
    """Run ``command`` in a process group of its own and return its stdout; the group is ended however
    this returns (mmdebstrap's apt and dpkg outlive a killed parent otherwise)."""
    proc = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
        **kwargs,  # type: ignore[call-overload]
    )
    try:
        output, _ = proc.communicate()
    finally:
        if proc.poll() is None:
            end_group(proc, 30)
    if proc.returncode != 0:
        tail = "\n".join(output.splitlines()[-20:])
        raise ImageError(f"{step} failed (exit {proc.returncode}):\n{tail}")
    return output


def source_commit(root: Path = ROOT) -> str:
    """A commit of ``root``'s working tree as ``git add -A`` would record it, built in a temporary index
    (started from HEAD's, so force-added files stay) and dated :data:`SOURCE_DATE_EPOCH`: the same files
    give the same commit, and ``git archive`` of it the same bytes."""
    git = ["git", "-C", str(root)]
    date = f"@{SOURCE_DATE_EPOCH} +0000"
    with tempfile.TemporaryDirectory(prefix="gpushare-index.") as tmp:
        env = {
            **os.environ,
            "GIT_INDEX_FILE": str(Path(tmp) / "index"),
            **{f"GIT_{who}_{what}": value for who in ("AUTHOR", "COMMITTER")
               for what, value in (("NAME", "gpushare image"), ("EMAIL", "image@gpushare"), ("DATE", date))},
        }  # fmt: skip
        _run("git read-tree", [*git, "read-tree", "HEAD"], env=env)
        _run("git add", [*git, "add", "-A"], env=env)
        tree = _run("git write-tree", [*git, "write-tree"], env=env).strip()
        return _run("git commit-tree", [*git, "commit-tree", tree, "-m", "gpushare image source"], env=env).strip()


def gather(work: Path) -> tuple[Inputs, str]:
    """Resolve the inputs (apt's packages, pip's wheels into ``work/wheels``) and return them with the
    source commit."""
    commit = source_commit()
    tree = _run("git rev-parse", ["git", "-C", str(ROOT), "rev-parse", f"{commit}^{{tree}}"]).strip()
    pyproject = tomllib.loads(_run("git show", ["git", "-C", str(ROOT), "show", f"{commit}:pyproject.toml"]))
    simulate = [*mmdebstrap_args(work), "--verbose", "--simulate", SUITE, "/dev/null", *mirror()]
    packages = inst_lines(_run("mmdebstrap --simulate", ["mmdebstrap", *simulate]))
    wheels = work / "wheels"
    download = [sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check", *pip_platform_args()]
    _run("pip download", [*download, "-d", str(wheels), *pyproject["project"]["dependencies"]])
    hashes = tuple((w.name, _sha256_file(w)) for w in sorted(wheels.glob("*.whl")))
    if absent := binaries.missing(KUBE_BINARIES):
        raise ImageError(f"the image holds {', '.join(KUBE_BINARIES)}: {absent}")
    (work / "bin").mkdir()
    kube = []
    for name in KUBE_BINARIES:
        shutil.copyfile(binaries.built(name), work / "bin" / name)  # what is hashed is what is installed
        kube.append((name, _sha256_file(work / "bin" / name)))
    pip = importlib.metadata.version("pip")
    inputs = Inputs(packages, hashes, tree, pip, tuple(kube), Path(__file__).read_text())
    return inputs, commit


def build_rootfs(work: Path, commit: str, out: Path) -> None:
    """The project's wheel from an export of ``commit``, then the root filesystem as a tar at ``out``."""
    source = work / "source"
    _run("git archive", ["git", "-C", str(ROOT), "archive", "--prefix=source/", "-o", str(work / "source.tar"), commit])
    with tarfile.open(work / "source.tar") as tar:
        tar.extractall(work, filter="data")
    env = {**os.environ, "SOURCE_DATE_EPOCH": str(SOURCE_DATE_EPOCH)}
    wheel = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--disable-pip-version-check"]
    _run("pip wheel", [*wheel, "-w", str(work / "wheels"), str(source)], env=env)
    pip = importlib.util.find_spec("pip")
    if pip is None or pip.origin is None:
        raise ImageError(f"{sys.executable} has no pip to install the wheels into the image with")
    shutil.copytree(Path(pip.origin).parent, work / "pip", ignore=shutil.ignore_patterns("__pycache__"))
    # the hook reads them from inside mmdebstrap's user namespace, where this process's uid is nobody
    for path in [work, *work.rglob("*")]:
        path.chmod(path.stat().st_mode | 0o055 if path.is_dir() else path.stat().st_mode | 0o044)
    env["TMPDIR"] = str(work)  # mmdebstrap's own temporary directory goes with ours
    _run("mmdebstrap", ["mmdebstrap", *mmdebstrap_args(work), SUITE, str(out), *mirror()], env=env)


def ensure_built(log: Callable[[str], None] = print) -> Path:
    """The archive for the current inputs: from the cache, else built; recorded for this checkout (see :func:`keep`)."""
    cache = cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="gpushare-image.", dir="/var/tmp") as tmp:
        work = Path(tmp)
        start = time.monotonic()
        inputs, commit = gather(work)
        key = cache_key(inputs)
        archive = cache / f"{key}.oci.tar"
        resolved = f"{len(inputs.packages)} packages, {len(inputs.wheels)} wheels"
        log(f"image: key {key} ({resolved}) in {time.monotonic() - start:.1f} s")
        if archive.is_file():
            log(f"image: cached {archive}")
        else:
            build_rootfs(work, commit, work / "rootfs.tar")
            partial = cache / f"{key}.oci.tar.{os.getpid()}.partial"  # another checkout may build it too
            try:
                pack(work / "rootfs.tar", partial)
                partial.rename(archive)
            finally:
                partial.unlink(missing_ok=True)
            log(f"image: built {archive} in {time.monotonic() - start:.0f} s")
    keep(archive)
    log(f"image: {IMAGE} is {archive.stat().st_size / 1e6:.0f} MB ({RECORD} links to it)")
    return archive


def main(argv: Sequence[str] = ()) -> int:
    if os.geteuid() != 0:
        print("image: mmdebstrap's chroot needs root", file=sys.stderr)
        return 1
    try:
        with signals_raise():  # so that the temporary directory and the children go too
            return _build(argv)
    except Terminated as stop:
        return 128 + stop.signum


def _build(argv: Sequence[str]) -> int:
    try:
        if "--key" in argv:
            with tempfile.TemporaryDirectory(prefix="gpushare-image.", dir="/var/tmp") as tmp:
                print(cache_key(gather(Path(tmp))[0]))
        else:
            ensure_built()
    except (ImageError, OSError) as e:
        print(f"image: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
