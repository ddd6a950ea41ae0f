"""The ``cpvlm`` command: ``cpvlm train``, ``cpvlm prepare``, ``cpvlm verify``, ``cpvlm export``.

A subcommand is a module with ``main(argv) -> exit code`` that parses its own flags; it is
imported only when it runs, so ``cpvlm train --help`` and flag errors do not wait for torch.
Add one by listing it in ``SUBCOMMANDS``.
"""

from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMANDS = {
    "train": (
        "cpvlm.train.command",
        "train a VLM with context parallelism (synthetic data by default)",
    ),
    "prepare": (
        "cpvlm.train.prepare",
        "tokenize and plan a dataset once, for cpvlm train --data FOLDER",
    ),
    "verify": (
        "cpvlm.verify",
        "check the CP loss and gradients of a model against the one-process run",
    ),
    "export": (
        "cpvlm.export",
        "write a trained run's checkpoint as a Hugging Face model directory",
    ),
    "plan": (
        "cpvlm.simulate.command",
        "which cp/dp/attn/checkpointing fit G GPUs, from the real step simulated on fake tensors",
    ),
}


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The subcommands' help: the description as written, and every flag's default (a flag
    whose default is derived, or nothing, says so in its own help instead)."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False or action.default in ("", []):
            return action.help
        return super()._get_help_string(action)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cpvlm",
        description="Context-parallel training of vision-language models, with exact gradients.",
        epilog="Run 'cpvlm COMMAND --help' for a command's flags.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (_, text) in SUBCOMMANDS.items():
        sub.add_parser(name, help=text, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in SUBCOMMANDS:
        _parser().parse_args(argv[:1])  # prints the usage (or help) and exits
        return 2
    module = importlib.import_module(SUBCOMMANDS[argv[0]][0])
    return module.main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
