"""The package as a user meets it: it imports, says its version, ships its types, and
documents every public function, class and argument."""

from __future__ import annotations

import importlib
import inspect
import os
import pydoc

import pytest

import cohort

MODULES = ["cohort", "cohort.datasets", "cohort.flower", "cohort.torch", "cohort.admin",
           "cohort.edge", "cohort.simulation"]


def public_objects():
    for name in MODULES:
        module = importlib.import_module(name)
        names = getattr(module, "__all__", None) or [n for n in vars(module) if not n.startswith("_")]
        for attr in names:
            obj = getattr(module, attr)
            if inspect.ismodule(obj) or getattr(obj, "__module__", "").split(".")[0] != "cohort":
                continue
            if inspect.isfunction(obj) or inspect.isclass(obj):
                yield f"{name}.{attr}", obj
                if inspect.isclass(obj):
                    for m, member in vars(obj).items():
                        if m.startswith("_") or not (inspect.isfunction(member) or isinstance(member, property)):
                            continue
                        yield f"{name}.{attr}.{m}", member


def test_version_and_typing_marker():
    assert cohort.__version__.count(".") == 2
    package = os.path.dirname(cohort.__file__)
    assert os.path.exists(os.path.join(package, "py.typed"))
    assert os.path.exists(os.path.join(package, "_rust.pyi"))


@pytest.mark.parametrize("name, obj", list(public_objects()))
def test_every_public_function_and_class_has_a_docstring(name, obj):
    doc = inspect.getdoc(obj.fget if isinstance(obj, property) else obj)
    assert doc and len(doc) > 20, f"{name} has no docstring"


def test_help_of_simulate_describes_every_argument():
    text = pydoc.render_doc(cohort.simulate, renderer=pydoc.plaintext)
    params = [p for p in inspect.signature(cohort.simulate).parameters if p != "settings"]
    doc = inspect.getdoc(cohort.simulate)
    for p in params:
        assert f"    {p}:" in doc, f"simulate's docstring does not describe `{p}`"
    assert "**settings" in doc
    assert "Returns:" in text and "Raises:" in text


def test_edge_client_and_admin_document_their_arguments():
    for cls in (cohort.EdgeClient, cohort.Admin):
        doc = inspect.getdoc(cls)
        for p in inspect.signature(cls.__init__).parameters:
            if p != "self":
                assert f"{p}:" in doc, f"{cls.__name__} does not describe `{p}`"
