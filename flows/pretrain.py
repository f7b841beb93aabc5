"""The `pretrain` flow: tokenizer → packed dataset → model → train → evaluate → register.

Composition only: the stages run in order in `pretrain`; the work lives in `tasks/`, the command line in
`flows/cli.py`.

    python -m flows.pretrain --preset tiny
    python -m flows.pretrain --config run.yaml --max-steps 500 --no-compile

    from flows.pretrain import pretrain, PretrainConfig
    result = pretrain(PretrainConfig(preset="tiny"))
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Iterator

from prefect import flow, get_run_logger, task
from prefect.exceptions import TerminationSignal
from prefect.runtime import flow_run

from flows import cli
from flows.pool.placement import check_placement, train_where_placed
from flows.pool.remote_train import FLOW_TIMEOUT_S
from flows.pretrain_config import PretrainConfig, describe_shape
from flows.result import PretrainResult, print_summary
from flows.run_budget import budget_terms, run_plan
from model import LlamaConfig
from tasks import home, refs
from tasks.build import build_model, parent_config
from tasks.evaluate import evaluate_task
from tasks.home import apply_embedded_defaults, runs_dir
from tasks.init_from import resolve_for_run_task
from tasks.init_from.optimizer import check_parent_optimizer_task
from tasks.init_from.vocab import check_positions
from tasks.prepare_data import build_data, keep_tokenizer, parent_split, prepare_tokenizer
from tasks.register import register_task
from tasks.registry import lineage
from tasks.tracking import checkpoints, report, runs, store
from tasks.training import TrainingInterrupted
from tasks.training.budget import format_duration

# The engine-side build stays free of Prefect (benchmarks/gpu_check.py runs where Prefect is not installed).
build_model_task = task(build_model, name="build_model")


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
    started = time.time()  # a time_budget counts from here
    uri, run_name, run_dir = _set_up(config)
    # The parent (init_from), resolved once, here: an alias is pinned to its version for every later stage
    # and node; a retry or a resumed rerun of this run directory keeps what its start resolved.
    parent = resolve_for_run_task(config.init_from, run_dir)
    tokenizer, model_config = tokenizer_for(config, parent)  # both checked before any data work
    optimizer_state = _parent_optimizer(config, parent, model_config, run_dir)
    data = parent_split(config.data_settings(), parent, run_dir)  # once validation, always validation
    dataset = build_data(data, tokenizer, config.seq_len, seed=config.seed)
    model = build_model_task(model_config, seed=config.seed, parent=parent)
    if optimizer_state is not None:
        model = model.model_copy(update={"optimizer_state": optimizer_state})
    keep_tokenizer(run_dir, tokenizer)
    _log_start(config, model, dataset, parent)
    run_id = _open_run(config, run_name, run_dir, uri)
    with _ending_run(run_id, uri):
        _log_inputs(run_id, config, model_config, dataset, parent, uri)
        if optimizer_state is not None:
            lineage.log_parent_optimizer(run_id, optimizer_state, uri)
        budget = budget_terms(config, dataset, started) if config.time_budget is not None else None
        checkpoint = train_where_placed(config, model, dataset, run_dir, run_id, budget)
        evaluation = _evaluate(config, checkpoint, dataset, tokenizer, model)
        _log_evaluation(run_id, evaluation, checkpoint, dataset, uri)
        store.log_params(run_id, {"run_plan": checkpoint.run_length}, uri)
        registered = (
            _register(config, run_id, checkpoint, tokenizer, dataset, evaluation, parent)
            if config.register_version
            else None
        )
    result = _result(run_id, registered, evaluation, checkpoint, tokenizer, dataset, model, parent, uri)
    result = result.model_copy(
        update={"started_at": started, "shape": describe_shape(config), "plan": run_plan(checkpoint)}
    )
    report.publish_summary(result.model_dump(mode="json"))
    print_summary(result)
    return result


def tokenizer_for(
    config: PretrainConfig, parent: refs.ParentRef | None
) -> tuple[refs.TokenizerRef, LlamaConfig]:
    """The run's tokenizer and the architecture it trains, checked against each other before any data work."""
    base = parent_config(parent) if parent is not None else None
    tokenizer, rows = prepare_tokenizer(
        config.data_settings(),
        vocab_size=config.vocab_size,
        tokenizer_path=config.tokenizer,
        sample_bytes=config.tokenizer_sample_bytes,
        parent=parent,
        base=base,
        resize_embeddings=config.resize_embeddings,
    )
    model_config = config.llama_config(parent=base, vocab_size=rows)
    if parent is not None:
        check_positions(config.seq_len, model_config, parent.source)
    return tokenizer, model_config


def _parent_optimizer(
    config: PretrainConfig, parent: refs.ParentRef | None, model_config: LlamaConfig, run_dir: str
) -> str | None:
    """With init_optimizer, the parent's checkpoint whose optimizer state the run starts with (checked)."""
    if not config.init_optimizer:
        return None
    return check_parent_optimizer_task(parent, model_config, config.optimizer, run_dir)


def _set_up(config: PretrainConfig) -> tuple[str, str, str]:
    """(tracking URI, MLflow run name, run directory), after the checks that fail in seconds: the store is
    reachable and the placement can work."""
    apply_embedded_defaults()
    uri = store.check_tracking_store()  # fails here, in seconds, when the store is unreachable
    check_placement(config)
    _end_runs_left_running(config.experiment, uri)
    run_name, run_key = _run_identity(config)
    # A retry of this flow run reuses its directory and resumes; another run never shares it.
    # A checkpoint_dir under $LLAMAFLOW_HOME (a sweep's trial on the pool) is this machine's home's.
    return (
        uri,
        run_name,
        home.local(config.checkpoint_dir) if config.checkpoint_dir else str(runs_dir() / run_key),
    )


def _run_identity(config: PretrainConfig) -> tuple[str, str]:
    """(MLflow run name, run directory key): the flow run's name and id when there is one."""
    if flow_run.id is not None:
        return config.run_name or flow_run.name, str(flow_run.id)
    key = uuid.uuid4().hex
    return config.run_name or f"run-{key[:8]}", key


def _end_runs_left_running(experiment: str, uri: str) -> None:
    """End the MLflow runs of `experiment` whose flow run is over, which nothing ended (a lost worker)."""
    log = get_run_logger()
    try:
        ended = runs.end_runs_of_finished_flow_runs(experiment, uri)
    except Exception as err:  # housekeeping: never the reason a run fails
        log.warning(f"could not look for MLflow runs left RUNNING by flow runs that are over: {err}")
        return
    for run_id, status in ended.items():
        log.info(f"MLflow run {run_id} was left RUNNING by a flow run that is over: ended {status}")


def _log_start(
    config: PretrainConfig, model: refs.ModelRef, dataset: refs.DatasetRef, parent: refs.ParentRef | None
) -> None:
    start = f"from {parent.pinned}" if parent else "from scratch"
    log = get_run_logger()
    log.info(
        f"model: {model.n_params / 1e6:.2f}M parameters {start}; data: {dataset.train_tokens:,} training tokens"
    )
    log.info(f"shape: {describe_shape(config)}")
    if config.budget_seconds is not None:
        log.info(
            f"time budget {format_duration(config.budget_seconds)}: the steps that fit are measured and planned "
            "before training (the plan and its expected end follow)"
        )


def _open_run(config: PretrainConfig, run_name: str, run_dir: str, uri: str) -> str:
    """The MLflow run's id. One flow run, one MLflow run: a retry finds its run by the flow-run tag, a rerun
    that resumes a checkpoint directory continues the run recorded there."""
    opened = runs.open_run(config.experiment, run_name, run_dir=run_dir, tags=runs.flow_run_tags(), uri=uri)
    if opened.continued:
        get_run_logger().info(f"continuing MLflow run {opened.run_id} ({opened.continued})")
    report.link_mlflow_run(opened.run_id, uri)
    return opened.run_id


@contextlib.contextmanager
def _ending_run(run_id: str, uri: str) -> Iterator[None]:
    """End the MLflow run as the block ends: FINISHED, KILLED when stopped, FAILED otherwise."""
    try:
        yield
    except BaseException as err:
        stopped = isinstance(err, KeyboardInterrupt | TrainingInterrupted | TerminationSignal)
        store.end_run(run_id, "KILLED" if stopped else "FAILED", uri)
        raise
    store.end_run(run_id, "FINISHED", uri)


def _log_inputs(
    run_id: str,
    config: PretrainConfig,
    model_config: LlamaConfig,
    dataset: refs.DatasetRef,
    parent: refs.ParentRef | None,
    uri: str,
) -> None:
    store.log_params(run_id, {**config.model_dump(), "model_config": model_config}, uri)
    store.log_datasets(run_id, dataset, uri)
    store.log_split(run_id, dataset, uri)
    if parent is not None:
        lineage.log_parent(run_id, parent, uri)  # the parent's logged model as a run input


def _evaluate(
    config: PretrainConfig,
    checkpoint: refs.CheckpointRef,
    dataset: refs.DatasetRef,
    tokenizer: refs.TokenizerRef,
    model: refs.ModelRef,
) -> refs.EvalResult:
    return evaluate_task(
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


def _log_evaluation(
    run_id: str,
    evaluation: refs.EvalResult,
    checkpoint: refs.CheckpointRef,
    dataset: refs.DatasetRef,
    uri: str,
) -> None:
    """Each scored checkpoint as a logged model with its validation metrics linked, then the rest."""
    checkpoints.log_checkpoint_models(run_id, evaluation, dataset, uri)
    report.log_evaluation(run_id, evaluation, checkpoint=checkpoint, uri=uri)


def _register(
    config: PretrainConfig,
    run_id: str,
    checkpoint: refs.CheckpointRef,
    tokenizer: refs.TokenizerRef,
    dataset: refs.DatasetRef,
    evaluation: refs.EvalResult,
    parent: refs.ParentRef | None,
) -> refs.RegisteredModel:
    # The store is the environment's (as here), never a task parameter: its URI may hold credentials.
    return register_task(
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


def _result(
    run_id: str,
    registered: refs.RegisteredModel | None,
    evaluation: refs.EvalResult,
    checkpoint: refs.CheckpointRef,
    tokenizer: refs.TokenizerRef,
    dataset: refs.DatasetRef,
    model: refs.ModelRef,
    parent: refs.ParentRef | None,
    uri: str,
) -> PretrainResult:
    metrics = {
        **checkpoint.metrics,
        "bits_per_byte": evaluation.bits_per_byte,
        "xz_bits_per_byte": evaluation.xz_bits_per_byte,
        "val_loss": evaluation.val_loss,
        "val_perplexity": evaluation.perplexity,
    }
    return PretrainResult(
        run_id=run_id,
        model_uri=registered.uri if registered else None,
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


def main(argv: list[str] | None = None) -> int:
    """`python -m flows.pretrain`: exit codes 0 done, 1 failed, 2 bad input, 130 stopped (flows/cli.py)."""
    return cli.run_command(pretrain, argv)


if __name__ == "__main__":
    raise SystemExit(main())
