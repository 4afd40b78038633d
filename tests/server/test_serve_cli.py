"""``hybridserve serve`` wiring that needs no live server (fast)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

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


def _serve_error(capsys, *flags: str) -> str:
    """``hybridserve serve`` with ``flags`` exits 2 before loading anything; its error message."""
    from hybridserve.entrypoints.cli import main

    assert main(["serve", "/nonexistent-model-dir", *flags]) == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("key", ["", "   ", " padded", "tab\tkey", "clé"])
def test_unusable_api_key_is_refused_at_startup(capsys, key):
    assert "--api-key" in _serve_error(capsys, "--api-key", key)


def test_bad_server_flags_are_refused_at_startup(capsys):
    assert "--api-key" in _serve_error(capsys, "--protect-metrics-and-docs")
    assert "--allowed-hosts" in _serve_error(capsys, "--allowed-hosts", "example.com:8000")
    assert "--max-chat-messages" in _serve_error(capsys, "--max-chat-messages", "0")
    with pytest.raises(SystemExit):  # argparse: not a size
        build_parser().parse_args(["serve", "--max-request-body-size", "lots"])


def test_limit_flags_and_defaults():
    from hybridserve.entrypoints.openai.limits import FLAGS, ServerLimits, limits_from_args

    args = build_parser().parse_args(["serve", "--max-request-body-size", "512KiB", "--max-prompts-per-request", "8"])
    limits = limits_from_args(args)
    assert (limits.max_body_bytes, limits.max_prompts) == (512 * 1024, 8)
    assert limits_from_args(build_parser().parse_args(["serve"])) == ServerLimits()
    assert set(FLAGS) == {f.name for f in dataclasses.fields(ServerLimits)}


def test_served_model_name_is_the_directory_base_name():
    from hybridserve.entrypoints.serve_cmd import served_model_name

    assert served_model_name(None) == "hybridserve-default"
    assert served_model_name("/models/granite-tiny/") == "granite-tiny"
    assert served_model_name("relative/dir") == "dir"
