"""The command line of `python -m flows.pretrain`: every PretrainConfig field as a flag, input errors as one
message each, and the exit codes (0 done, 1 failed, 2 bad input, 130 stopped) that `python -m flows.sweep`
shares.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import types
import typing
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from flows.pool.placement import PlacementError
from flows.pool.remote_train import SharedStorageError
from flows.pretrain_config import ConfigNote, PretrainConfig
from tasks.credentials import CredentialsError
from tasks.data.errors import DataError
from tasks.home import apply_embedded_defaults
from tasks.init_from import InitFromError
from tasks.training import TrainingInputError, TrainingInterrupted

# Exceptions that report a user's input (the message names the problem and the fix), not a failure.
BAD_INPUT_ERRORS: tuple[type[BaseException], ...] = (
    DataError,
    FileNotFoundError,
    InitFromError,
    PlacementError,
    SharedStorageError,
    TrainingInputError,
)


def _cli_type(annotation: Any) -> tuple[Any, bool]:
    """(argparse type, is_bool) for a field annotation such as `int | None` or `Literal[...]`; an optional
    field also takes `none` (`--max-steps none`)."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        kind, is_bool = _cli_type(args[0])
        return (kind if is_bool else _or_none(kind)), is_bool
    if origin is typing.Literal:
        return str, False
    if annotation is bool:
        return bool, True
    if annotation in (int, float, str):
        return annotation, False
    return _json_value, False


def _or_none(kind: Any) -> Any:
    def parse(text: str) -> Any:
        return None if text.lower() == "none" else kind(text)

    parse.__name__ = getattr(kind, "__name__", "value")  # argparse names the type in its error messages
    return parse


def _json_value(text: str) -> Any:
    return json.loads(text)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m flows.pretrain",
        description="Pretrain a Llama-style model: Prefect flow, MLflow tracking and registry.",
        argument_default=argparse.SUPPRESS,
    )
    parser.add_argument("--config", type=Path, help="YAML file of PretrainConfig fields (flags override it)")
    for name, field in PretrainConfig.model_fields.items():
        flag = "--" + name.replace("_", "-")
        kind, is_bool = _cli_type(field.annotation)
        choices = (
            typing.get_args(field.annotation)
            if typing.get_origin(field.annotation) is typing.Literal
            else None
        )
        default = field.default if field.default_factory is None else field.default_factory()
        help_text = f"{field.description or ''} (default: {default!r}, or the preset's)".strip()
        if is_bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, help=help_text)
        else:
            parser.add_argument(flag, type=kind, choices=choices, help=help_text, metavar=name.upper())
    return parser


def config_from_args(argv: list[str] | None = None) -> PretrainConfig:
    """The preset, then the YAML file, then the flags: each layer overrides the one before. A run length
    (max_steps or epochs) given by a layer replaces the one of the layers before."""
    parser = build_parser()
    args = vars(parser.parse_args(argv))
    values: dict[str, Any] = {}
    config_file = args.pop("config", None)
    if config_file is not None:
        if not config_file.is_file():
            parser.error(f"--config {config_file}: no such file")
        values.update(yaml.safe_load(config_file.read_text()) or {})
    if args.get("max_steps") is not None and "epochs" in args:
        parser.error(
            f"--max-steps {args['max_steps']} and --epochs {args['epochs']:g} both set the run length: give one "
            f"(--max-steps none --epochs {args['epochs']:g} trains for epochs)"
        )
    if "epochs" in args and "max_steps" not in args:
        values["max_steps"] = None
    values.update(args)
    return PretrainConfig(**values)


def describe_validation_error(err: ValidationError) -> str:
    """One line per problem, `field: message`, without pydantic's echo of the input and its docs link."""
    lines = []
    for problem in err.errors(include_url=False, include_input=False):
        where = ".".join(str(part) for part in problem["loc"])
        message = problem["msg"].removeprefix("Value error, ")
        lines.append(f"  {where}: {message}" if where else f"  {message}")
    return "\n".join(lines)


def end_quietly(message: str) -> None:
    """Print `message` as the last line: Prefect's shutdown chatter (stopping its temporary server at exit)
    is not logged after it."""
    logging.getLogger("prefect").setLevel(logging.WARNING)
    print(f"\n{message}", file=sys.stderr, flush=True)


def _config_or_none(argv: list[str] | None) -> PretrainConfig | None:
    """The configuration of `argv`, its notes printed; None (the problems printed) when it is invalid."""
    with warnings.catch_warnings(record=True) as notes:
        warnings.simplefilter("always", ConfigNote)
        try:
            config = config_from_args(argv)
        except ValidationError as err:
            print(f"invalid configuration:\n{describe_validation_error(err)}", file=sys.stderr)
            return None
    for note in notes:
        if issubclass(note.category, ConfigNote):
            print(f"note: {note.message}", file=sys.stderr)
        else:
            warnings.showwarning(note.message, note.category, note.filename, note.lineno)
    return config


def run_command(start: Callable[[PretrainConfig], object], argv: list[str] | None = None) -> int:
    """`start` the configuration of `argv`. Exit codes: 0 done, 1 failed, 2 bad input, 130 stopped. A failure
    ends the output with its message alone; its traceback is in Prefect's logs above it (and in the Prefect
    UI)."""
    try:
        apply_embedded_defaults()  # first: takes credentials out of the store URIs
    except CredentialsError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    config = _config_or_none(argv)
    if config is None:
        return 2
    try:
        start(config)
    except (KeyboardInterrupt, TrainingInterrupted) as err:
        end_quietly(f"stopped: {err or 'interrupted'}")
        return 130
    except Exception as err:
        end_quietly(f"error: {err}")
        return 2 if isinstance(err, BAD_INPUT_ERRORS) else 1
    return 0
