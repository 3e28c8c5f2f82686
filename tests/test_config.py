"""Configuration: precedence, validation messages naming the option."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvservice.config import ConfigError, load_config


def test_defaults_are_valid() -> None:
    """The defaults validate on their own."""
    cfg = load_config({}, environ={})
    assert cfg.uds_mode_int == 0o600 and cfg.uds_path


def test_precedence_flags_over_env_over_yaml(tmp_path: Path) -> None:
    """Flags beat KVSERVICE_* variables, which beat the YAML file."""
    y = tmp_path / "c.yaml"
    y.write_text("grace_period_s: 3\nhash_seed: 7\nlog_format: text\n")
    env = {"KVSERVICE_HASH_SEED": "9", "KVSERVICE_LOG_FORMAT": "json"}
    cfg = load_config({"log_format": "text"}, environ=env, yaml_path=str(y))
    assert (cfg.grace_period_s, cfg.hash_seed, cfg.log_format) == (3.0, 9, "text")


@pytest.mark.parametrize(
    ("env", "option"),
    [
        ({"KVSERVICE_UDS_MODE": "999"}, "uds_mode"),
        ({"KVSERVICE_TCP_ADDRESS": "nohost"}, "tcp_address"),
        ({"KVSERVICE_GRACE_PERIOD_S": "-1"}, "grace_period_s"),
        ({"KVSERVICE_GRACE_PERIOD_S": "soon"}, "grace_period_s"),
        ({"KVSERVICE_DEFAULT_DEADLINE_MS": "0"}, "default_deadline_ms"),
        ({"KVSERVICE_LOG_LEVEL": "LOUD"}, "log_level"),
        ({"KVSERVICE_NIXL_PROGRESS_DELAY_US": "-1"}, "nixl_progress_delay_us"),
        ({"KVSERVICE_TWO_GPU_COPY": "sideways"}, "two_gpu_copy"),
        ({"KVSERVICE_NOPE": "1"}, "KVSERVICE_NOPE"),
        ({"KVSERVICE_UDS_PATH": "", "KVSERVICE_TCP_ADDRESS": ""}, "uds_path"),
    ],
)
def test_invalid_option_is_named(env: dict[str, str], option: str) -> None:
    """Each invalid option fails validation with a message that starts with its name."""
    with pytest.raises(ConfigError, match=f"^{option}"):
        load_config({}, environ=env)


def test_yaml_unknown_key_is_named(tmp_path: Path) -> None:
    """An unknown key in the YAML file is reported by name."""
    y = tmp_path / "c.yaml"
    y.write_text("bogus_option: 1\n")
    with pytest.raises(ConfigError, match="bogus_option"):
        load_config({}, environ={}, yaml_path=str(y))


def test_kv_event_streams_parse_and_validate(tmp_path: Path) -> None:
    """kv_events accepts a YAML list and rejects a stream without an endpoint, naming it."""
    y = tmp_path / "c.yaml"
    y.write_text("kv_events:\n  - {engine_id: vllm-0, endpoint: 'tcp://127.0.0.1:5557', page_size: 16}\n")
    cfg = load_config({}, environ={}, yaml_path=str(y))
    assert cfg.event_streams()[0]["engine_id"] == "vllm-0"
    with pytest.raises(ConfigError, match=r"^kv_events\[0\]\.endpoint"):
        load_config({}, environ={"KVSERVICE_KV_EVENTS": '[{"engine_id": "x", "page_size": 16}]'})


def test_image_environment_is_known_options() -> None:
    """Every KVSERVICE_* variable the Dockerfile's images set is an option `kvservice serve`
    accepts (an unknown one stops the service at start: KVSERVICE_NATIVE_DIR once did)."""
    text = (Path(__file__).resolve().parents[1] / "Dockerfile").read_text().replace("\\\n", " ")
    envs = [line.split(None, 1)[1] for line in text.splitlines() if line.startswith("ENV ")]
    assert len(envs) == 2  # cpu and gpu
    for env in envs:
        pairs = dict(word.split("=", 1) for word in env.split())
        ours = {k: v for k, v in pairs.items() if k.startswith("KVSERVICE_")}
        assert "KVSERVICE_NATIVE_DIR" in ours and "KVSERVICE_CACHE_DIR" in ours
        cfg = load_config({}, environ=ours)
        assert cfg.native_dir == ours["KVSERVICE_NATIVE_DIR"]


def test_options_are_declared_and_listed_by_section() -> None:
    """Each option is in exactly one section of ``SECTIONS``; the declaration follows the sections
    (a new option goes under its subject), and ``--help`` shows them as argument groups."""
    import argparse
    import dataclasses

    from kvservice.config import SECTIONS, Config, add_flags

    listed = [name for names in SECTIONS.values() for name in names]
    assert len(listed) == len(set(listed))
    assert listed == [f.name for f in dataclasses.fields(Config)]
    parser = argparse.ArgumentParser()
    add_flags(parser)
    text = parser.format_help()
    at = [text.index(f"{title}:") for title in SECTIONS]
    assert at == sorted(at)
    lane = text.index("Native lane (same node and cross-node):")
    assert lane < text.index("  --lane-cross-stream") < text.index("Prefix index and KV events:")
