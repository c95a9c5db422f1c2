"""Run Codex CLI, unmodified, against Gyre's proxy: `python launch.py --prompt-file TASK --answer-file ANSWER`.

Codex reads its provider from `$CODEX_HOME/config.toml`; this writes one for a custom provider that speaks
the Responses API (`wire_api = "responses"`) at the proxy (`$OPENAI_BASE_URL`, token `$OPENAI_API_KEY`, both
set by the runner), then runs `codex exec` on the task in the current directory (the workspace) and writes
its last message to `--answer-file` if given. Codex is `--codex`, `$GYRE_CODEX`, `codex` on PATH, or the
install agents/codex/harness.toml names (/opt/codex).

The model's metadata (`model_catalog_json`) is the entry Codex itself ships for its models, renamed to the
policy's name, with a freeform `apply_patch` tool and the v1 sub-agent tools (a `namespace` group): the
shape Codex uses for its own models. Without it Codex falls back to generic metadata (it still runs). Stdlib
only: it runs inside the execution's sandbox with whatever Python the host has.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

_CATALOG_START = b'{\n  "models": ['


def native_binary(codex: Path) -> Path | None:
    """The Rust binary behind `codex` (npm installs a node wrapper beside a vendored binary)."""
    resolved = codex.resolve()
    with resolved.open("rb") as f:
        if f.read(4) == b"\x7fELF":
            return resolved
    modules = next((p for p in resolved.parents if p.name == "node_modules"), None)
    if modules is None:
        return None
    found = sorted(modules.glob("@openai/codex*/vendor/*/bin/codex")) + sorted(
        modules.glob("@openai/codex*/vendor/*/codex/codex")
    )
    return found[0] if found else None


def model_catalog(codex: Path, model: str, auto_compact_tokens: int | None = None) -> dict[str, Any] | None:
    """Codex's own metadata of a model that uses a freeform apply_patch tool, as `model`'s (compacting at
    `auto_compact_tokens` prompt tokens when given); None if the binary carries no catalog this can read."""
    binary = native_binary(codex)
    if binary is None:
        return None
    with binary.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:  # ~300 MB: not read
        at = data.find(_CATALOG_START)
        if at < 0:
            return None
        text = data[at : at + 4_000_000].decode("utf-8", "replace")
    try:
        catalog, _ = json.JSONDecoder(strict=False).raw_decode(text)
    except ValueError:
        return None
    models = [m for m in catalog.get("models", []) if m.get("apply_patch_tool_type") == "freeform"]
    if not models:
        return None
    entry = dict(models[-1])
    entry.pop("tool_mode", None)  # plain tools, not Codex's code mode
    entry.update(
        slug=model, display_name=model, description="The policy served by Gyre.", visibility="list",
        prefer_websockets=False, use_responses_lite=False, input_modalities=["text"],
        supports_reasoning_summaries=False, supports_reasoning_summary_parameter=False, support_verbosity=False,
        multi_agent_version="v1", supports_search_tool=False,
    )
    if auto_compact_tokens is not None:
        entry["auto_compact_token_limit"] = auto_compact_tokens
    return {"models": [entry]}


def write_config(codex_home: Path, *, codex: Path, base_url: str, model: str,
                 auto_compact_tokens: int | None = None) -> Path:
    codex_home.mkdir(parents=True, exist_ok=True)
    lines = [
        f"model = {json.dumps(model)}",
        'model_provider = "gyre"',
        'approval_policy = "never"',
    ]
    catalog = model_catalog(codex, model, auto_compact_tokens)
    if catalog is not None:
        path = codex_home / "gyre-models.json"
        path.write_text(json.dumps(catalog))
        lines.insert(0, f"model_catalog_json = {json.dumps(str(path))}")
    lines += [
        "",
        "[model_providers.gyre]",
        'name = "Gyre"',
        f"base_url = {json.dumps(base_url)}",
        'env_key = "OPENAI_API_KEY"',
        'wire_api = "responses"',
        "request_max_retries = 0",
        "stream_max_retries = 0",
    ]
    config = codex_home / "config.toml"
    config.write_text("\n".join(lines) + "\n")
    return config


def _installed() -> str | None:
    """Codex where agents/codex/harness.toml expects it (`npm install --prefix /opt/codex @openai/codex`)."""
    path = Path("/opt/codex/node_modules/.bin/codex")
    return str(path) if path.exists() else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompt-file", type=Path, required=True)
    parser.add_argument("--answer-file", type=Path)
    parser.add_argument("--model", default=os.environ.get("OPENAI_MODEL", "gyre-policy"))
    parser.add_argument("--base-url", default=os.environ.get("OPENAI_BASE_URL"))
    parser.add_argument("--codex", default=os.environ.get("GYRE_CODEX") or shutil.which("codex") or _installed())
    parser.add_argument("--auto-compact-tokens", type=int, help="compact Codex's context above this many tokens")
    parser.add_argument("--sandbox", default="danger-full-access",
                        help="Codex's own sandbox mode (Gyre's sandbox already fences the execution)")
    args = parser.parse_args(argv)
    if not args.codex:
        parser.error("codex not found: pass --codex, set GYRE_CODEX or put codex on PATH")
    if not args.base_url:
        parser.error("no proxy URL: pass --base-url or set OPENAI_BASE_URL")
    codex = Path(args.codex)
    home = Path(os.environ.get("CODEX_HOME") or Path(os.environ.get("HOME", ".")) / ".codex")
    write_config(home, codex=codex, base_url=args.base_url, model=args.model,
                 auto_compact_tokens=args.auto_compact_tokens)
    command = [str(codex), "exec", "--skip-git-repo-check", "--sandbox", args.sandbox, "--color", "never"]
    if args.answer_file is not None:
        command += ["--output-last-message", str(args.answer_file)]
    command.append(args.prompt_file.read_text())
    done = subprocess.run(command, env={**os.environ, "CODEX_HOME": str(home)}, stdin=subprocess.DEVNULL,
                          check=False)
    return done.returncode


if __name__ == "__main__":
    sys.exit(main())
