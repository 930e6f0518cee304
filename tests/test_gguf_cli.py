"""`pagedserve serve --model BAD.gguf`: one clear error line, a non-zero exit, no traceback, nothing left
listening."""
from __future__ import annotations

import re
import socket
import subprocess
from pathlib import Path

import pytest

from engine.tiny_model import build_checkpoint
from tests.gguf_files import BAD_CASES, bad_gguf_files, write_gguf
from tests.server.server_proc import REPO_ROOT, free_port, serve_command


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[Path, str, int, subprocess.CompletedProcess]]:
    """Every bad case started at once (they spend their time importing torch, not failing)."""
    root = tmp_path_factory.mktemp("bad-gguf")
    good = write_gguf(build_checkpoint(root / "hf", "llama", seed=1), root / "good.gguf", "llama", "F16")
    procs = {}
    for case, (path, pattern) in bad_gguf_files(root, good).items():
        port = free_port()
        cmd = [*serve_command(), "--model", str(path), "--device", "cpu", "--port", str(port)]
        procs[case] = (path, pattern, port, subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=subprocess.PIPE,
                                                               stderr=subprocess.STDOUT, text=True))
    results = {}
    for case, (path, pattern, port, proc) in procs.items():
        out, _ = proc.communicate(timeout=300)
        results[case] = (path, pattern, port, subprocess.CompletedProcess(proc.args, proc.returncode, out))
    return results


@pytest.mark.parametrize("case", BAD_CASES)
def test_bad_model_file_stops_the_server_with_one_line(runs, case):
    path, pattern, port, result = runs[case]
    output = result.stdout
    assert result.returncode != 0, output
    assert "Traceback" not in output, output
    errors = [line for line in output.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and re.search(pattern, errors[0]) and str(path) in errors[0], output
    with socket.socket() as s, pytest.raises(ConnectionRefusedError):
        s.connect(("127.0.0.1", port))     # the server never started listening
