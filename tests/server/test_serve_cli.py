"""``hybridserve serve`` wiring that needs no live server (fast)."""

from __future__ import annotations

import subprocess
import sys

from hybridserve.entrypoints.cli import build_parser
from hybridserve.entrypoints.engine_args import ENGINE_FIELDS

BLOCK_SERVER_DEPS = """
import importlib.abc, sys
class Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("fastapi", "uvicorn", "starlette", "openai"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Blocker())
"""


def test_serve_flags():
    args = build_parser().parse_args(["serve", "some/dir", "--api-key", "k", "--served-model-name", "m",
                                      "--port", "1234", "--mamba-ssm-cache-dtype", "float32", "--max-num-seqs", "8"])
    assert (args.model_dir, args.host, args.port, args.api_key, args.served_model_name) == \
        ("some/dir", "127.0.0.1", 1234, "k", "m")
    for field in ENGINE_FIELDS:  # every engine option of the offline API is a serve flag
        assert hasattr(args, field), field
    assert build_parser().parse_args(["serve"]).model_dir is None  # MODEL_DIR is optional (shipped model)


def test_core_imports_without_server_dependencies():
    code = BLOCK_SERVER_DEPS + """
import hybridserve
from hybridserve import LLM, SamplingParams
from hybridserve.engine.async_engine import AsyncEngine
from hybridserve.entrypoints.cli import main
try:
    import fastapi
except ModuleNotFoundError:
    pass
else:
    raise SystemExit("the blocker did not work")
main(["serve", "--help"])  # prints the help and exits 0
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "--api-key" in result.stdout and "--mamba-ssm-cache-dtype" in result.stdout


def test_serve_without_server_dependencies_says_what_to_install(tmp_path):
    code = BLOCK_SERVER_DEPS + f"""
from hybridserve.entrypoints.cli import main
raise SystemExit(main(["serve", {str(tmp_path)!r}]))
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    assert "hybridserve[server]" in result.stderr
