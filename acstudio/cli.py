"""Command line: ``acstudio`` (no arguments: the desktop app) and ``acstudio SUBCOMMAND`` for the engine.

Every subcommand is a thin wrapper over an engine function; user errors (:class:`ACStudioError`) print one
clear line and exit with status 2, Ctrl-C cancels cleanly with status 130.
"""

from __future__ import annotations

import argparse
import shlex
import sys

from acstudio import __version__
from acstudio.errors import ACStudioError, Cancelled
from acstudio.jobs import CancelToken, TerminalProgress


def _parse_config(items: list[str]) -> tuple[tuple[str, str], ...]:
    out = []
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ACStudioError(f"--config expects key=value, got {item!r}")
        out.append((key.strip(), value.strip()))
    return tuple(out)


def _add_workload_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="zoo name (see `acstudio models`) or path/to/file.py:factory")
    p.add_argument("--batch-size", "-b", type=int, required=True)
    p.add_argument("--optimizer", default="adam", choices=["sgd", "adam", "adamw"])
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--image-size", type=int, default=224, help="torchvision models (default 224)")
    p.add_argument("--seq-len", type=int, default=512, help="transformers models (default 512)")
    p.add_argument("--config", action="append", default=[], metavar="KEY=VALUE",
                   help="override a model config field (repeatable), e.g. --config num_hidden_layers=2")


def _spec(args):
    from acstudio.workload import WorkloadSpec

    return WorkloadSpec(args.model, args.batch_size, optimizer=args.optimizer, precision=args.precision,
                        image_size=args.image_size, seq_len=args.seq_len, config=_parse_config(args.config))


def cmd_models(args) -> int:
    from acstudio.workload import list_models

    for family, names in list_models().items():
        print(f"{family} ({len(names)}):")
        print("  " + "\n  ".join(names))
    print("custom: path/to/file.py:factory or package.module:factory (see README)")
    return 0


def cmd_profile(args) -> int:
    from acstudio.profile.profiler import profile_workload

    def format_bytes(n: int) -> str:
        return f"{n / 2**20:.0f} MiB"

    spec = _spec(args)
    command = "acstudio " + shlex.join(sys.argv[1:]) if sys.argv[1:2] == ["profile"] else None
    profile = profile_workload(spec, args.device, iterations=args.iterations, progress=TerminalProgress(),
                               cancel=args.cancel, command=command)
    profile.save(args.out)
    if args.csv:
        profile.export_csv(args.csv)
    node = profile.node_by_id[profile.peak_node]
    print(f"{profile.label}: {len(profile.nodes)} nodes, {len(profile.activations)} activations "
          f"({sum(a.recomputable for a in profile.activations)} recomputable)")
    print(f"measured peak {format_bytes(profile.peak_bytes)} at {node.id} ({node.target}, {node.region}); "
          f"iteration {profile.iteration_ms:.1f} ms")
    print("at the peak: " + ", ".join(f"{k} {format_bytes(v)}" for k, v in profile.peak_breakdown.items() if v))
    print(f"saved {args.out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="acstudio",
        description="Measure a whole PyTorch training step, plan activation checkpointing (mu-TWO), rewrite it. "
                    "Without a subcommand: open the desktop app (optionally on FILE).")
    parser.add_argument("--version", action="version", version=f"acstudio {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("models", help="list the models that can be loaded")
    p.set_defaults(func=cmd_models)

    p = sub.add_parser("profile", help="capture and profile one training iteration")
    _add_workload_args(p)
    p.add_argument("--device", default="cuda", help="cuda or cpu (default cuda)")
    p.add_argument("--iterations", type=int, default=3, help="measured iterations, median kept (default 3)")
    p.add_argument("--out", "-o", required=True, help="profile file (.json or .json.gz)")
    p.add_argument("--csv", metavar="DIR", help="also write nodes.csv and activations.csv into DIR")
    p.set_defaults(func=cmd_profile)
    return parser


GUI_FLAGS = ("--screenshot",)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    commands = set(parser._subparsers._group_actions[0].choices)
    if not argv or (argv[0] not in commands and argv[0] not in ("-h", "--help", "--version")):
        if argv and argv[0].startswith("-") and argv[0] not in GUI_FLAGS:
            parser.error(f"unknown option {argv[0]}")
        from acstudio.gui.app import main as gui_main

        return gui_main(argv)
    args = parser.parse_args(argv)
    args.cancel = CancelToken()
    try:
        return args.func(args)
    except KeyboardInterrupt:
        args.cancel.cancel()
        print("\ncancelled", file=sys.stderr)
        return 130
    except Cancelled as exc:
        print(f"acstudio: {exc}", file=sys.stderr)
        return 130
    except ACStudioError as exc:
        print(f"acstudio: error: {exc}", file=sys.stderr)
        return 2


