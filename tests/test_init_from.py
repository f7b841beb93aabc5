"""init_from: every source resolves to the weights and tokenizer it names, an alias is pinned once per run,
and the tokenizer is checked against the embedding before any work.

A transformers `LlamaForCausalLM` with a tokenizer built by `tokenizers` (tests/hf_checkpoint.py) stands in
for a downloaded checkpoint; registry versions are logged to a real SQLite MLflow store.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from huggingface_hub import constants as hf_constants
from safetensors.torch import load_file
from tokenizers import Tokenizer

from flows.pretrain import tokenizer_for
from flows.pretrain_config import PretrainConfig
from hf_checkpoint import BOS, COMMIT, EOS, put_in_hf_cache, save_hf_llama
from model import LlamaForPretraining, get_preset, load_pretrained, save_weights
from registry_world import sqlite_store
from stdlib_corpus import STDLIB
from tasks.build import build_model
from tasks.init_from import InitFromError, resolve_for_run, resolve_init_from
from tasks.init_from.parent_cache import weights_sha256
from tasks.refs import CheckpointRef
from tasks.registry import lineage
from tasks.registry.publish import log_version
from tasks.tokenize import train_tokenizer
from tasks.tracking import store


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_hf_llama(tmp_path_factory.mktemp("hf") / "tiny-llama")


def _config(init_from: str, **overrides: object) -> PretrainConfig:
    return PretrainConfig(preset="tiny", init_from=init_from, seq_len=64, **overrides)


def test_hf_directory_becomes_our_model_with_its_own_tokenizer(hf_dir: Path) -> None:
    parent = resolve_init_from(str(hf_dir))
    assert parent.kind == "hf" and parent.pinned.startswith("hf-dir:tiny-llama@")
    assert parent.special_tokens == {"bos": BOS, "eos": EOS}

    tokenizer, model_config = tokenizer_for(_config(str(hf_dir)), parent)
    # As many tokens as embedding rows and no pad token: an unused special token pads, none is added.
    assert tokenizer.vocab_size == model_config.vocab_size == 320
    assert (tokenizer.bos_id, tokenizer.eos_id) == (0, 1) and tokenizer.pad_id == tokenizer.bos_id
    ref = build_model(model_config, seed=0, parent=parent)
    assert ref.parent == parent

    ids = torch.randint(0, 320, (2, 24), generator=torch.Generator().manual_seed(0))
    hf = transformers.LlamaForCausalLM.from_pretrained(hf_dir).eval()
    with torch.no_grad():
        expected = hf(ids).logits
        got = load_pretrained(ref.path).eval()(ids)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=2e-5)


def test_hub_id_resolves_offline_from_the_hf_cache_pinned_to_its_commit(
    hf_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    put_in_hf_cache(tmp_path / "hub", "acme/tiny-llama", hf_dir)
    direct = resolve_init_from(str(hf_dir))
    for source in ("acme/tiny-llama", "hf:acme/tiny-llama", f"hf:acme/tiny-llama@{COMMIT}"):
        parent = resolve_init_from(source)
        assert parent.kind == "hf" and parent.pinned == parent.root == f"hf:acme/tiny-llama@{COMMIT}"
        assert parent.weights_sha256 == direct.weights_sha256
        assert Path(parent.tokenizer_path).read_bytes() == (hf_dir / "tokenizer.json").read_bytes()
    with pytest.raises(InitFromError, match="not .*in the local Hugging Face cache.*hf download acme/absent"):
        resolve_init_from("acme/absent")


def test_local_checkpoint_safetensors_file_and_run_directory(tmp_path: Path) -> None:
    torch.manual_seed(3)
    model = LlamaForPretraining(get_preset("tiny", vocab_size=384))
    run_dir = tmp_path / "run"
    step = run_dir / "step_000004"
    step.mkdir(parents=True)
    save_weights(model, step / "model.safetensors")
    (step / "config.json").write_text(json.dumps(model.config.to_dict()))
    tokenizer = train_tokenizer(str(STDLIB / "textwrap.py"), 384, val_data=str(STDLIB / "bisect.py"))
    (run_dir / "tokenizer.json").write_bytes(Path(tokenizer.path).read_bytes())

    from_dir = resolve_init_from(str(step))
    assert from_dir.kind == "local" and from_dir.weights_sha256 == weights_sha256(step / "model.safetensors")
    assert from_dir.tokenizer_path == str(run_dir / "tokenizer.json")  # the run directory's
    lone = tmp_path / "lone" / "weights.safetensors"  # no config.json beside: the file's metadata has it
    lone.parent.mkdir()
    save_weights(model, lone)
    from_file = resolve_init_from(str(lone))
    assert from_file.weights_sha256 == weights_sha256(lone) and from_file.tokenizer_path is None
    assert load_file(str(Path(from_file.path) / "model.safetensors")).keys() == model.state_dict().keys() - {
        "lm_head.weight"
    }

    # A run directory is a run to resume or a checkpoint to start from: both are named, nothing is guessed.
    with pytest.raises(InitFromError, match=f"resume it: checkpoint_dir={run_dir} .*init_from={step}"):
        resolve_init_from(str(run_dir))
    with pytest.raises(InitFromError, match="both a run to resume and a model to start from"):
        resolve_for_run(str(step), run_dir)
    with pytest.raises(InitFromError, match="is not an existing path"):
        resolve_init_from(str(tmp_path / "absent" / "x.safetensors"))


def _register(client, uri: str, name: str, seed: int, tokenizer, root: Path) -> tuple[str, str, str]:
    """A llamaflow version of a tiny model (seeded weights): (version, weights sha256, run id)."""
    torch.manual_seed(seed)
    model = LlamaForPretraining(get_preset("tiny", vocab_size=384))
    directory = root / f"ckpt-{seed}"
    directory.mkdir()
    save_weights(model, directory / "model.safetensors")
    (directory / "config.json").write_text(json.dumps(model.config.to_dict()))
    run_id = store.start_run("init-from-tests", uri=uri)
    version = log_version(
        client,
        run_id=run_id,
        checkpoint=CheckpointRef(path=str(directory), run_dir=str(root), step=1, tokens_seen=1000 * seed),
        tokenizer=tokenizer,
        model_name=name,
        tags=lineage.version_tags(
            None, tokens_seen=1000 * seed, tokenizer=tokenizer, parent_bits_per_byte=None
        ),
        via_server=False,
    )
    return str(version.version), weights_sha256(directory / "model.safetensors"), run_id


def test_registry_sources_and_an_alias_pinned_once_per_run(tmp_path: Path) -> None:
    tokenizer = train_tokenizer(str(STDLIB / "shlex.py"), 384, val_data=str(STDLIB / "bisect.py"))
    with sqlite_store(tmp_path) as uri:
        client = store.get_client(uri)
        v1, sha1, _ = _register(client, uri, "lineage-src", 1, tokenizer, tmp_path)
        v2, sha2, run2 = _register(client, uri, "lineage-src", 2, tokenizer, tmp_path)
        client.set_registered_model_alias("lineage-src", "champion", v1)

        champion = resolve_init_from("models:/lineage-src@champion")
        assert (champion.kind, champion.pinned, champion.version) == (
            "registry",
            "models:/lineage-src/1",
            "1",
        )
        assert champion.weights_sha256 == sha1 and champion.tokens_seen_total == 1000
        assert champion.lineage == ("lineage-src/1",) and champion.root == "scratch"
        assert Path(champion.tokenizer_path).read_bytes() == Path(tokenizer.path).read_bytes()
        assert champion.special_tokens == {"bos": "<|bos|>", "eos": "<|eos|>", "pad": "<|pad|>"}
        logged = client.get_logged_model(champion.model_id)  # the version's logged model, by id
        assert logged.source_run_id == client.get_model_version("lineage-src", v1).run_id

        # Resolved once per run directory: the alias moving afterwards changes nothing for that run.
        run_dir = tmp_path / "runs" / "a"
        first = resolve_for_run("models:/lineage-src@champion", run_dir)
        client.set_registered_model_alias("lineage-src", "champion", v2)
        again = resolve_for_run("models:/lineage-src@champion", run_dir)  # a retry of the same run
        assert first.pinned == again.pinned == "models:/lineage-src/1" and again.weights_sha256 == sha1
        assert resolve_for_run("models:/lineage-src@champion", tmp_path / "runs" / "b").weights_sha256 == sha2
        with pytest.raises(
            InitFromError, match="holds a run started from init_from='models:/lineage-src@champion'"
        ):
            resolve_for_run("models:/lineage-src/2", run_dir)

        by_version = resolve_init_from("models:/lineage-src/2")
        by_id = resolve_init_from(f"models:/{champion.model_id}")
        by_run = resolve_init_from(f"runs:/{run2}")
        assert by_version.weights_sha256 == by_run.weights_sha256 == sha2
        assert (by_id.kind, by_id.version, by_id.weights_sha256) == ("logged_model", "1", sha1)
        assert by_run.version == "2" and by_run.model_id == by_version.model_id
        with pytest.raises(InitFromError, match="no logged model 'nope'.*'model'"):
            resolve_init_from(f"runs:/{run2}/nope")
        with pytest.raises(
            InitFromError, match="no registered model named 'absent'.*Register a first version"
        ):
            resolve_init_from("models:/absent@champion")


def test_the_tokenizer_must_fit_the_embedding_or_grow_it_explicitly(hf_dir: Path, tmp_path: Path) -> None:
    parent = resolve_init_from(str(hf_dir))
    bigger = tmp_path / "bigger.json"
    extended = Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    extended.add_tokens(["<think>", "</think>", "<tool>"])
    extended.save(str(bigger))

    with pytest.raises(InitFromError, match=r"has 323 tokens but the model .* has 320 embedding rows"):
        tokenizer_for(_config(str(hf_dir), tokenizer=str(bigger)), parent)
    tokenizer, config = tokenizer_for(
        _config(str(hf_dir), tokenizer=str(bigger), resize_embeddings=True), parent
    )
    assert tokenizer.vocab_size == config.vocab_size == 323
    grown = load_file(str(Path(build_model(config, seed=0, parent=parent).path) / "model.safetensors"))
    before = load_file(str(Path(parent.path) / "model.safetensors"))
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        assert torch.equal(grown[name][:320], before[name])
        torch.testing.assert_close(grown[name][320:], before[name].mean(0).expand(3, -1))

    renumbered = train_tokenizer(str(STDLIB / "shlex.py"), 300, val_data=str(STDLIB / "bisect.py"))
    with pytest.raises(InitFromError, match="does not extend the one that came with init_from"):
        tokenizer_for(_config(str(hf_dir), tokenizer=renumbered.path), parent)
