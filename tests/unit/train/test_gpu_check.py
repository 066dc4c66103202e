"""scripts/gpu_check.sh refuses to run without CUDA (loudly, naming CUDA); its Python parts run on the CPU."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).parents[3]


def _gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the script would run the check")
def test_the_script_exits_non_zero_naming_cuda_without_a_gpu():
    env = {**os.environ, "PYTHON": sys.executable}
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh")], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode != 0
    assert "CUDA is not available" in proc.stderr
    # the driver refuses too when called directly
    assert _gpu_check().main(["--device", "cuda"]) == 2


def test_the_python_parts_run_on_the_cpu(capsys):
    assert _gpu_check().main(["--device", "cpu", "--parts", "rote,otcclip"]) == 0
    table = capsys.readouterr().out
    assert "rote      ok" in table and "otcclip   ok" in table
    with pytest.raises(SystemExit):
        _gpu_check().main(["--device", "cpu", "--parts", "nope"])  # names the valid parts


def test_the_crl_part_runs_on_a_random_llama_when_asked(capsys, monkeypatch):
    """Where SmolLM2 cannot be carried, the crl part runs the demo on a random Llama of its block shape (here
    shrunk to tiny blocks: the CPU run is only the code path); the table says which model it was."""
    import reprlab.models.random_llama as rl

    monkeypatch.setattr(rl, "SMOLLM2_135M_BLOCKS", rl.TINY_BLOCKS)
    assert _gpu_check().main(["--device", "cpu", "--parts", "crl", "--crl-model", "random"]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("crl "))
    assert "crl       ok" in row and "random SmolLM2-135M-shaped Llama" in row and "model=" not in row
