"""What a sweep leaves for people: one MLflow parent run (the trials' runs nested under it) with the spec,
the results table and Optuna's plots; the seed-confirmation statistics; the printed recommendation."""

from __future__ import annotations

import hashlib
import io
import json
import math
import statistics
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import optuna
from mlflow.entities import Metric
from optuna.trial import FrozenTrial, TrialState

from flows.sweep.command import pretrain_command
from flows.sweep.rungs import PRUNED, decisions
from flows.sweep.runs import TAG_KIND, TAG_SWEEP
from flows.sweep.spec import SweepSpec, trial_values
from flows.sweep.study import home_free, storage_url
from tasks.tracking import store

PARENT_ATTR = "mlflow_parent_run_id"
SIGNIFICANCE = 0.01  # modded-nanogpt's bar for a record: p < 0.01 over runs


def open_parent(spec: SweepSpec, study: optuna.Study, uri: str) -> str:
    """The sweep's MLflow run: created once, continued by a rerun of the same study."""
    run_id = study.user_attrs.get(PARENT_ATTR)
    client = store.get_client(uri)
    if run_id is not None:
        client.update_run(run_id, status="RUNNING")
        return str(run_id)
    run_id = store.start_run(
        spec.base_config().experiment, spec.name, tags={TAG_SWEEP: spec.name, TAG_KIND: "sweep"}, uri=uri
    )
    store.log_params(
        run_id,
        {
            "sweep": spec.model_dump(mode="json", exclude={"storage", "base", "space"}),
            "base": spec.base,
            "space": {k: d.model_dump(exclude_none=True) for k, d in spec.space.items()},
            "storage": home_free(storage_url(spec)),
        },
        uri,
    )
    study.set_user_attr(PARENT_ATTR, run_id)
    return run_id


def trial_rows(study: optuna.Study) -> list[dict[str, Any]]:
    return [trial_row(t) for t in sorted(study.get_trials(deepcopy=False), key=lambda t: t.number)]


def trial_row(t: FrozenTrial) -> dict[str, Any]:
    """`final` is the full validation score a finished trial ended with; a trial that did not finish shows
    its last score on the validation subset (`subset`) instead, a pruned one with the rung and token count
    it was cut at: the two scores are never in one column."""
    cut = t.user_attrs.get(PRUNED, {})
    return {
        "trial": t.number,
        **{k: _short(v) for k, v in t.params.items()},
        "state": t.state.name,
        "final": t.value if t.state == TrialState.COMPLETE else None,
        "subset": None if t.state == TrialState.COMPLETE else _last_score(t),
        "rung": cut.get("rung"),
        "tokens": cut.get("tokens"),
        "steps": t.user_attrs.get("steps"),
        "seconds": t.user_attrs.get("seconds"),
    }


def _last_score(trial: FrozenTrial) -> float | None:
    if PRUNED in trial.user_attrs:
        return trial.user_attrs[PRUNED]["score"]
    return trial.intermediate_values[trial.last_step] if trial.last_step is not None else None


def _short(value: Any) -> Any:
    return float(f"{value:.6g}") if isinstance(value, float) else value


def markdown_table(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "(no trials)\n"
    columns = list(dict.fromkeys(k for row in rows for k in row))
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        cells = [_cell(row.get(c)) for c in columns]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def log_results(spec: SweepSpec, study: optuna.Study, parent: str, uri: str, *, plots: bool = True) -> None:
    """The table (markdown and CSV), counts, the best value and (`plots`) Optuna's plots, on the parent run;
    the files are replaced at every call."""
    client = store.get_client(uri)
    rows = trial_rows(study)
    client.log_text(parent, markdown_table(rows), "results.md")
    buffer = io.StringIO()
    study.trials_dataframe().to_csv(buffer, index=False)
    client.log_text(parent, buffer.getvalue(), "trials.csv")
    states = [t.state for t in study.get_trials(deepcopy=False)]
    metrics = {
        f"trials_{s.name.lower()}": float(states.count(s))
        for s in (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)
    }
    complete = [t for t in study.get_trials(deepcopy=False) if t.state == TrialState.COMPLETE]
    if complete:
        metrics[f"best_{spec.metric}"] = min(t.value for t in complete)
    seconds = [float(t.user_attrs.get("seconds", 0.0)) for t in study.get_trials(deepcopy=False)]
    metrics["trial_seconds"] = sum(seconds)
    client.log_batch(parent, metrics=[Metric(k, v, 0, len(states)) for k, v in metrics.items()])
    if cuts := decisions(study):  # which trial was cut, at which rung, against which scores
        table = {k: [c[k] for c in cuts] for k in ("trial", "rung", "step", "tokens", "score")}
        table["against"] = [json.dumps(c["against"]) for c in cuts]
        client.log_table(parent, data=table, artifact_file="rung_decisions.json")
    for name, figure in _figures(study, len(complete), len(spec.space)) if plots else ():
        client.log_figure(parent, figure, f"plots/{name}.png")
        close(figure)


def _figures(study: optuna.Study, complete: int, dimensions: int) -> list[tuple[str, Any]]:
    from optuna.visualization import matplotlib as plots

    wanted = [("optimization_history", plots.plot_optimization_history, 1)]
    if any(
        t.intermediate_values for t in study.get_trials(deepcopy=False)
    ):  # a pruned sweep's learning curves
        wanted.append(("intermediate_values", plots.plot_intermediate_values, 1))
    wanted.append(("parallel_coordinate", plots.plot_parallel_coordinate, 2))
    if dimensions > 1:
        wanted.append(("param_importances", plots.plot_param_importances, 3))
    figures = []
    for name, plot, needed in wanted:
        if complete < needed:
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Optuna marks its matplotlib plots experimental
            try:
                axes = plot(study)
            except (ValueError, RuntimeError) as err:  # e.g. no intermediate values, one distinct value
                print(f"plot {name} skipped: {err}")
                continue
        figure = axes.figure if hasattr(axes, "figure") else axes.flat[0].figure
        figure.set_size_inches(8, 5)
        figure.tight_layout()
        figures.append((name, figure))
    return figures


def close(figure: Any) -> None:
    import matplotlib.pyplot as plt

    plt.close(figure)


# ---------------------------------------------------------------------- confirmation


@dataclass(frozen=True)
class Candidate:
    name: str  # "base" or "trial-N"
    params: dict[str, Any]
    values: list[float]  # by seed, in the spec's order

    @property
    def mean(self) -> float:
        return statistics.fmean(self.values) if self.values else float("nan")

    @property
    def sd(self) -> float:
        return statistics.stdev(self.values) if len(self.values) > 1 else float("nan")


def params_key(params: dict[str, Any]) -> str:
    """A configuration's name in the confirmation study: the same values, the same key, whatever their rank."""
    text = json.dumps(params, sort_keys=True, default=str)
    return hashlib.blake2b(text.encode(), digest_size=6).hexdigest()


@dataclass(frozen=True)
class Verdict:
    candidate: Candidate
    base: Candidate
    p_value: float  # one-sided paired t-test: candidate < base (nan: no test possible)
    p_holm: float = float("nan")  # p_value after Holm's correction across the candidates compared

    @property
    def real(self) -> bool:
        return self.p_holm < SIGNIFICANCE and self.candidate.mean < self.base.mean

    @property
    def why_untested(self) -> str:
        pairs = len(self.candidate.values)
        if pairs < 2:
            return f"{pairs} seed(s) completed for both: no test"
        if math.isnan(self.p_value):
            return "the same difference on every seed: no spread to test"
        return ""


def paired_p_value(candidate: list[float], base: list[float]) -> float:
    """One-sided paired t-test that the candidate's values are below the base's (same seeds); nan when it
    cannot be tested (fewer than 2 pairs, or the same difference on every seed: no spread, no t statistic)."""
    from scipy import stats

    differences = [c - b for c, b in zip(candidate, base, strict=True)]
    if len(differences) < 2 or all(d == differences[0] for d in differences):
        return float("nan")
    return float(stats.ttest_rel(candidate, base, alternative="less").pvalue)


def holm(p_values: list[float]) -> list[float]:
    """Holm's step-down adjustment (family-wise error across the candidates); an untested (nan) p stays nan
    and counts in the family."""
    order = sorted(range(len(p_values)), key=lambda i: (math.isnan(p_values[i]), p_values[i]))
    adjusted = [float("nan")] * len(p_values)
    running = 0.0
    for rank, i in enumerate(order):
        if math.isnan(p_values[i]):
            continue
        running = max(running, min(1.0, (len(p_values) - rank) * p_values[i]))
        adjusted[i] = running
    return adjusted


def compare(
    name: str, params: dict[str, Any], values: dict[int, float], base: dict[int, float], seeds: list[int]
) -> Verdict:
    """A candidate against the base over the seeds both completed (by seed: the pairs share data order
    and initialisation)."""
    paired = [s for s in seeds if s in values and s in base]
    candidate = Candidate(name, params, [values[s] for s in paired])
    reference = Candidate("base", {}, [base[s] for s in paired])
    p_value = paired_p_value(candidate.values, reference.values)
    return Verdict(candidate, reference, p_value, p_value)


def corrected(verdicts: list[Verdict]) -> list[Verdict]:
    """The verdicts with Holm's correction across all of them (K candidates tested at once)."""
    adjusted = holm([v.p_value for v in verdicts])
    return [Verdict(v.candidate, v.base, v.p_value, p) for v, p in zip(verdicts, adjusted, strict=True)]


def confirmation_lines(found: list[Verdict], seeds: list[int], metric: str) -> list[str]:
    lines = [
        f"confirmation over seeds {seeds} ({metric}, mean ± sd; paired t-test against the base, one-sided, "
        f"Holm-corrected across {len(found)} candidate(s)):"
    ]
    base = found[0].base if found else None
    if base is not None:
        lines.append(f"  base        {base.mean:.5f} ± {base.sd:.5f}")
    for v in found:
        difference = v.candidate.mean - v.base.mean
        verdict = "real at p < 0.01" if v.real else (v.why_untested or "not shown at p < 0.01")
        lines.append(
            f"  {v.candidate.name:<11} {v.candidate.mean:.5f} ± {v.candidate.sd:.5f}  ({difference:+.5f}, "
            f"p = {v.p_value:.2g}, Holm {v.p_holm:.2g}: {verdict})  {_params(v.candidate.params)}"
        )
    return lines


def log_confirmation(parent: str, found: list[Verdict], uri: str) -> None:
    client = store.get_client(uri)
    rows = []
    for v in found:
        for c in (v.base, v.candidate) if not rows else (v.candidate,):
            rows.append(
                {"candidate": c.name, **c.params, "mean": c.mean, "sd": c.sd, "values": str(c.values)}
            )
        rows[-1]["p_value"] = v.p_value
        rows[-1]["p_holm"] = v.p_holm
        if not math.isnan(v.p_value):
            client.log_metric(parent, f"confirm/{v.candidate.name}/p_value", v.p_value)
            client.log_metric(parent, f"confirm/{v.candidate.name}/p_holm", v.p_holm)
    client.log_text(parent, markdown_table(rows), "confirmation.md")


def _params(params: dict[str, Any]) -> str:
    return " ".join(f"{k}={_short(v)}" for k, v in params.items())


@dataclass(frozen=True)
class Recommendation:
    params: dict[str, Any] | None  # the sampled values to adopt ({}: keep the base); None: nothing finished
    lines: list[str]


def recommend(
    spec: SweepSpec,
    best: FrozenTrial | None,
    found: list[Verdict] | None,
    values: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
) -> Recommendation:
    """What to adopt, and the closing lines that say it as `python -m flows.pretrain` flags. With a
    confirmation, only a configuration better than the base at p < 0.01 (the best mean among those) is.
    `values` gives a run's values for sampled ones (default: the spec's; a sweep's pins its parent)."""
    values = values or (lambda params: trial_values(spec, params))
    if best is None:
        return Recommendation(
            None, ["no trial completed: nothing to recommend (see the failed trials' output)"]
        )
    lines = [f"best trial: {best.number}, {spec.metric} {best.value:.5f}, {_params(best.params)}"]
    params = best.params
    if found is not None:
        real = [v for v in found if v.real]
        if not real:
            lines.append(
                "the confirmation shows no configuration better than the base at p < 0.01: keep the base"
            )
            lines.append(f"base: {pretrain_command(values({}))}")
            return Recommendation({}, lines)
        top = min(real, key=lambda v: v.candidate.mean)
        params = top.candidate.params
        lines.append(
            f"{top.candidate.name} is better than the base at p < 0.01 (p = {top.p_value:.2g}, "
            f"Holm {top.p_holm:.2g})"
        )
    lines.append(f"run it: {pretrain_command(values(params))}")
    return Recommendation(params, lines)
