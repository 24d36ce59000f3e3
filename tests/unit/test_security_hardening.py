"""Hardening: resource-ID rules, path confinement, and no unsafe deserialisation anywhere in the service code."""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest
from pydantic import BaseModel, ValidationError

from alloy.errors import AlloyError, ErrorCode
from alloy.ids import MAX_ID_LENGTH, ResourceId, confined_path, expand_home, validate_resource_id

REPO_ROOT = Path(__file__).resolve().parents[2]
SERVICE_PACKAGES = ("alloy", "kernels", "deployments", "serve_app", "evolution")

VALID_IDS = ["llama-3", "Qwen2.5-0.5B", "org/model_v1.2", "a", "x" * 128, "o" * 31 + "/" + "n" * 128]
INVALID_IDS = [
    "",
    "../etc/passwd",
    "a/../b",
    "a..b",
    "/abs",
    "org/",
    "/name",
    "a/b/c",
    "-dash",
    ".hidden",
    "org/.x",
    "has space",
    "semi;colon",
    "back\\slash",
    "nul\x00",
    "x" * 129,
    "o" * 32 + "/n",
    "ünïcode",
    "q?x=1",
    "a%2Fb",
]


@pytest.mark.parametrize("value", VALID_IDS)
def test_valid_ids(value):
    assert validate_resource_id(value, "model") == value
    assert len(value) <= MAX_ID_LENGTH


@pytest.mark.parametrize("value", INVALID_IDS)
def test_invalid_ids(value):
    with pytest.raises(AlloyError) as caught:
        validate_resource_id(value, "dataset")
    assert caught.value.code is ErrorCode.VALIDATION_FAILED and caught.value.details["field"] == "dataset_id"

    class Body(BaseModel):
        model: ResourceId

    with pytest.raises(ValidationError):
        Body(model=value)


def test_confined_path(tmp_path):
    root = tmp_path / "models"
    (root / "llama").mkdir(parents=True)
    outside = tmp_path / "secret"
    outside.mkdir()
    (root / "escape").symlink_to(outside)
    assert confined_path("llama", [root]) == (root / "llama").resolve()
    assert confined_path(root / "llama", [tmp_path / "other", root]) == (root / "llama").resolve()
    for bad in ("../secret", str(outside), "escape", "llama/../../secret", "/etc/passwd", "a\x00b", ""):
        with pytest.raises(AlloyError) as caught:
            confined_path(bad, [root])
        assert caught.value.code is ErrorCode.VALIDATION_FAILED
        # Outside: the allowed roots are named (the client needs them); where the candidate led is not.
        assert str(outside) not in caught.value.message
        if bad and "\x00" not in bad:
            assert str(root.resolve()) in caught.value.message
            assert caught.value.details["allowed_roots"] == [str(root.resolve())]


def test_expand_home_expands_a_known_home_and_leaves_an_unknown_users_path_as_written():
    assert expand_home("~/x") == Path(os.path.expanduser("~")) / "x"
    assert expand_home("~no-such-user-here/x") == Path("~no-such-user-here/x")
    assert expand_home('~w,:d/&/:0a"1s/BDX=e6JB') == Path('~w,:d/&/:0a"1s/BDX=e6JB')  # Path.expanduser raised


# -- no unsafe deserialisation ---------------------------------------------------------------------------------
UNSAFE_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "joblib", "shelve", "marshal", "jsonpickle"}
UNSAFE_CALLS = {
    "pickle.load",
    "pickle.loads",
    "pd.read_pickle",
    "pandas.read_pickle",
    "yaml.unsafe_load",
    "yaml.full_load",
    "yaml.load",
    "torch.load",
    "np.load",
    "numpy.load",
    "eval",
    "exec",
}


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return ""


def _keyword(call: ast.Call, name: str) -> ast.AST | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def _is_unsafe_call(call: ast.Call) -> bool:
    name = _dotted(call.func)
    if name not in UNSAFE_CALLS:
        return False
    if name == "torch.load":  # safe only with weights_only=True
        value = _keyword(call, "weights_only")
        return not (isinstance(value, ast.Constant) and value.value is True)
    if name in ("np.load", "numpy.load"):  # safe unless allow_pickle=True
        value = _keyword(call, "allow_pickle")
        return isinstance(value, ast.Constant) and value.value is True
    if name == "yaml.load":  # safe only with an explicit SafeLoader
        loader = _keyword(call, "Loader") or (call.args[1] if len(call.args) > 1 else None)
        return not (loader is not None and "Safe" in _dotted(loader))
    return True


def unsafe_deserialisation(source: str) -> list[str]:
    findings = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            findings += [f"import {a.name}" for a in node.names if a.name.split(".")[0] in UNSAFE_MODULES]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in UNSAFE_MODULES:
            findings.append(f"from {node.module} import ...")
        elif isinstance(node, ast.Call) and _is_unsafe_call(node):
            findings.append(f"{_dotted(node.func)}(...) at line {node.lineno}")
    return findings


def test_the_scanner_catches_unsafe_code():
    assert unsafe_deserialisation("import pickle")
    assert unsafe_deserialisation("from joblib import load")
    assert unsafe_deserialisation("torch.load(p)")
    assert unsafe_deserialisation("torch.load(p, weights_only=False)")
    assert unsafe_deserialisation("np.load(p, allow_pickle=True)")
    assert unsafe_deserialisation("yaml.load(text)")
    assert not unsafe_deserialisation("torch.load(p, weights_only=True)\nyaml.safe_load(t)\nnp.load(p)")
    assert not unsafe_deserialisation("yaml.load(text, Loader=yaml.SafeLoader)")


def test_no_unsafe_deserialisation_in_service_code():
    findings = {}
    for package in SERVICE_PACKAGES:
        for path in sorted((REPO_ROOT / package).rglob("*.py")) if (REPO_ROOT / package).exists() else []:
            problems = unsafe_deserialisation(path.read_text())
            if problems:
                findings[os.path.relpath(path, REPO_ROOT)] = problems
    assert not findings, f"unsafe deserialisation (pickle & co.) in service code: {findings}"
