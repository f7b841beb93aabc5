"""MLflow pyfunc for llamaflow models, logged as code ("models from code"): nothing is pickled.

MLflow copies this file into the model and runs it at load time, so it imports only `model` and `manifest`
(`tasks/registry/manifest.py`, both shipped with the model through `code_paths`), torch, tokenizers and
mlflow — never `tasks`. Before loading anything it checks the model's files against the sha256 manifest its
promotion decision recorded, when the registry it came from is the process's tracking store. Artifacts:
  weights   model.safetensors of the unwrapped module
  tokenizer tokenizer.json
  config    config.json (LlamaConfig.to_dict())
`model_config` carries the special token ids: {"bos_id", "eos_id", "pad_id"}.

    mlflow.pyfunc.load_model("models:/llamaflow-demo@champion").predict(["def "])
"""

from pathlib import Path
from typing import Any

import mlflow
import pandas as pd
import torch
from mlflow.pyfunc import PythonModel, PythonModelContext
from tokenizers import Tokenizer

DEFAULT_PARAMS: dict[str, Any] = {
    "max_new_tokens": 32,
    "temperature": 0.8,
    "top_k": 50,
    "top_p": 1.0,
    "seed": 0,
}


def prompts_from_input(model_input: Any) -> list[str]:
    """Accept a list/tuple/array of strings, one string, or a DataFrame with a `prompt` column."""
    if isinstance(model_input, str):
        return [model_input]
    if hasattr(model_input, "columns"):  # pandas DataFrame, without importing pandas here
        column = "prompt" if "prompt" in model_input.columns else model_input.columns[0]
        values = model_input[column].tolist()
    elif isinstance(model_input, dict) and "prompt" in model_input:
        values = model_input["prompt"]
        values = [values] if isinstance(values, str) else list(values)
    else:
        values = list(model_input)
    if not all(isinstance(v, str) for v in values):
        raise TypeError(
            "predict() takes prompts as strings: a list of str or a DataFrame with a 'prompt' column; "
            f"got elements of types {sorted({type(v).__name__ for v in values})}."
        )
    return values


def resolve_params(params: dict[str, Any] | None) -> dict[str, Any]:
    merged = {**DEFAULT_PARAMS, **{k: v for k, v in (params or {}).items() if v is not None}}
    unknown = set(merged) - set(DEFAULT_PARAMS)
    if unknown:
        raise ValueError(f"Unknown predict params {sorted(unknown)}; known: {sorted(DEFAULT_PARAMS)}.")
    if int(merged["max_new_tokens"]) < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {merged['max_new_tokens']}.")
    if float(merged["temperature"]) < 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {merged['temperature']}.")
    if not 0 < float(merged["top_p"]) <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {merged['top_p']}.")
    return merged


def check_recorded_manifest(artifact: str) -> None:
    """Refuse (manifest.TamperedModelError) a model whose files differ from the manifest the decision
    recorded on the version made from it; nothing to check when no tracking store is set (a local copy) or
    no decision recorded one."""
    from manifest import recorded, verify
    from mlflow.models import Model
    from mlflow.tracking._tracking_service.utils import is_tracking_uri_set

    root = next(p for p in Path(artifact).resolve().parents if (p / "MLmodel").is_file())
    saved = Model.load(str(root))
    if not (is_tracking_uri_set() and saved.run_id and saved.model_id):
        return
    versions = mlflow.MlflowClient().search_model_versions(f"run_id = '{saved.run_id}'")
    for version in versions:
        # A database store's search leaves model_id out; the source (the logged model's location) names it
        made_from = version.model_id == saved.model_id or saved.model_id in str(version.source).split("/")
        expected = recorded(version.tags or {}) if made_from else None
        if expected is not None:
            verify(root, expected, f"version {version.version} of {version.name!r}")
            return


class LlamaPyfunc(PythonModel):
    def load_context(self, context: PythonModelContext) -> None:
        from model import load_pretrained

        check_recorded_manifest(context.artifacts["config"])
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        model = load_pretrained(context.artifacts["config"], context.artifacts["weights"], device=self.device)
        self.model = model.eval()
        config = model.config
        self.tokenizer = Tokenizer.from_file(context.artifacts["tokenizer"])
        ids = context.model_config or {}
        missing = {"eos_id", "pad_id"} - set(ids)
        if missing:
            raise ValueError(f"model_config lacks {sorted(missing)}; log the model with register_model().")
        self.eos_id, self.pad_id = int(ids["eos_id"]), int(ids["pad_id"])
        self.max_positions = int(config.max_position_embeddings)
        self.vocab_size = int(config.vocab_size)

    # `pd.DataFrame` is one of the hints from which MLflow infers no schema, so the logged signature (a
    # `prompt` column; lists are accepted too) stays in charge, and MLflow does not warn about a missing hint.
    @torch.no_grad()
    def predict(
        self, context: PythonModelContext, model_input: pd.DataFrame, params: dict[str, Any] | None = None
    ) -> list[str]:
        from model import generate

        prompts = prompts_from_input(model_input)
        if not prompts:
            return []
        p = resolve_params(params)
        max_new = int(p["max_new_tokens"])
        if max_new >= self.max_positions:
            raise ValueError(
                f"max_new_tokens={max_new} leaves no room for the prompt in the model's "
                f"{self.max_positions} positions; ask for fewer tokens."
            )
        keep = self.max_positions - max_new
        # An empty prompt starts a new document, which in training followed an EOS.
        encoded = [
            (self.tokenizer.encode(text, add_special_tokens=False).ids or [self.eos_id])[-keep:]
            for text in prompts
        ]
        width = max(len(ids) for ids in encoded)
        input_ids = torch.full((len(encoded), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(encoded), width), dtype=torch.bool)
        for row, ids in enumerate(encoded):  # left padding keeps every prompt's end at the same column
            input_ids[row, width - len(ids) :] = torch.tensor(ids)
            mask[row, width - len(ids) :] = True
        generator = torch.Generator(device=self.device).manual_seed(int(p["seed"]))
        top_k = min(int(p["top_k"]), self.vocab_size) or None  # 0 turns top-k off
        top_p = float(p["top_p"])
        out = generate(
            self.model,
            input_ids.to(self.device),
            mask.to(self.device),
            max_new_tokens=max_new,
            temperature=float(p["temperature"]),
            top_k=top_k,
            top_p=top_p if top_p < 1.0 else None,
            eos_token_id=self.eos_id,
            pad_token_id=self.pad_id,
            generator=generator,
        )
        texts = []
        for row in out[:, width:].tolist():
            if self.eos_id in row:
                row = row[: row.index(self.eos_id)]
            texts.append(self.tokenizer.decode([t for t in row if t != self.pad_id]))
        return texts


mlflow.models.set_model(LlamaPyfunc())
