"""The package has no import circles and no re-export shims, and cannot grow them back (issue 56).

The graph is read with ``ast`` from the package's files (``tests/_import_graph.py``): top-level, lazy (inside a
function) and ``TYPE_CHECKING`` imports all count, because each is a dependency a reader must hold in mind and a lazy
one is usually a circle hidden to make the import work. A failure names each circle with its modules in import order.
The rules (DESIGN.md): a type two modules need lives below both; a split moves its importers and leaves no re-export.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from _import_graph import circles, forwarding_getattr, import_graph

PACKAGE = Path(__file__).resolve().parent.parent / "da3po_megatron"


def test_the_package_has_no_import_circles():
    found = circles(import_graph(PACKAGE))
    assert not found, f"{len(found)} import circle(s) in da3po_megatron:\n" + "\n".join(found)


def test_no_module_forwards_names_through_a_module_level_getattr():
    shims = forwarding_getattr(PACKAGE)
    assert not shims, ("module-level __getattr__ re-exports names (and hides the import from the graph); import "
                       "from the module that defines them instead: " + ", ".join(shims))


# The floors of DESIGN.md's dependency direction: what each bottom room may import of the project (besides itself).
FLOORS = {
    "algorithms": (),  # pure torch math
    "kernels": (),
    "config": ("algorithms",),  # the presets; validation imports nothing above config
}


@pytest.mark.parametrize("room", list(FLOORS))
def test_the_bottom_rooms_import_nothing_above_them(room):
    allowed = tuple(f"da3po_megatron.{r}" for r in (room, *FLOORS[room]))
    graph = import_graph(PACKAGE)
    up = [f"{m} -> {d}" for m in sorted(graph) if m.startswith(f"da3po_megatron.{room}")
          for d in sorted(graph[m]) if not any(d == a or d.startswith(a + ".") for a in allowed)]
    assert not up, f"da3po_megatron/{room}/ imports above itself: " + ", ".join(up)


def _package(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / "pkg" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root / "pkg"


# A circle of three modules through each kind of import; the package face and an acyclic module stay out of it.
TIES = {
    "top-level": "from pkg.sub.c import C\n",
    "lazy": "def f():\n    from pkg.sub import c\n    return c\n",
    "TYPE_CHECKING": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .sub.c import C\n",
}


@pytest.mark.parametrize("kind", list(TIES))
def test_the_checker_names_a_circle_in_import_order_whatever_kind_of_import_closes_it(tmp_path, kind):
    pkg = _package(tmp_path, {
        "__init__.py": "from pkg.a import A\n",  # the face: an edge to a child, not a circle
        "a.py": "from pkg import b\nA = 1\n",
        "b.py": TIES[kind],
        "sub/__init__.py": "",
        "sub/c.py": "from ..a import A\nC = A\n",
        "d.py": "import pkg.sub.c\nfrom pkg.a import A\n",  # imports into the circle, is not part of it
    })
    graph = import_graph(pkg)
    assert graph["pkg.d"] == {"pkg.sub.c", "pkg.a"}
    found = circles(graph)
    assert len(found) == 1, found
    assert found[0].startswith("pkg.a -> pkg.b -> pkg.sub.c -> pkg.a   (all ties: "), found[0]
    assert "pkg.d" not in found[0] and "pkg " not in found[0]


def test_the_checker_passes_the_same_package_once_the_type_moves_below_both(tmp_path):
    pkg = _package(tmp_path, {
        "__init__.py": "",
        "types.py": "A = 1\n",  # the shared type, below both users
        "a.py": "from pkg.types import A\n",
        "b.py": "from pkg.types import A\nfrom pkg import a\n",
    })
    assert circles(import_graph(pkg)) == []


def test_the_checker_names_two_separate_circles_and_finds_a_forwarding_getattr(tmp_path):
    pkg = _package(tmp_path, {
        "__init__.py": "",
        "x.py": "import pkg.y\n",
        "y.py": "def g():\n    import pkg.x\n",
        "p.py": "from pkg.q import Q\nP = 1\n",
        "q.py": "Q = 2\ndef __getattr__(name):\n    from pkg import p\n    return getattr(p, name)\n",
    })
    found = circles(import_graph(pkg))
    assert [line.split("   ")[0] for line in found] == ["pkg.p -> pkg.q -> pkg.p", "pkg.x -> pkg.y -> pkg.x"]
    assert forwarding_getattr(pkg) == ["pkg.q (line 2)"]
