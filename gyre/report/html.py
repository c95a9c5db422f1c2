"""The report page: one self-contained HTML file (inline CSS, inline data, inline SVG plotting script).

Nothing is fetched when the page is viewed: the plotting script (``plots.js``, beside this module) ships
in the package and is inlined, and the data is a JSON block the script reads.
"""

import html
import json
from importlib.resources import files
from pathlib import Path
from typing import Any

from gyre.report.data import report_data

CSS = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 24px auto; max-width: 1200px; color: #222; padding: 0 12px; }
h1 { font-size: 22px; margin-bottom: 4px; } h2 { font-size: 17px; margin-top: 28px; border-bottom: 1px solid #ddd; }
.grid { display: grid; grid-template-columns: repeat(auto-fit, minmax(440px, 1fr)); gap: 14px 22px; }
figure { margin: 0; } figcaption { font-size: 13px; color: #555; margin: 4px 0 2px; }
.facts { border-collapse: collapse; } .facts td { padding: 2px 14px 2px 0; } .facts td:first-child { color: #666; }
.empty, .error { color: #999; font-style: italic; } .error { color: #b00; }
"""


def _plot(plot_id: str, caption: str) -> str:
    return (f'<figure><figcaption>{html.escape(caption)}</figcaption>'
            f'<div class="plot" data-plot="{html.escape(plot_id)}"></div></figure>')


def render(data: dict[str, Any]) -> str:
    """The page for ``report_data`` output."""
    run, rollouts = data["run"], data["rollouts"]
    heldout = data["heldout"]
    statuses = ", ".join(f"{k} {v}" for k, v in rollouts["statuses"].items())
    facts = [
        ("run", f"{run['name']} ({run['run_id']})"),
        ("status", run["status"]),
        ("scheduler policy", run["policy"]),
        ("train steps", run["steps"]),
        ("wall time", f"{run['duration_s']:.1f} s"),
        ("rollouts finished", f"{rollouts['count']} ({statuses})"),
    ]
    if heldout.get("pass_rate"):
        rates = [r for r in heldout["pass_rate"] if r is not None]
        if rates:
            facts.append(("held-out pass rate", f"{rates[0]:.1%} → {rates[-1]:.1%} (first → last)"))
    if rollouts["slowest_share_of_time"] is not None:
        facts.append((f"slowest {1 - rollouts['quantile']:.0%} of rollouts",
                      f"{rollouts['slowest_share_of_time']:.1%} of all rollout time"))
    rows = "".join(f"<tr><td>{html.escape(k)}</td><td>{html.escape(str(v))}</td></tr>" for k, v in facts)
    metrics = "".join(_plot(f"metric-{m['id']}", m["title"]) for m in data["metrics"])
    payload = json.dumps(data, allow_nan=False, default=str).replace("</", "<\\/")
    script = files("gyre.report").joinpath("plots.js").read_text()
    title = html.escape(f"Gyre run report: {run['name'] or run['run_id'] or 'run'}")
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title>
<meta name="viewport" content="width=device-width, initial-scale=1"><style>{CSS}</style></head>
<body>
<h1>{title}</h1>
<table class="facts">{rows}</table>
<h2>Rewards</h2>
<div class="grid">
{_plot("reward", "training reward per policy version")}
{_plot("heldout", "held-out evaluation: pass rate and mean reward of the policy")}
</div>
<h2>Training metrics (one point per step)</h2>
<div class="grid">{metrics}
{_plot("tokens", "tokens forwarded (shared prefixes once) vs trained (policy tokens)")}
</div>
<h2>Cells and rollouts</h2>
<div class="grid">
{_plot("roles", "each cell's role over time, with the rollout watermark (right axis)")}
{_plot("switches", "role-switch durations")}
{_plot("cdf", "rollout duration CDF (training rollouts)")}
{_plot("tail", f"tail share: part of each batch's rollout span spent waiting for its last "
               f"{1 - rollouts['quantile']:.0%} of rollouts")}
</div>
<script type="application/json" id="gyre-data">{payload}</script>
<script>{script}</script>
</body></html>
"""


def write_report(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write ``run_dir``/report.html (or ``out``) from the log in ``run_dir``/log; returns its path."""
    from gyre.errors import ConfigError

    run_dir = Path(run_dir)
    log = run_dir / "log"
    if not log.is_dir():
        raise ConfigError(f"no log at {log}: RUN_DIR is the run directory that holds log/ (the config's run_dir)")
    target = Path(out) if out is not None else run_dir / "report.html"
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_text(render(report_data(log)), encoding="utf-8")
    tmp.replace(target)
    return target
