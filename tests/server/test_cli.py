"""`pagedserve` command line: subcommands, and flag > env > file > default precedence."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from server.cli import build_parser
from server.settings import OPTIONS, read_config_file, resolve_settings
from tests.server.server_proc import REPO_ROOT


def settings_for(argv: list[str], env: dict[str, str] | None = None):
    return resolve_settings(build_parser().parse_args(["serve", *argv]), env or {})


def test_defaults_match_engine_config() -> None:
    s = settings_for([])
    assert (s.model, s.host, s.port) == ("SmolLM2-135M-Instruct", "127.0.0.1", 8000)
    assert s.engine_config().enable_prefix_caching is True and s.max_model_len is None


def test_engine_stall_timeout_is_on_by_default() -> None:
    """A hung engine is visible without configuration: /health turns 503 after 300 s without a step."""
    assert settings_for([]).engine_stall_timeout == 300.0
    assert settings_for(["--engine-stall-timeout", "none"]).engine_stall_timeout is None
    assert settings_for([], {"PAGEDSERVE_ENGINE_STALL_TIMEOUT": "30"}).engine_stall_timeout == 30.0


def test_precedence_flag_env_file_default(tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text("max-model-len: 111\nmax_num_seqs: 7\nport: 9001\nenforce-eager: true\nseed: 3\n")
    env = {"PAGEDSERVE_MAX_NUM_SEQS": "8", "PAGEDSERVE_PORT": "9002", "PAGEDSERVE_ENABLE_PREFIX_CACHING": "false"}
    s = settings_for(["--config", str(config), "--port", "9003"], env)
    assert s.port == 9003                       # flag beats env and file
    assert s.max_num_seqs == 8                  # env beats file
    assert s.max_model_len == 111 and s.enforce_eager is True and s.seed == 3   # file beats default
    assert s.enable_prefix_caching is False     # env beats default
    assert s.block_size == 16                   # default
    config_from_env = settings_for([], {"PAGEDSERVE_CONFIG": str(config)})
    assert config_from_env.max_model_len == 111
    cfg = s.engine_config()
    assert (cfg.max_model_len, cfg.max_num_seqs, cfg.enable_prefix_caching) == (111, 8, False)
    assert settings_for(["--no-enable-prefix-caching"]).enable_prefix_caching is False


@pytest.mark.parametrize("content, words", [
    ("max-model-lenn: 5\n", "unknown key"),
    ("port: eighty\n", "--port"),
    ("- a\n- b\n", "mapping"),
    ("dtype: float8\n", "--dtype"),
])
def test_bad_config_files_are_explained(tmp_path: Path, content: str, words: str) -> None:
    config = tmp_path / "bad.yaml"
    config.write_text(content)
    with pytest.raises(ValueError, match=words):
        read_config_file(str(config))


def test_bad_env_value_is_explained() -> None:
    with pytest.raises(ValueError, match="PAGEDSERVE_ENFORCE_EAGER"):
        settings_for([], {"PAGEDSERVE_ENFORCE_EAGER": "maybe"})


def test_every_option_has_a_flag_and_env_name() -> None:
    help_text = build_parser()._subparsers._group_actions[0].choices["serve"].format_help()
    for opt in OPTIONS:
        assert opt.flag in help_text and opt.env in help_text.replace("\n", "").replace(" ", "")


def test_shipped_configs_are_valid() -> None:
    files = sorted((REPO_ROOT / "configs").glob("*.yaml"))
    assert {f.name for f in files} >= {"tiny.yaml", "qwen3-0.6b.yaml", "llama-3.2-1b.yaml"}
    for f in files:
        assert read_config_file(str(f))["model"]


def test_cli_reports_a_missing_model_cleanly(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "server", "serve", "--model", str(tmp_path / "nope"),
                             "--device", "cpu", "--port", "1"], cwd=REPO_ROOT, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode != 0
    assert "Traceback" not in result.stderr and "nope" in result.stderr
    bad_flag = subprocess.run([sys.executable, "-m", "server", "serve", "--dtype", "float8"], cwd=REPO_ROOT,
                              capture_output=True, text=True, timeout=120)
    assert bad_flag.returncode == 2 and "--dtype" in bad_flag.stderr


def test_readme_documents_every_flag() -> None:
    readme = (REPO_ROOT / "README.md").read_text()
    missing = [opt.flag for opt in OPTIONS if f"`{opt.flag}`" not in readme]
    assert not missing, f"README.md's configuration table lacks {missing}"
