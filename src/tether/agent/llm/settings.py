"""Which LLM tether uses and how it calls it: `LLMSettings`, read from `TETHER_LLM_*` or the config file's
`llm:` section (`resolve_llm_settings`), and what to tell a person when none is configured (`how_to_configure`)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

ENV_BASE_URL = "TETHER_LLM_BASE_URL"
ENV_MODEL = "TETHER_LLM_MODEL"
ENV_API_KEY = "TETHER_LLM_API_KEY"
ENV_OPENAI_API_KEY = "OPENAI_API_KEY"
ENV_CONFIG = "TETHER_CONFIG"


OutputMode = Literal["auto", "json_schema", "json_object", "grammar", "tools", "plain"]


class LLMSettings(BaseModel):
    """Where the LLM is and how to call it."""

    model_config = ConfigDict(extra="forbid")

    base_url: str = Field(..., min_length=1)
    model: str = Field(..., min_length=1)
    api_key: str | None = Field(default=None, repr=False)
    timeout: float = Field(default=60.0, gt=0, description=(
        "seconds one exchange with the LLM may take in all (a wall-clock limit: every retry and output-mode "
        "fallback included, streamed or not)"))
    max_retries: int = Field(default=1, ge=0, description=(
        "retries of a call that failed for a passing reason (unreachable, HTTP 408/429/5xx), within `timeout`"))
    temperature: float = Field(default=0.0, ge=0)
    max_tokens: int = Field(default=1024, gt=0, description=(
        "the most tokens one reply may have (sent as `max_tokens` with every plan, answer and recovery "
        "call; a sampling request's own `maxTokens` is sent as asked)"))
    plan_graph: bool = Field(default=True, description=(
        "offer the planner graphs (a step's `id`, `needs` and `when`, explained in the prompt and part of "
        "the plan's schema); false asks for a chain of steps only, which small models write far better"))
    plan_compact: bool = Field(default=False, description=(
        "plan with a short prompt for small models: only the skills that best match the request's words, "
        "their required arguments plus those the request names, paths limited to the ones the request "
        "writes, and always a chain (no graph, observe rounds or answer)"))
    output_mode: OutputMode = Field(default="auto", description=(
        "how a structured reply (a plan) is asked for: `json_schema` (strict, the skills as an enum with "
        "their own arguments), `json_object`, `grammar` (llama.cpp's GBNF `grammar` field), `tools` (a "
        "forced function call), `plain` (the schema in the prompt only), or `auto`: those in that order. "
        "A server that refuses a mode (an HTTP error naming the format, or 400/422/500 before the mode "
        "ever worked) gets the next one, and the client keeps using the mode that worked"))

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> LLMSettings | None:
        """Settings from `TETHER_LLM_*` (key also from `OPENAI_API_KEY`); None when not configured."""
        env = os.environ if env is None else env
        base_url = (env.get(ENV_BASE_URL) or "").strip()
        model = (env.get(ENV_MODEL) or "").strip()
        if not base_url or not model:
            return None
        api_key = (env.get(ENV_API_KEY) or env.get(ENV_OPENAI_API_KEY) or "").strip() or None
        return cls(base_url=base_url, model=model, api_key=api_key)


def default_config_path(env: Mapping[str, str] | None = None) -> Path:
    """$TETHER_CONFIG, else $XDG_CONFIG_HOME/tether/config.yaml (~/.config/tether/config.yaml)."""
    env = os.environ if env is None else env
    if env.get(ENV_CONFIG):
        return Path(env[ENV_CONFIG]).expanduser()
    base = env.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "tether" / "config.yaml"


class _LLMSection(LLMSettings):
    """The config file's `llm:` section: the settings, plus the name of a variable holding the key
    (better than the key itself in a file)."""

    api_key_env: str | None = None


def resolve_llm_settings(path: str | os.PathLike[str] | None = None,
                         env: Mapping[str, str] | None = None) -> LLMSettings | None:
    """The LLM to use: `TETHER_LLM_*` in the environment win, else the `llm:` section of the config
    file (`path`, or `default_config_path()`), else None. A broken file is an error naming it."""
    env = os.environ if env is None else env
    from_env = LLMSettings.from_env(env)
    if from_env is not None:
        return from_env
    file = Path(path).expanduser() if path is not None else default_config_path(env)
    if not file.is_file():
        if path is not None:
            raise ValueError(f"config file {file} does not exist")
        if env.get(ENV_CONFIG):  # named on purpose: never silently ignored
            raise ValueError(f"{ENV_CONFIG} names {file}, which does not exist (unset it to use no config file)")
        return None
    import yaml  # only with a config file: a server without one does not import it

    from tether import yaml12

    try:
        data = yaml12.safe_load(file.read_text(encoding="utf-8")) or {}
    except OSError as exc:
        raise ValueError(f"cannot read config file {file}: {exc.strerror or exc}") from None
    except (UnicodeDecodeError, yaml.YAMLError) as exc:
        raise ValueError(f"config file {file} is not valid YAML: {yaml12.where_and_why(exc)}") from None
    if not isinstance(data, dict):
        raise ValueError(f"config file {file} must be a mapping with an 'llm:' section")
    if data.get("llm") is None:
        return None
    try:
        section = _LLMSection.model_validate(data["llm"])
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'llm'}: {e['msg']}" for e in exc.errors())
        raise ValueError(f"{file}: llm: {problems}") from None
    key = section.api_key
    if section.api_key_env:
        key = env.get(section.api_key_env) or None
        if key is None:
            raise ValueError(f"{file}: llm.api_key_env names {section.api_key_env}, which is not set")
    values = section.model_dump(exclude={"api_key", "api_key_env"})
    return LLMSettings(**values, api_key=key or env.get(ENV_API_KEY) or env.get(ENV_OPENAI_API_KEY) or None)


def how_to_configure() -> str:
    """What to tell a person who asked for planning with no LLM configured."""
    return (
        "No LLM is configured, so tether cannot plan a request written in plain words.\n"
        "Point tether at any OpenAI-compatible endpoint with these environment variables:\n"
        f"  {ENV_BASE_URL}   the endpoint's base URL (ending in /v1)\n"
        f"  {ENV_MODEL}      the model name\n"
        f"  {ENV_API_KEY}    the API key, if the endpoint needs one (or {ENV_OPENAI_API_KEY})\n"
        "\n"
        "For example, a local Ollama (https://ollama.com):\n"
        "  ollama pull llama3.1\n"
        f"  export {ENV_BASE_URL}=http://127.0.0.1:11434/v1\n"
        f"  export {ENV_MODEL}=llama3.1\n"
        "\n"
        "or OpenAI:\n"
        f"  export {ENV_BASE_URL}=https://api.openai.com/v1\n"
        f"  export {ENV_MODEL}=gpt-4o-mini\n"
        f"  export {ENV_OPENAI_API_KEY}=sk-...\n"
        "\n"
        f"or the same in the config file ({default_config_path()} or ${ENV_CONFIG}):\n"
        "  llm:\n"
        "    base_url: http://127.0.0.1:11434/v1\n"
        "    model: llama3.1\n"
        "    api_key_env: OPENAI_API_KEY     # optional: the variable holding the key\n"
        "\n"
        "Without any LLM, `tether run --plan plan.yaml` runs a plan written by hand\n"
        "(a list of steps: skill, args, description, device) with the same execution and recovery."
    )
