"""The `pretrain` flow: tokenizer → packed dataset → model → train → evaluate → register.

Composition and parameter validation only; the work lives in `tasks/`.

    python -m flows.pretrain --preset tiny
    python -m flows.pretrain --config run.yaml --max-steps 500 --no-compile

    from flows.pretrain import pretrain, PretrainConfig
    result = pretrain(PretrainConfig(preset="tiny"))
"""

from __future__ import annotations

import argparse
import sys
import types
import typing
import uuid
import warnings
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger
from prefect.exceptions import TerminationSignal
from pydantic import ValidationError

from flows.data import build_data, keep_tokenizer, tokenizer_for
from flows.pool.placement import check_placement, train_where_placed
from flows.pool.remote_train import FLOW_TIMEOUT_S
from flows.pretrain_config import ConfigNote, PretrainConfig
from flows.result import PretrainResult, print_summary
from tasks.build import build_model_task
from tasks.evaluate import evaluate_task
from tasks.home import apply_embedded_defaults, runs_dir
from tasks.init_from import resolve_for_run_task
from tasks.register import register_task
from tasks.registry import lineage
from tasks.tracking import checkpoints, report, runs, store
from tasks.training import TrainingInterrupted


def _run_identity(config: PretrainConfig) -> tuple[str, str]:
    """(MLflow run name, run directory key): the flow run's name and id when there is one."""
    from prefect.runtime import flow_run

    if flow_run.id is not None:
        return config.run_name or flow_run.name, str(flow_run.id)
    key = uuid.uuid4().hex
    return config.run_name or f"run-{key[:8]}", key


def _end_runs_left_running(experiment: str, uri: str, log: Any) -> None:
    """End the MLflow runs of `experiment` whose flow run is over, which nothing ended (a lost worker)."""
    try:
        ended = runs.end_runs_of_finished_flow_runs(experiment, uri)
    except Exception as err:  # housekeeping: never the reason a run fails
        log.warning(f"could not look for MLflow runs left RUNNING by flow runs that are over: {err}")
        return
    for run_id, status in ended.items():
        log.info(f"MLflow run {run_id} was left RUNNING by a flow run that is over: ended {status}")


@flow(
    name="pretrain",
    log_prints=True,
    validate_parameters=True,
    timeout_seconds=FLOW_TIMEOUT_S,
    on_crashed=[runs.end_runs_hook("FAILED")],
    on_cancellation=[runs.end_runs_hook("KILLED")],
)
def pretrain(config: PretrainConfig = PretrainConfig()) -> PretrainResult:  # noqa: B008 (a frozen default)
    """Pretrain a Llama-style model and register it in MLflow. See `PretrainConfig` for every option."""
    apply_embedded_defaults()
    log = get_run_logger()
    uri = store.check_tracking_store()  # fails here, in seconds, when the store is unreachable
    check_placement(config)
    _end_runs_left_running(config.experiment, uri, log)
    run_name, run_key = _run_identity(config)
    # A retry of this flow run reuses its directory and resumes; another run never shares it.
    run_dir = config.checkpoint_dir or str(runs_dir() / run_key)

    # The parent (init_from), resolved once, here: an alias is pinned to its version for every later stage
    # and node; a retry or a resumed rerun of this run directory keeps what its start resolved.
    parent = resolve_for_run_task(config.init_from, run_dir)
    tokenizer, model_config = tokenizer_for(config, parent)  # both checked before any data work
    dataset = build_data(config, tokenizer)
    model = build_model_task(model_config, seed=config.seed, parent=parent)
    keep_tokenizer(run_dir, tokenizer)
    start = f"from {parent.pinned}" if parent else "from scratch"
    log.info(
        f"model: {model.n_params / 1e6:.2f}M parameters {start}; data: {dataset.train_tokens:,} training tokens"
    )

    # One flow run, one MLflow run: a retry finds its run by the flow-run tag, a rerun that resumes a
    # checkpoint directory continues the run recorded there.
    opened = runs.open_run(config.experiment, run_name, run_dir=run_dir, tags=runs.flow_run_tags(), uri=uri)
    run_id = opened.run_id
    if opened.continued:
        log.info(f"continuing MLflow run {run_id} ({opened.continued})")
    report.link_mlflow_run(run_id, uri)
    try:
        store.log_params(run_id, {**config.model_dump(), "model_config": model_config}, uri)
        store.log_datasets(run_id, dataset, uri)
        if parent is not None:
            lineage.log_parent(run_id, parent, uri)  # the parent's logged model as a run input
        checkpoint = train_where_placed(config, model, dataset, run_dir, run_id)
        evaluation = evaluate_task(
            checkpoint,
            dataset,
            tokenizer,
            initial_model=model,
            max_blocks=config.eval_max_blocks,
            num_samples=config.num_samples,
            max_new_tokens=config.sample_max_new_tokens,
            seed=config.seed,
            device=config.device,
            dtype=config.dtype,
        )
        # Each scored checkpoint as a logged model with its validation metrics linked, then the rest.
        checkpoints.log_checkpoint_models(run_id, evaluation, dataset, uri)
        report.log_evaluation(run_id, evaluation, checkpoint=checkpoint, uri=uri)
        # The store is the environment's (as here), never a task parameter: its URI may hold credentials.
        registered = register_task(
            run_id=run_id,
            checkpoint=checkpoint,
            tokenizer=tokenizer,
            dataset=dataset,
            eval_result=evaluation,
            model_name=config.model_name,
            alias=config.alias,
            promotion=config.promotion,
            eval_device=config.device,
            lineage_tags=lineage.version_tags(
                parent,
                tokens_seen=checkpoint.tokens_seen,
                tokenizer=tokenizer,
                parent_bits_per_byte=evaluation.initial_bits_per_byte if parent else None,
            ),
        )
    except BaseException as err:
        stopped = isinstance(err, KeyboardInterrupt | TrainingInterrupted | TerminationSignal)
        store.end_run(run_id, "KILLED" if stopped else "FAILED", uri)
        raise
    store.end_run(run_id, "FINISHED", uri)

    metrics = {
        **checkpoint.metrics,
        "bits_per_byte": evaluation.bits_per_byte,
        "xz_bits_per_byte": evaluation.xz_bits_per_byte,
        "val_loss": evaluation.val_loss,
        "val_perplexity": evaluation.perplexity,
    }
    result = PretrainResult(
        run_id=run_id,
        model_uri=registered.uri,
        registered=registered,
        evaluation=evaluation,
        checkpoint=checkpoint,
        tokenizer=tokenizer,
        dataset=dataset,
        metrics=metrics,
        tracking_uri=store.redact_uri(uri),
        model=model,
        parent=parent,
    )
    report.publish_summary(result.model_dump(mode="json"))
    print_summary(result)
    return result


# ---------------------------------------------------------------- command line


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
    import json

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
        import yaml

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


def _bad_input_errors() -> tuple[type[BaseException], ...]:
    """Exceptions that report a user's input (the message names the problem and the fix), not a failure."""
    from flows.pool.placement import PlacementError
    from flows.pool.remote_train import SharedStorageError
    from tasks.data.errors import DataError
    from tasks.init_from import InitFromError
    from tasks.training import TrainingInputError

    return (
        DataError,
        FileNotFoundError,
        InitFromError,
        PlacementError,
        SharedStorageError,
        TrainingInputError,
    )


def main(argv: list[str] | None = None) -> int:
    """Exit codes: 0 done, 1 failed, 2 bad input, 130 stopped. A failure ends the output with its message
    alone; its traceback is in Prefect's logs above it (and in the Prefect UI)."""
    from tasks.credentials import CredentialsError

    try:
        apply_embedded_defaults()  # first: takes credentials out of the store URIs
    except CredentialsError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    with warnings.catch_warnings(record=True) as notes:
        warnings.simplefilter("always", ConfigNote)
        try:
            config = config_from_args(argv)
        except ValidationError as err:
            print(f"invalid configuration:\n{describe_validation_error(err)}", file=sys.stderr)
            return 2
    for note in notes:
        if issubclass(note.category, ConfigNote):
            print(f"note: {note.message}", file=sys.stderr)
        else:
            warnings.showwarning(note.message, note.category, note.filename, note.lineno)
    try:
        pretrain(config)
    except (KeyboardInterrupt, TrainingInterrupted) as err:
        _end_quietly(f"stopped: {err or 'interrupted'}")
        return 130
    except Exception as err:
        _end_quietly(f"error: {err}")
        return 2 if isinstance(err, _bad_input_errors()) else 1
    return 0


def describe_validation_error(err: ValidationError) -> str:
    """One line per problem, `field: message`, without pydantic's echo of the input and its docs link."""
    lines = []
    for problem in err.errors(include_url=False, include_input=False):
        where = ".".join(str(part) for part in problem["loc"])
        message = problem["msg"].removeprefix("Value error, ")
        lines.append(f"  {where}: {message}" if where else f"  {message}")
    return "\n".join(lines)


def _end_quietly(message: str) -> None:
    """Print `message` as the last line: Prefect's shutdown chatter (stopping its temporary server at exit)
    is not logged after it."""
    import logging

    logging.getLogger("prefect").setLevel(logging.WARNING)
    print(f"\n{message}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
