"""Run opencode (npm `opencode-ai`), unmodified, against Gyre's proxy: `python launch.py --prompt-file TASK`.

Writes opencode's global config in the execution's HOME (`~/.config/opencode/opencode.json`): one provider,
`gyre`, at the proxy (`$OPENAI_BASE_URL`, token `$OPENAI_API_KEY`, both set by the runner) through the AI SDK
package opencode bundles — `@ai-sdk/openai-compatible` (Chat Completions, `--api chat`) or `@ai-sdk/openai`
(the Responses API, `--api responses`) — then runs `opencode run` on the task in the workspace. Nothing is
fetched: models.dev, LSP downloads, default plugins and updates are off; session titles (a second, concurrent
model call per session) are off. opencode is `--opencode`, `$GYRE_OPENCODE`, `opencode` on PATH, or the
install agents/opencode/harness.toml names (/opt/opencode). Stdlib only.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

PACKAGES = {"chat": "@ai-sdk/openai-compatible", "responses": "@ai-sdk/openai"}
OFFLINE = {
    "OPENCODE_DISABLE_MODELS_FETCH": "1",
    "OPENCODE_DISABLE_AUTOUPDATE": "1",
    "OPENCODE_DISABLE_LSP_DOWNLOAD": "1",
    "OPENCODE_DISABLE_DEFAULT_PLUGINS": "1",
}


def config(base_url: str, model: str, api: str, context: int | None = None) -> dict[str, Any]:
    """opencode's config; `context`: the model's context length as opencode sees it (it compacts near it)."""
    entry: dict[str, Any] = {"name": model, "tool_call": True}
    if context is not None:
        entry["limit"] = {"context": context, "output": min(4096, context // 8)}
    return {
        "$schema": "https://opencode.ai/config.json",
        "provider": {
            "gyre": {
                "npm": PACKAGES[api],
                "name": "Gyre",
                "options": {"baseURL": base_url, "apiKey": "{env:OPENAI_API_KEY}"},
                "models": {model: entry},
            }
        },
        "model": f"gyre/{model}",
        "small_model": f"gyre/{model}",
        "autoupdate": False,
        "share": "disabled",
        "agent": {"title": {"disable": True}},
    }


def write_config(home: Path, *, base_url: str, model: str, api: str, context: int | None = None) -> Path:
    path = home / ".config" / "opencode" / "opencode.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(config(base_url, model, api, context), indent=1))
    return path


def _installed() -> str | None:
    path = Path("/opt/opencode/node_modules/.bin/opencode")
    return str(path) if path.exists() else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompt-file", type=Path, required=True)
    parser.add_argument("--model", default=os.environ.get("OPENAI_MODEL", "gyre-policy"))
    parser.add_argument("--base-url", default=os.environ.get("OPENAI_BASE_URL"))
    parser.add_argument("--api", choices=sorted(PACKAGES), default="chat")
    parser.add_argument("--context", type=int, help="the context length opencode compacts near")
    parser.add_argument("--opencode", default=os.environ.get("GYRE_OPENCODE") or shutil.which("opencode")
                        or _installed())
    args = parser.parse_args(argv)
    if not args.opencode:
        parser.error("opencode not found: pass --opencode, set GYRE_OPENCODE or put opencode on PATH")
    if not args.base_url:
        parser.error("no proxy URL: pass --base-url or set OPENAI_BASE_URL")
    home = Path(os.environ.get("HOME", "."))
    write_config(home, base_url=args.base_url, model=args.model, api=args.api, context=args.context)
    done = subprocess.run([args.opencode, "run", args.prompt_file.read_text()], env={**os.environ, **OFFLINE},
                          stdin=subprocess.DEVNULL, check=False)
    return done.returncode


if __name__ == "__main__":
    sys.exit(main())
