"""SweepSpec: what a sweep searches, validated whole before any trial runs.

    name: muon-wd                    # the study, the MLflow parent run, the trials' directories
    base: {preset: demo, eval_every: 150}   # PretrainConfig fields, a preset included
    space:                           # PretrainConfig fields (model_overrides.FIELD for the model's)
      muon_weight_decay: {choices: [0.02, 0.05, 0.1]}
      muon_lr: {low: 0.01, high: 0.08, log: true}
    trials: 3
    sampler: grid                    # grid | random | tpe
    pruner: asha                     # none | asha | {name: asha, min_resource: 150, reduction_factor: 3}
    metric: bits_per_byte            # bits_per_byte | val_loss, both minimised
    budget: {steps: 1200}            # or {tokens: N}; default: the base's run length
                                     # (the rungs count the same unit for every trial: with tokens, each
                                     # trial's eval_every is set so that it scores at the same token counts)
    parallel: 1                      # trials at once (default 1; with gpus_per_trial: as the GPUs allow)
    gpus_per_trial: 1                # a rank on each (nproc_per_node); local: its own CUDA_VISIBLE_DEVICES
    seeds: [1, 2, 3]                 # confirmation: the best `confirm_top` and the base, once per seed

A trial's configuration is `base`, then its sampled values, then what the sweep sets itself (its run name,
its checkpoint directory, a registered-model name of the sweep's own, the budget's `max_steps`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError

from flows.pretrain_config import PretrainConfig
from flows.sweep.budget import rung_problem, tokens_per_step
from model import LlamaConfig

OVERRIDES = "model_overrides."
# Fields a sweep sets for every trial (a base may not), and those its trials share (a space may not vary):
# the registered-model name (the sweep's own, made from the base's) and the experiment its runs nest in.
SWEEP_SET = ("run_name", "checkpoint_dir")
SHARED = ("model_name", "alias", "experiment")
# Optuna's storages: a journal file or an SQLAlchemy database URL (DIALECT[+DRIVER]://...).
DATABASE_URL = re.compile(r"^[A-Za-z][A-Za-z0-9]*(\+[A-Za-z0-9_]+)?://")
METRICS = {  # metric -> (the final evaluation's MLflow key, the periodic score's key)
    "bits_per_byte": ("val/bits_per_byte", "val_subset/bits_per_byte"),
    "val_loss": ("val/loss", "val_subset/loss"),
}


class _Strict(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Dimension(_Strict):
    """A range (`low`, `high`, `log`, `step`) or a list of `choices`."""

    low: int | float | None = None
    high: int | float | None = None
    log: bool = False
    step: int | float | None = Field(None, gt=0)
    choices: list[Any] | None = None

    @model_validator(mode="after")
    def _one_kind(self) -> Dimension:
        if self.choices is not None:
            if self.low is not None or self.high is not None or self.log or self.step is not None:
                raise ValueError("give either choices or low/high (with log, step), not both")
            if not self.choices:
                raise ValueError("choices is empty: give at least one value")
            return self
        if self.low is None or self.high is None:
            raise ValueError("give low and high (a range) or choices (a list)")
        if not self.low < self.high:
            raise ValueError(f"low={self.low:g} must be below high={self.high:g}")
        if self.log and self.low <= 0:
            raise ValueError(f"log=true needs low > 0, got {self.low:g}")
        if self.log and self.step is not None:
            raise ValueError("log=true and step cannot go together (Optuna samples one or the other)")
        return self

    def values(self) -> list[Any]:
        """The values a grid holds: the choices, or a stepped range."""
        if self.choices is not None:
            return list(self.choices)
        assert self.low is not None and self.high is not None and self.step is not None
        count = int(math.floor((self.high - self.low) / self.step + 1e-9)) + 1
        return [self.low + i * self.step for i in range(count)]


class Pruner(_Strict):
    name: Literal["none", "asha"] = "none"
    min_resource: int | None = Field(
        None, ge=1, description="First rung, in the budget's unit (default: the base's eval_every)"
    )
    reduction_factor: int = Field(3, ge=2, description="Keep the best 1/reduction_factor at each rung")


class Budget(_Strict):
    steps: int | None = Field(None, ge=1)
    tokens: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _one_unit(self) -> Budget:
        if (self.steps is None) == (self.tokens is None):
            raise ValueError("give one of steps or tokens")
        return self

    @property
    def unit(self) -> str:
        return "steps" if self.steps is not None else "tokens"


class SweepSpec(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,99}$")
    base: dict[str, Any] = Field(default_factory=dict)
    space: dict[str, Dimension] = Field(min_length=1)
    trials: int | None = Field(None, ge=1, description="Default: the grid's size (sampler grid)")
    sampler: Literal["grid", "random", "tpe"] = "tpe"
    pruner: Pruner | Literal["none", "asha"] = Pruner()  # a name alone: that pruner's defaults
    metric: Literal["bits_per_byte", "val_loss"] = "bits_per_byte"
    budget: Budget | None = None
    parallel: int | None = Field(
        None, ge=1, description="Trials at once (default 1; with gpus_per_trial, as many as the GPUs allow)"
    )
    gpus_per_trial: int = Field(
        0,
        ge=0,
        description="GPUs a trial gets: one rank on each (its nproc_per_node, unless base or space sets it), "
        "on a local trial as its own CUDA_VISIBLE_DEVICES (0: trials share the host)",
    )
    seed: int = Field(0, description="Seeds the sampler")
    seeds: list[int] = Field(default_factory=list, description="Confirmation seeds (none: no confirmation)")
    confirm_top: int = Field(1, ge=1, description="How many of the best configurations are confirmed")
    launch: Literal["local", "deployment"] = Field(
        "local", description="local: trials are child processes here; deployment: runs of `deployment`"
    )
    deployment: str = Field("pretrain/adhoc", description="FLOW/NAME of a pretrain deployment")
    concurrency_limit: str | None = Field(
        None, description="Prefect global concurrency limit shared by every sweep on the same machines"
    )
    storage: str | None = Field(
        None, description="Optuna storage URL (default: LLAMAFLOW_SWEEP_STORAGE, else a journal file)"
    )
    register_winner: bool = Field(False, description="Train the winner once more under the base's model_name")
    register_trials: bool = Field(
        False, description="Register every trial as a version of the sweep's own model (default: none is)"
    )
    max_retries: int = Field(
        2,
        ge=0,
        description="Reruns of a trial that crashed for infrastructure reasons (never a diverged one)",
    )
    keep_pruned: bool = Field(False, description="Keep a pruned local trial's checkpoints (default: removed)")

    @field_validator("pruner")
    @classmethod
    def _pruner(cls, value: Pruner | str) -> Pruner:
        return Pruner(name=value) if isinstance(value, str) else value

    @field_validator("storage")
    @classmethod
    def _storage(cls, value: str | None) -> str | None:
        return None if value is None else check_storage(value, "storage")

    @field_validator("seeds")
    @classmethod
    def _unique(cls, seeds: list[int]) -> list[int]:
        if len(set(seeds)) != len(seeds):
            raise ValueError(f"seeds repeat: {seeds}")
        if len(seeds) == 1:
            raise ValueError("one seed cannot show a difference: give at least 2 (5 or more for p < 0.01)")
        return seeds

    # ------------------------------------------------------------------ derived

    def base_config(self) -> PretrainConfig:
        return PretrainConfig(**self.base)

    def grid_size(self) -> int:
        return math.prod(len(d.values()) for d in self.space.values())

    @property
    def n_trials(self) -> int:
        return self.trials if self.trials is not None else self.grid_size()

    def first_rung(self) -> int:
        if self.pruner.min_resource is not None:
            return self.pruner.min_resource
        config = self.base_config()
        return config.eval_every * (tokens_per_step(config) if self.budget_unit == "tokens" else 1)

    @property
    def budget_unit(self) -> str:
        return self.budget.unit if self.budget is not None else "steps"

    def sweep_model_name(self) -> str:
        return f"{self.base_config().model_name}-sweep-{self.name}"


def check_storage(url: str, where: str) -> str:
    """`url` as Optuna's storage, or a ValueError naming the forms it takes (before SQLAlchemy's own)."""
    if url.startswith("journal:") and url.removeprefix("journal:").strip():
        return url
    if DATABASE_URL.match(url):
        return url
    raise ValueError(
        f"{where}={url!r} is neither journal:PATH (an Optuna journal file, e.g. journal:{url}) nor a database "
        "URL (postgresql+psycopg://USER@HOST/DB, sqlite:///PATH)"
    )


def trial_values(spec: SweepSpec, params: dict[str, Any]) -> dict[str, Any]:
    """The PretrainConfig values a user would give for these sampled values: base, params, budget."""
    values = {**spec.base, "model_overrides": dict(spec.base.get("model_overrides", {}))}
    for name, value in params.items():
        if name.startswith(OVERRIDES):
            values["model_overrides"][name.removeprefix(OVERRIDES)] = value
        else:
            values[name] = value
    if not values["model_overrides"]:
        del values["model_overrides"]
    if spec.gpus_per_trial and "nproc_per_node" not in values:  # a rank on each of its GPUs
        values["nproc_per_node"] = spec.gpus_per_trial
    if spec.budget is not None:
        steps = spec.budget.steps
        if steps is None:
            assert spec.budget.tokens is not None
            steps = max(1, spec.budget.tokens // tokens_per_step(PretrainConfig(**values)))
        values["max_steps"] = steps
        values.pop("epochs", None)
    if spec.budget_unit == "tokens" and spec.pruner.name == "asha" and _has_rungs(spec):
        # The rungs are token counts: every trial scores every `first_rung` tokens, whatever its batch.
        per_step = tokens_per_step(PretrainConfig(**values))
        values["eval_every"] = max(1, round(spec.first_rung() / per_step))
    return values


def _has_rungs(spec: SweepSpec) -> bool:
    return spec.pruner.min_resource is not None or bool(
        spec.base.get("eval_every") or spec.base_config().eval_every
    )


# ---------------------------------------------------------------------- validation


def load_spec(path: str | Path) -> SweepSpec:
    """Read and check a spec file; a ValidationError lists every problem, one per line."""
    import yaml

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"sweep spec {path} does not exist: give the path of a YAML file")
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"sweep spec {path} holds {type(data).__name__}, not a mapping of spec fields")
    return check_spec(data)


Problem = Callable[[tuple[str | int, ...], str], None]


def check_spec(data: dict[str, Any] | SweepSpec) -> SweepSpec:
    """The spec, after the checks that need PretrainConfig: every problem in one ValidationError."""
    spec = data if isinstance(data, SweepSpec) else SweepSpec.model_validate(data)
    problems: list[InitErrorDetails] = []

    def problem(loc: tuple[str | int, ...], message: str) -> None:
        problems.append(
            InitErrorDetails(type=PydanticCustomError("sweep_spec", message), loc=loc, input=None)
        )

    try:
        base = spec.base_config()
    except ValidationError as err:
        for e in err.errors(include_url=False):
            problem(("base", *e["loc"]), e["msg"].removeprefix("Value error, "))
        raise ValidationError.from_exception_data("SweepSpec", problems) from None
    for name in SWEEP_SET:
        if name in spec.base:
            problem(("base", name), f"a sweep sets {name} for each trial: leave it out of base")
    for name, dim in spec.space.items():
        _check_dimension(spec, name, dim, problem)
    _check_search(spec, base, problem)
    if not problems and (
        late := rung_problem(spec, lambda params: PretrainConfig(**trial_values(spec, params)))
    ):
        problem(("pruner", "min_resource"), late)
    if problems:
        raise ValidationError.from_exception_data("SweepSpec", problems)
    return spec


def _check_dimension(spec: SweepSpec, name: str, dim: Dimension, problem: Problem) -> None:
    """One dimension of the space: a field a trial may vary, and every value of it a valid configuration."""
    where: tuple[str | int, ...] = ("space", name)
    field = name.removeprefix(OVERRIDES)
    model_fields = {f for f in LlamaConfig.__dataclass_fields__ if f != "extra"}
    if name.startswith(OVERRIDES):
        if field not in model_fields:
            fields = ", ".join(sorted(model_fields))
            return problem(where, f"{field!r} is not a model field (LlamaConfig): one of {fields}")
    elif name not in PretrainConfig.model_fields or name in ("preset", "model_overrides"):
        return problem(
            where,
            f"{name!r} is not a PretrainConfig field a trial can vary (see python -m flows.pretrain --help)",
        )
    if name in SWEEP_SET + SHARED or (name == "seed" and spec.seeds):
        return problem(
            where, f"every trial of a sweep has the same {name} (or one the sweep sets): it cannot vary"
        )
    if name in ("max_steps", "epochs") and spec.budget is not None:
        problem(where, "the budget sets the run length: vary it without a budget, or drop it from the space")
    if name == "eval_every" and spec.budget_unit == "tokens" and spec.pruner.name == "asha":
        problem(where, "with a token budget and asha the sweep sets eval_every (the rungs' token counts)")
    if dim.choices is None and _integer_field(name) and not _integral_bounds(dim):
        return problem(where, f"{name} is an integer: give integer low, high and step")
    samples = dim.values() if dim.choices is not None or dim.step is not None else [dim.low, dim.high]
    for i, value in enumerate(samples):
        try:
            PretrainConfig(**trial_values(spec, {name: value}))
        except ValidationError as err:
            label = ("choices", i) if dim.choices is not None else (("low",) if i == 0 else ("high",))
            for e in err.errors(include_url=False):
                problem((*where, *label), f"{value!r}: " + e["msg"].removeprefix("Value error, "))
            return None
    return None


def _check_search(spec: SweepSpec, base: PretrainConfig, problem: Problem) -> None:
    """The sampler, pruner, budget and confirmation against each other and the base."""
    if spec.sampler == "grid":
        ranges = [n for n, d in spec.space.items() if d.choices is None and d.step is None]
        for name in ranges:
            problem(("space", name), "sampler grid needs choices (or low, high and step) for every dimension")
        if not ranges and spec.trials is not None and spec.trials > spec.grid_size():
            problem(("trials",), f"{spec.trials} trials but the grid holds {spec.grid_size()} points")
    elif spec.trials is None:
        problem(("trials",), f"sampler {spec.sampler} needs a number of trials")
    if spec.pruner.name == "asha" and not base.eval_every:
        problem(
            ("pruner",),
            "asha prunes on the validation score taken during training: set base.eval_every (e.g. 100), "
            "or pruner: none",
        )
    tokens = spec.budget.tokens if spec.budget is not None else None
    if tokens is not None and tokens < tokens_per_step(base):
        problem(("budget", "tokens"), f"{tokens} tokens is less than one step ({tokens_per_step(base)})")
    _check_gpus(spec, problem)
    if spec.seeds and spec.confirm_top > spec.n_trials:
        problem(("confirm_top",), f"{spec.confirm_top} is more than the {spec.n_trials} trials")


def _check_gpus(spec: SweepSpec, problem: Problem) -> None:
    """A local trial's ranks each need a GPU of its own (CUDA_VISIBLE_DEVICES holds gpus_per_trial)."""
    if spec.launch != "local" or not spec.gpus_per_trial:
        return
    ranks = [spec.base.get("nproc_per_node")]
    if (dim := spec.space.get("nproc_per_node")) is not None:
        ranks += dim.choices if dim.choices is not None else [dim.high]
    if (most := max((r for r in ranks if isinstance(r, int)), default=0)) > spec.gpus_per_trial:
        problem(
            ("gpus_per_trial",),
            f"a trial runs {most} ranks (nproc_per_node) but gets {spec.gpus_per_trial} GPU(s): raise "
            f"gpus_per_trial to {most} or lower nproc_per_node",
        )


def _integer_field(name: str) -> bool:
    return not name.startswith(OVERRIDES) and PretrainConfig.model_fields[name].annotation in (
        int,
        int | None,
    )


def _integral_bounds(dim: Dimension) -> bool:
    return all(isinstance(v, int) for v in (dim.low, dim.high, dim.step or 1))


def is_integer(name: str, dim: Dimension) -> bool:
    """A range Optuna samples as integers: an integer field's, or a model field's given in integers."""
    if dim.choices is not None:
        return False
    return _integer_field(name) or (name.startswith(OVERRIDES) and _integral_bounds(dim))
