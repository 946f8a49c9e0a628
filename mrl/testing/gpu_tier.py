"""The GPU tier's runner: `tests/gpu` on a bare GPU machine (a CUDA torch, no network, no Ray, vLLM or TE).

Data flow:
    here   make gpu-wheelhouse: the pins of requirements/gpu-tier.txt -> .gpu-wheels/*.whl (CPython 3.12, manylinux
           x86_64; `download` rows from the registry, `build` rows built from their source release, `slim` rows
           downloaded and then cut down: `slim_wheel` drops the parts named in `SLIM`, under the same file name).
           It prints the wheelhouse's size beside the project's: both travel to the GPU machine (64 MiB there, in
           all).
    there  python3 -m mrl.testing.gpu_tier run [--wheels .gpu-wheels] [--report FILE]
           1. torch must import and see a CUDA device, else one line ("GPU tier: skipped: ...") and exit 0;
           2. each pinned package that this Python lacks, or holds in a version outside the row's accepted
              range, is installed from the wheelhouse into a scratch folder (pip --no-index --no-deps --target)
              that goes first on PYTHONPATH; packages already there in range stay (the machine's torch always);
           3. pytest tests/gpu in a child process; tests/gpu/conftest.py writes every test's outcome and every
              figure the tests record, with the versions and the device, to the JSON report.
Only the standard library is imported before step 2 (and `packaging`, which pip itself vendors).
"""

from __future__ import annotations

import argparse
import importlib.metadata as metadata
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PINS = ROOT / "requirements" / "gpu-tier.txt"
WHEELS = ROOT / ".gpu-wheels"
REPORT_ENV = "MRL_GPU_REPORT"
PLATFORMS = [
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_24_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
]
TRAVEL_LIMIT_MB = 64
#: How a row's wheel is made (requirements/gpu-tier.txt's header says what each means).
SOURCES = ("download", "build", "slim", "machine")
#: What the wheel of a `slim` row loses (path prefixes inside the wheel), so that the wheelhouse and the project fit
#: the TRAVEL_LIMIT_MB a GPU machine is sent. Ray 2.60's wheel is 75.2 MiB: mrl runs Ray Core alone (actors,
#: placement groups; a local instance without the dashboard, mrl/distributed/cluster.py), so the Java workers' jar
#: (30.7 MiB), the dashboard's browser build (2.4) and Ray's AI libraries, which Ray Core never imports (4.5), go;
#: 37.6 MiB stay, most of them the raylet, the GCS server and _raylet.so.
SLIM = {
    "ray": (
        "ray/jars/",
        "ray/dashboard/client/build/",
        "ray/rllib/",
        "ray/data/",
        "ray/serve/",
        "ray/tune/",
        "ray/train/",
        "ray/llm/",
    )
}


@dataclass(frozen=True)
class Pin:
    name: str
    version: str
    accepted: str
    source: str  # download | build | slim | machine (the GPU machine's own, never carried: torch)

    @property
    def requirement(self) -> str:
        return f"{self.name}=={self.version}"


def read_pins(path: Path = PINS) -> list[Pin]:
    pins = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        fields = line.split()
        if len(fields) != 3 or "==" not in fields[0] or fields[2] not in SOURCES:
            raise ValueError(f"{path}:{number}: {line!r}: expected 'name==version accepted {'|'.join(SOURCES)}'")
        name, version = fields[0].split("==")
        if fields[2] == "slim" and name not in SLIM:
            raise ValueError(
                f"{path}:{number}: {line!r}: a slim row needs its cuts in SLIM ({__name__}), which "
                f"names {', '.join(SLIM)} only"
            )
        pins.append(Pin(name, version, fields[1], fields[2]))
    return pins


def _specifier(accepted: str):
    try:
        from packaging.specifiers import SpecifierSet
    except ImportError:  # pragma: no cover - pip vendors it
        from pip._vendor.packaging.specifiers import SpecifierSet  # type: ignore[assignment]  # pip's vendored copy
    return SpecifierSet(accepted)


def missing(pins: list[Pin]) -> list[tuple[Pin, str | None]]:
    """The carried pins this Python lacks or holds outside the accepted range, with the version it holds."""
    out = []
    for pin in pins:
        if pin.source == "machine":
            continue
        try:
            have = metadata.version(pin.name)
        except metadata.PackageNotFoundError:
            have = None
        if have is None or not _specifier(pin.accepted).contains(have, prereleases=True):
            out.append((pin, have))
    return out


def build_wheelhouse(out: Path, python_version: str = "3.12") -> None:
    """Download (or build) the wheel of every carried pin into `out`; print the sizes that will travel."""
    out.mkdir(parents=True, exist_ok=True)
    pins = read_pins()
    downloads = [p.requirement for p in pins if p.source in ("download", "slim")]
    builds = [p.requirement for p in pins if p.source == "build"]
    platform_args = [arg for plat in PLATFORMS for arg in ("--platform", plat)]
    impl = ["--python-version", python_version, "--implementation", "cp", "--only-binary=:all:"]
    pip = [sys.executable, "-m", "pip"]
    subprocess.run([*pip, "download", "-q", "--no-deps", *impl, *platform_args, "-d", str(out), *downloads], check=True)
    if builds:  # pure-Python source releases: the wheel is the same for every platform
        subprocess.run([*pip, "wheel", "-q", "--no-deps", "-w", str(out), *builds], check=True)
    for pin in (p for p in pins if p.source == "slim"):
        wheel = wheel_file(pin, out)
        if wheel is None:
            raise SystemExit(f"pip downloaded no wheel of {pin.requirement} into {out}")
        before = wheel.stat().st_size
        dropped = slim_wheel(wheel, SLIM[pin.name])  # pip fetched it whole: the slim file fails its hash
        print(
            f"[mrl] {wheel.name}: {before / 2**20:.1f} -> {wheel.stat().st_size / 2**20:.1f} MiB "
            f"({dropped} files cut: {', '.join(SLIM[pin.name])})"
        )
    wheels_mb = sum(f.stat().st_size for f in out.glob("*.whl")) / 2**20
    project_mb = _tracked_mb()
    print(
        f"[mrl] GPU tier wheelhouse: {len(list(out.glob('*.whl')))} wheels, {wheels_mb:.1f} MiB in {out} "
        f"(+ {project_mb:.1f} MiB of the project's files = {wheels_mb + project_mb:.1f} of the "
        f"{TRAVEL_LIMIT_MB} MiB a GPU machine is sent)"
    )
    if wheels_mb + project_mb > TRAVEL_LIMIT_MB:
        raise SystemExit(
            f"the wheelhouse and the project are {wheels_mb + project_mb:.1f} MiB, over "
            f"{TRAVEL_LIMIT_MB}: drop the pins the GPU machine already holds in range"
        )


def slim_wheel(wheel: Path, drop: tuple[str, ...]) -> int:
    """Rewrite the wheel at `wheel` without its members whose path starts with one of `drop`, and without their rows
    in its RECORD (which lists the wheel's files; the other rows keep their hashes: those files are unchanged).
    Every other member keeps its contents, order and permission bits (the raylet must stay executable). Returns the
    number of members dropped; 0 leaves the file untouched."""
    import shutil
    import zipfile

    def dropped(name: str) -> bool:
        return name.startswith(drop)

    with zipfile.ZipFile(wheel) as source:
        members = source.infolist()
        cut = sum(dropped(m.filename) for m in members)
        if not cut:
            return 0
        partial = wheel.with_name(wheel.name + ".partial")
        with zipfile.ZipFile(partial, "w", zipfile.ZIP_DEFLATED) as slim:
            for member in members:
                if dropped(member.filename):
                    continue
                if member.filename.endswith(".dist-info/RECORD"):
                    rows = source.read(member).decode().splitlines(keepends=True)
                    slim.writestr(member, "".join(r for r in rows if not dropped(r.split(",", 1)[0])))
                    continue
                with source.open(member) as src, slim.open(member, "w") as dst:  # streamed: _raylet.so is 42 MiB
                    shutil.copyfileobj(src, dst, 1 << 20)
    os.replace(partial, wheel)
    return cut


def wheel_file(pin: Pin, wheels: Path) -> Path | None:
    """The wheel of `pin` in the folder `wheels` (file names spell the project name with '_', any case)."""
    stem = pin.name.replace("-", "_").lower()
    found = sorted(f for f in wheels.glob("*.whl") if f.name.lower().startswith(f"{stem}-{pin.version}-"))
    return found[0] if found else None


def _tracked_mb() -> float:
    try:
        names = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return 0.0
    return sum((ROOT / n).stat().st_size for n in names.decode().split("\0") if n and (ROOT / n).is_file()) / 2**20


def cuda_state() -> tuple[bool, str]:
    """Whether the tier can run here, and the line that says why not (or what it runs on)."""
    try:
        import torch
    except ImportError as err:
        return False, f"torch does not import here ({err})"
    if not torch.cuda.is_available():
        return False, f"no CUDA device here (torch {torch.__version__})"
    accepted = next(p.accepted for p in read_pins() if p.name == "torch")
    if not _specifier(accepted).contains(torch.__version__.split("+")[0]):
        return False, f"torch {torch.__version__} is outside the tier's accepted range {accepted}"
    return True, f"{torch.cuda.get_device_name()} with torch {torch.__version__} (CUDA {torch.version.cuda})"


def install(needed: list[tuple[Pin, str | None]], wheels: Path, target: Path) -> None:
    if not needed:
        return
    files = []
    for pin, _have in needed:
        found = wheel_file(pin, wheels)
        if found is None:
            raise SystemExit(
                f"GPU tier: {pin.requirement} is needed here (this Python holds "
                f"{_have or 'none'}; accepted {pin.accepted}) and {wheels} has no wheel of it: "
                f"run `make gpu-wheelhouse` where pip can reach the registry, and carry {wheels.name}"
            )
        files.append(str(found))
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-index",
            "--no-deps",
            "--no-compile",
            "--no-cache-dir",
            "--upgrade",
            "--target",
            str(target),
            *files,
        ],
        check=True,
    )
    print("[mrl] GPU tier installed: " + ", ".join(f"{p.requirement} (had {h or 'none'})" for p, h in needed))


def run(wheels: Path, report: Path, pytest_args: list[str]) -> int:
    ok, line = cuda_state()
    if not ok:
        print(f"GPU tier: skipped: {line}")
        return 0
    print(f"[mrl] GPU tier on {line}")
    target = Path(tempfile.mkdtemp(prefix="mrl-gpu-tier-"))
    install(missing(read_pins()), wheels, target)
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(target), str(ROOT), os.environ.get("PYTHONPATH")]))
    )
    env[REPORT_ENV] = str(report.resolve())
    env.setdefault("PYTHONUNBUFFERED", "1")
    report.parent.mkdir(parents=True, exist_ok=True)
    paths = [] if any(a.startswith("tests/") for a in pytest_args) else ["tests/gpu"]  # or the tests named
    done = subprocess.run(
        [sys.executable, "-m", "pytest", *paths, "-q", "-s", "-p", "no:cacheprovider", *pytest_args], cwd=ROOT, env=env
    )
    if report.exists():
        figures = json.loads(report.read_text()).get("figures", {})
        print(f"[mrl] GPU tier report: {report} ({len(figures)} figures)")
    return done.returncode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mrl.testing.gpu_tier", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    w = sub.add_parser("wheelhouse", help="download the tier's wheels (needs the package registry)")
    w.add_argument("--out", type=Path, default=WHEELS)
    w.add_argument("--python-version", default="3.12")
    r = sub.add_parser("run", help="run tests/gpu here and write the JSON report")
    r.add_argument("--wheels", type=Path, default=WHEELS)
    r.add_argument("--report", type=Path, default=ROOT / "results" / "gpu-tier.json")
    r.add_argument("pytest_args", nargs="*", help="passed to pytest (after --)")
    args = parser.parse_args(argv)
    if args.command == "wheelhouse":
        build_wheelhouse(args.out, args.python_version)
        return 0
    return run(args.wheels, args.report, args.pytest_args)


if __name__ == "__main__":
    sys.exit(main())
