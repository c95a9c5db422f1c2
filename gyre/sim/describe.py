"""``python -m gyre.sim.describe SCENARIO``: write a workload's per-call description (``gyre.sim.calls``), the
file the scenario agent (``agents/scenario_agent``) replays one execution of."""

import argparse
import json
import sys
from pathlib import Path

from gyre.errors import ConfigError
from gyre.sim.calls import describe_workload
from gyre.sim.scenario import load_scenario
from gyre.sim.workload import sample_workload


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gyre.sim.describe", description="Write a scenario's per-call "
                                     "workload description (JSON) for a scenario harness.")
    parser.add_argument("scenario", help="scenario name or file")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--time-scale", type=float, default=1.0, help="the harness sleeps wait_s / time_scale")
    parser.add_argument("--token-scale", type=float, default=1.0,
                        help="the harness asks for output_tokens / token_scale tokens")
    parser.add_argument("--chars-per-token", type=float, default=1.0, help="filler characters per prompt token")
    parser.add_argument("--out", type=Path, default=None, help="file to write (default: stdout)")
    args = parser.parse_args(argv)
    try:
        scenario = load_scenario(args.scenario)
        seed = scenario.seed if args.seed is None else args.seed
        out = describe_workload(scenario, sample_workload(scenario, seed, args.steps), seed,
                                time_scale=args.time_scale, token_scale=args.token_scale,
                                chars_per_token=args.chars_per_token)
    except (ConfigError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    text = json.dumps(out)
    if args.out is None:
        print(text)
    else:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
