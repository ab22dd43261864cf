"""Device config: seed 003's YAML shape, desktop clients' mcpServers JSON, and clear errors."""

from __future__ import annotations

import json

import pytest

from tether.device.config import load_device_config, parse_device_config

SEED_YAML = """
mcp:
  HostAgent:
    default:
      data_collection:
        - namespace: time
          server_type: stdio
          command: python3
          args: ["-m", "mcp_server_time"]
      action:
        - namespace: files
          server_type: local
          toolset: files
    chrome:
      action:
        - namespace: remote
          server_type: http
          url: http://127.0.0.1:9/mcp
          headers: {Authorization: "Bearer x"}
"""


def test_seed_yaml_shape(tmp_path):
    path = tmp_path / "device.yaml"
    path.write_text(SEED_YAML)
    config = load_device_config(path)
    root_name, root = config.root("HostAgent", "default")
    assert root_name == "default"
    assert [c.namespace for c in root.data_collection] == ["time"]
    # built-in sets join the default root, but not twice
    assert [c.namespace for c in root.action] == ["shell", "system", "transfer", "desktop", "browser", "files"]
    name, chrome = config.root("HostAgent", "chrome")
    assert name == "chrome" and chrome.action[0].headers == {"Authorization": "Bearer x"}
    assert config.root("HostAgent", "unknown")[0] == "default"


def test_unknown_agent_is_an_error():
    with pytest.raises(ValueError, match="unknown agent 'Nobody'"):
        parse_device_config({}).root("Nobody", None)


def test_mcp_servers_json(tmp_path):
    path = tmp_path / "claude_desktop_config.json"
    path.write_text(json.dumps({"mcpServers": {
        "time": {"command": "uvx", "args": ["mcp-server-time"], "env": {"TZ": "UTC"}, "toolType": "data_collection"},
        "web": {"url": "http://127.0.0.1:1/mcp", "headers": {"X-Key": "k"}},
        "off": {"command": "nothing", "disabled": True},
    }}))
    config = load_device_config(path)
    _, root = config.root("default", None)
    assert [(c.namespace, c.server_type) for c in root.data_collection] == [("time", "stdio")]
    assert ("web", "http") in [(c.namespace, c.server_type) for c in root.action]
    assert "off" not in {c.namespace for _, c in root.servers()}


@pytest.mark.parametrize(("raw", "message"), [
    ({"mcpServers": {"x": {"args": []}}}, "needs a 'command'"),
    ({"mcpServers": {"x": {"command": "a", "bogus": 1}}}, "unsupported key"),
    ({"mcp": {"a": {"default": {"action": [{"namespace": "n", "server_type": "local"}]}}}}, "exactly one of"),
    ({"device": {"builtin": ["nope"]}}, "unknown built-in"),
    ({"surprise": 1}, "surprise"),
])
def test_bad_configs_say_what_is_wrong(raw, message):
    with pytest.raises(ValueError, match=message):
        parse_device_config(raw, "cfg.yaml")


def test_unreadable_and_invalid_files(tmp_path):
    with pytest.raises(ValueError, match="cannot read device config"):
        load_device_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("mcp: [unclosed")
    with pytest.raises(ValueError, match="not valid YAML"):
        load_device_config(bad)
