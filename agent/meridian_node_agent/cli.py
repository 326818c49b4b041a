"""``meridian-node``: the agent's command line. Each verb lives in a module of its own."""

import argparse
import sys

from meridian_node_agent import __version__, agent_cli, apply_cli, artifact_cli, config_cli, trust_cli
from meridian_node_agent.config import default_config_path
from meridian_node_agent.usage import UsageError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="meridian-node",
        description="The meridian.node pull agent and its operator tools.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument(
        "--config",
        default=default_config_path(),
        metavar="PATH",
        help="the agent's config file (default: $MERIDIAN_NODE_CONFIG or /etc/meridian-node/config.yaml)",
    )
    subparsers = parser.add_subparsers(dest="verb", required=True, metavar="VERB")
    artifact_cli.add_parsers(subparsers)
    config_cli.add_parsers(subparsers)
    trust_cli.add_parsers(subparsers)
    agent_cli.add_parsers(subparsers)
    apply_cli.add_parsers(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        status: int = args.handler(args)
    except UsageError as exc:
        print(f"meridian-node {args.verb}: error: {exc}", file=sys.stderr)
        return 2
    return status


if __name__ == "__main__":
    sys.exit(main())
