"""benchmarks/side_by_side.py's --hybridserve-gguf: hybridserve loads the GGUF file llama.cpp runs."""

import os

import pytest

from tests.gguf.benchmark_script import load_benchmark


def _side_by_side():
    return load_benchmark("side_by_side")


def test_hybridserve_loads_the_gguf_file_only_when_asked(tmp_path):
    sbs = _side_by_side()
    gguf = tmp_path / "model-q4_k_m.gguf"
    gguf.write_bytes(b"GGUF")
    base = ["--model", str(tmp_path), "--engines", "hybridserve,llama.cpp", "--gguf", str(gguf)]
    assert sbs.hybridserve_model(sbs.parse_args(base)) == str(tmp_path)
    assert sbs.hybridserve_model(sbs.parse_args([*base, "--hybridserve-gguf"])) == str(gguf)
    # without --gguf, the file is the llama.cpp default for the dtype, MODEL/model-bf16.gguf
    (tmp_path / "model-bf16.gguf").write_bytes(b"GGUF")
    a = sbs.parse_args(["--model", str(tmp_path), "--hybridserve-gguf"])
    assert sbs.hybridserve_model(a) == os.path.join(str(tmp_path), "model-bf16.gguf")


def test_hybridserve_gguf_refuses_a_missing_file_and_the_greedy_check(tmp_path, capsys):
    sbs = _side_by_side()
    missing = str(tmp_path / "model-q8_0.gguf")
    with pytest.raises(SystemExit):
        sbs.parse_args(["--model", str(tmp_path), "--gguf", missing, "--hybridserve-gguf"])
    assert f"no GGUF file at {missing}" in capsys.readouterr().err
    gguf = tmp_path / "model-q8_0.gguf"
    gguf.write_bytes(b"GGUF")
    with pytest.raises(SystemExit):
        sbs.parse_args(["--model", str(tmp_path), "--gguf", str(gguf), "--hybridserve-gguf",
                        "--greedy-check", "float32"])
    assert "--greedy-check" in capsys.readouterr().err
