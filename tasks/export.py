"""Export a registered llamaflow model as a Hugging Face Llama checkpoint whose model card names the model it
was trained from (`base_model`, from the version's lineage tags).

    python -m tasks.export models:/llamaflow-demo@champion exported/
    transformers.LlamaForCausalLM.from_pretrained("exported/")

The model must be one Hugging Face's Llama can represent (no QK-norm, no value embeddings: `export_hf`
says which option to train without).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from model import export_hf, load_pretrained
from tasks.lookup import download_model_files, resolve_version
from tasks.registry import lineage


def card_text(name: str, version: str, tags: dict[str, str]) -> str:
    lines = [f"# {name}, version {version}", "", "A Llama model trained with llamaflow."]
    parent = tags.get(lineage.TAG_PARENT)
    if parent is not None:
        ancestors = lineage.parse_lineage(tags.get(lineage.TAG_LINEAGE))
        chain = (
            " → ".join([tags.get(lineage.TAG_ROOT, "?"), *ancestors])
            if ancestors
            else tags.get(lineage.TAG_ROOT)
        )
        lines += [
            "",
            f"Continued from `{parent}`; lineage: {chain} → this version "
            f"({tags.get(lineage.TAG_TOKENS_SEEN_TOTAL, '?')} training tokens across it).",
        ]
    return "\n".join(lines)


def export_registered(uri: str, out_dir: str | Path, tracking_uri: str | None = None) -> Path:
    """Write `uri`'s version (models:/NAME@ALIAS or models:/NAME/VERSION) to `out_dir` for transformers."""
    version = resolve_version(uri, tracking_uri)
    pinned = f"models:/{version.name}/{version.version}"
    with tempfile.TemporaryDirectory(prefix="llamaflow-export-") as tmp:
        files = download_model_files(pinned, tmp, tracking_uri)
        model = load_pretrained(files.config, files.weights)
        return export_hf(
            model,
            out_dir,
            files.tokenizer,
            base_model=lineage.base_model(version.tags),
            card_text=card_text(version.name, str(version.version), version.tags),
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tasks.export", description=__doc__.split("\n\n")[0])
    parser.add_argument("uri", help="models:/NAME@ALIAS or models:/NAME/VERSION")
    parser.add_argument("out_dir", type=Path)
    args = parser.parse_args(argv)
    print(export_registered(args.uri, args.out_dir))


if __name__ == "__main__":
    main()
