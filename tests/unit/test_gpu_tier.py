"""The GPU tier's runner (mrl/testing/gpu_tier.py) where there is no GPU: it skips in one line with exit 0, its pin
file parses, and it installs only what a machine lacks or holds out of range."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from mrl.testing import gpu_tier

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]


def test_without_cuda_the_runner_skips_in_one_line_and_exits_0(tmp_path):
    done = subprocess.run([sys.executable, "-m", "mrl.testing.gpu_tier", "run", "--wheels", str(tmp_path),
                           "--report", str(tmp_path / "r.json")], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [done.stdout.strip()] and done.stdout.startswith("GPU tier: skipped: no CUDA")
    assert not (tmp_path / "r.json").exists()


def test_the_pins_parse_and_torch_is_the_machines_own():
    pins = {p.name: p for p in gpu_tier.read_pins()}
    assert pins["torch"].source == "machine" and "2.11" in pins["torch"].accepted
    assert pins["megatron-core"].version == "0.19.2" and pins["antlr4-python3-runtime"].source == "build"


def test_a_pin_is_installed_only_where_missing_or_out_of_range(monkeypatch):
    held = {"megatron-core": "0.16.1", "transformers": "5.17.0", "pydantic": "1.10.0"}

    def version(name):
        if name not in held:
            raise gpu_tier.metadata.PackageNotFoundError(name)
        return held[name]

    monkeypatch.setattr(gpu_tier.metadata, "version", version)
    pins = [gpu_tier.Pin("megatron-core", "0.16.1", "==0.16.1", "download"),
            gpu_tier.Pin("transformers", "5.19.0", ">=5.16.1,<5.20", "download"),
            gpu_tier.Pin("pydantic", "2.14.3", ">=2.7,<3", "download"),
            gpu_tier.Pin("omegaconf", "2.3.1", ">=2.3,<2.4", "download"),
            gpu_tier.Pin("torch", "2.13.0", ">=2.11,<2.14", "machine")]
    assert [(p.name, have) for p, have in gpu_tier.missing(pins)] == [("pydantic", "1.10.0"), ("omegaconf", None)]


def test_a_malformed_pin_line_names_the_file_and_line(tmp_path):
    bad = tmp_path / "pins.txt"
    bad.write_text("# fine\nmegatron-core 0.16.1 download\n")
    with pytest.raises(ValueError, match=r"pins.txt:2: .*expected 'name==version accepted"):
        gpu_tier.read_pins(bad)


def _fake_wheel(folder: Path, name: str = "fakeray", version: str = "1.0") -> Path:
    """A wheel as pip makes them: the package (a jar, a dashboard build, an executable), its dist-info, a RECORD
    listing every file with its hash."""
    import base64
    import hashlib
    import zipfile

    info = f"{name}-{version}.dist-info"
    files = {f"{name}/__init__.py": b"VERSION = 1\n", f"{name}/core/raylet": b"\x7fELF binary",
             f"{name}/jars/ray_dist.jar": b"PK java" * 100, f"{name}/dashboard/client/build/index.html": b"<html/>",
             f"{name}/dashboard/modules/head.py": b"HEAD = 1\n",
             f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
             f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}

    def row(path: str, data: bytes) -> str:
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        return f"{path},sha256={digest},{len(data)}\n"

    wheel = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as z:
        for path, data in files.items():
            member = zipfile.ZipInfo(path, date_time=(2020, 1, 1, 0, 0, 0))
            member.external_attr = (0o100755 if path.endswith("raylet") else 0o100644) << 16  # a regular file's mode
            z.writestr(member, data, zipfile.ZIP_DEFLATED)
        z.writestr(f"{info}/RECORD", "".join(row(p, d) for p, d in files.items()) + f"{info}/RECORD,,\n")
    return wheel


CUTS = ("fakeray/jars/", "fakeray/dashboard/client/build/")


def test_slimming_a_wheel_drops_the_cut_files_and_their_record_rows_and_keeps_the_rest(tmp_path):
    import zipfile

    wheel = _fake_wheel(tmp_path)
    with zipfile.ZipFile(wheel) as z:
        before = {m.filename: (z.read(m), m.external_attr) for m in z.infolist()}
    assert gpu_tier.slim_wheel(wheel, CUTS) == 2
    with zipfile.ZipFile(wheel) as z:
        after = {m.filename: (z.read(m), m.external_attr) for m in z.infolist()}
        names = [m.filename for m in z.infolist()]
    record = after.pop("fakeray-1.0.dist-info/RECORD")[0].decode().splitlines()
    cut = ["fakeray-1.0.dist-info/RECORD", "fakeray/dashboard/client/build/index.html", "fakeray/jars/ray_dist.jar"]
    assert sorted(set(before) - set(after)) == cut  # RECORD: popped from `after` above
    assert all(after[name] == before[name] for name in after)  # the same bytes and permission bits (raylet: 0o755)
    assert [row.split(",")[0] for row in record] == [*after, "fakeray-1.0.dist-info/RECORD"]
    assert [line for line in before["fakeray-1.0.dist-info/RECORD"][0].decode().splitlines() if
            not line.startswith(CUTS)] == record  # the other rows as they were, hashes and all
    assert names[-1] == "fakeray-1.0.dist-info/RECORD" and not list(tmp_path.glob("*.partial"))
    assert gpu_tier.slim_wheel(wheel, CUTS) == 0  # nothing left to cut: the file stays as it is


def test_the_runner_installs_a_slim_wheel_from_the_wheelhouse_with_pip(tmp_path):
    wheels, target = tmp_path / "wheels", tmp_path / "target"
    wheels.mkdir()
    gpu_tier.slim_wheel(_fake_wheel(wheels), CUTS)
    gpu_tier.install([(gpu_tier.Pin("fakeray", "1.0", "==1.0", "slim"), None)], wheels, target)
    package = target / "fakeray"
    installed = sorted(str(p.relative_to(package)) for p in package.rglob("*") if p.is_file())
    assert installed == ["__init__.py", "core/raylet", "dashboard/modules/head.py"]
    assert (package / "core" / "raylet").stat().st_mode & 0o100  # still executable
    with pytest.raises(SystemExit, match=r"otherpkg==2.0 is needed here .* has no wheel of it"):
        gpu_tier.install([(gpu_tier.Pin("otherpkg", "2.0", ">=2", "download"), None)], wheels, target)


def test_a_slim_row_needs_its_cuts_and_ray_is_slimmed(tmp_path):
    pins = {p.name: p for p in gpu_tier.read_pins()}
    assert pins["ray"].source == "slim" and pins["ray"].version == "2.60.0"
    assert {"ray/jars/", "ray/dashboard/client/build/"} <= set(gpu_tier.SLIM["ray"])
    bad = tmp_path / "pins.txt"
    bad.write_text("numpy==2.3.5  >=2  slim\n")
    with pytest.raises(ValueError, match=r"pins.txt:1: .*a slim row needs its cuts in SLIM"):
        gpu_tier.read_pins(bad)


def test_the_wheelhouse_slims_what_pip_downloads_for_a_slim_row(tmp_path, monkeypatch, capsys):
    import zipfile

    def pip(command, check):  # `pip download ... -d OUT REQUIREMENTS`: the registry's whole wheel
        assert command[3] == "download" and command[-1] == "fakeray==1.0"
        _fake_wheel(Path(command[command.index("-d") + 1]))

    monkeypatch.setattr(gpu_tier, "read_pins", lambda: [gpu_tier.Pin("fakeray", "1.0", "==1.0", "slim")])
    monkeypatch.setitem(gpu_tier.SLIM, "fakeray", CUTS)
    monkeypatch.setattr(gpu_tier.subprocess, "run", pip)
    monkeypatch.setattr(gpu_tier, "_tracked_mb", lambda: 0.0)
    gpu_tier.build_wheelhouse(tmp_path)
    with zipfile.ZipFile(tmp_path / "fakeray-1.0-py3-none-any.whl") as z:
        assert not [name for name in z.namelist() if name.startswith(CUTS)]
    assert "fakeray-1.0-py3-none-any.whl: " in capsys.readouterr().out
