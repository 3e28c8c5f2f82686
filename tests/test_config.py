"""Configuration: precedence, validation messages naming the option."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvservice.config import ConfigError, load_config


def test_defaults_are_valid() -> None:
    """The defaults validate on their own."""
    cfg = load_config({}, environ={})
    assert cfg.listen.uds_mode_int == 0o600 and cfg.listen.uds_path


def test_precedence_flags_over_env_over_yaml(tmp_path: Path) -> None:
    """Flags beat KVSERVICE_* variables, which beat the YAML file."""
    y = tmp_path / "c.yaml"
    y.write_text("grace_period_s: 3\nhash_seed: 7\nlog_format: text\n")
    env = {"KVSERVICE_HASH_SEED": "9", "KVSERVICE_LOG_FORMAT": "json"}
    cfg = load_config({"log_format": "text"}, environ=env, yaml_path=str(y))
    assert (cfg.listen.grace_period_s, cfg.index.hash_seed, cfg.observability.log_format) == (3.0, 9, "text")


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
    assert cfg.index.event_streams()[0]["engine_id"] == "vllm-0"
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
        assert cfg.data_plane.native_dir == ours["KVSERVICE_NATIVE_DIR"]


def test_each_option_is_declared_once_and_listed_by_group() -> None:
    """Each flat option name is one field of one group; ``--help`` shows the groups as argument
    groups in their declared order, each option under its own group."""
    import argparse
    import dataclasses

    from kvservice.config import GROUPS, OPTIONS, Config, add_flags

    assert [name for name, _ in GROUPS] == [f.name for f in dataclasses.fields(Config)]

    declared = [f.name for _, cls in GROUPS for f in dataclasses.fields(cls)]
    assert len(declared) == len(set(declared)) == len(OPTIONS)
    parser = argparse.ArgumentParser()
    add_flags(parser)
    text = parser.format_help()
    at = [text.index(f"\n{name}: ") for name, _ in GROUPS]
    assert at == sorted(at)
    tuning = text.index("\ntuning: ")
    assert tuning < text.index("  --lane-cross-stream") and text.index("  --lane-cross-mb") < tuning


def test_yaml_accepts_flat_and_nested_keys(tmp_path: Path) -> None:
    """A YAML key is an option's flat name or, nested, its group's; a key under the wrong group
    is reported by its path."""
    y = tmp_path / "c.yaml"
    y.write_text("listen:\n  grace_period_s: 4\ntuning:\n  lane_cross_parts: 8\nhash_seed: 5\n")
    cfg = load_config({}, environ={}, yaml_path=str(y))
    assert (cfg.listen.grace_period_s, cfg.tuning.lane_cross_parts, cfg.index.hash_seed) == (4.0, 8, 5)
    y.write_text("listen:\n  hash_seed: 5\n")
    with pytest.raises(ConfigError, match=r"^listen\.hash_seed"):
        load_config({}, environ={}, yaml_path=str(y))


def test_deprecated_note_with_write_variable_still_works(caplog: pytest.LogCaptureFixture) -> None:
    """KVLANE_NOTE_WITH_WRITE=1 sets tuning.lane_note_with_write, with a warning naming the new
    variable; KVSERVICE_LANE_NOTE_WITH_WRITE wins over it."""
    with caplog.at_level("WARNING"):
        assert load_config({}, environ={"KVLANE_NOTE_WITH_WRITE": "1"}).tuning.lane_note_with_write
    assert "KVSERVICE_LANE_NOTE_WITH_WRITE" in caplog.text
    env = {"KVLANE_NOTE_WITH_WRITE": "1", "KVSERVICE_LANE_NOTE_WITH_WRITE": "0"}
    assert not load_config({}, environ=env).tuning.lane_note_with_write


def test_with_options_names_an_unknown_option() -> None:
    """Replacing options by flat name puts each in its group and refuses an unknown name."""
    from kvservice.config import Config, with_options

    cfg = with_options(Config(), tcp_address="127.0.0.1:1", lane_spin_us=0)
    assert (cfg.listen.tcp_address, cfg.tuning.lane_spin_us) == ("127.0.0.1:1", 0)
    with pytest.raises(ConfigError, match="^bogus: unknown option"):
        with_options(Config(), bogus=1)


def test_a_flat_name_still_reads_with_a_deprecation_warning() -> None:
    """``config.uds_path`` (before the groups) reads ``config.listen.uds_path`` and warns."""
    from kvservice.config import Config

    cfg = Config()
    with pytest.warns(DeprecationWarning, match=r"use Config\.listen\.uds_path"):
        assert cfg.uds_path == cfg.listen.uds_path  # type: ignore[attr-defined]
    with pytest.raises(AttributeError):
        cfg.nope  # type: ignore[attr-defined]  # noqa: B018


def test_the_removed_lane_kernel_variable_warns_for_triton_and_refuses_nvrtc(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """KVSERVICE_LANE_KERNEL (decision 0026): ``triton``, the only kernel now, is ignored with a
    warning; any other value is refused, naming the variable and why."""
    with caplog.at_level("WARNING"):
        assert load_config({}, environ={"KVSERVICE_LANE_KERNEL": "triton"}) == load_config({}, environ={})
    assert "KVSERVICE_LANE_KERNEL is ignored" in caplog.text
    with pytest.raises(ConfigError, match="KVSERVICE_LANE_KERNEL: 'nvrtc' is no longer supported: .*Triton"):
        load_config({}, environ={"KVSERVICE_LANE_KERNEL": "nvrtc"})
