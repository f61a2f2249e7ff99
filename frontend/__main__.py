"""`python -m subway.frontend --config-json JSON`: run the frontend process alone."""

from __future__ import annotations

import argparse
import sys

from subway.frontend.server import run_frontend
from subway.ipc.config import EngineConfig


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m subway.frontend")
    parser.add_argument("--config-json", required=True, help="an EngineConfig as JSON")
    args = parser.parse_args(argv)
    return run_frontend(EngineConfig.from_json_arg(args.config_json))


if __name__ == "__main__":
    sys.exit(main())
