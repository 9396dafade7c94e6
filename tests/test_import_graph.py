# The package's import structure, measured by tools/import_graph.py from its source: no
# import circles and no arrow to a module on the same floor or above, lazy imports included.
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load_tool():
    spec = importlib.util.spec_from_file_location("import_graph", ROOT / "tools" / "import_graph.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_package_has_no_import_circle_and_no_upward_arrow():
    result = load_tool().measure(ROOT / "cpu_offload")
    assert result["circles"] == [] and result["upward"] == [], (result["circles"], result["upward"])
    assert result["modules"] >= 40


def test_the_tool_finds_a_circle_and_a_lazy_import(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg import b\n")
    (pkg / "b.py").write_text("def f():\n    from pkg.a import x\n")
    (pkg / "c.py").write_text("import importlib\nimportlib.import_module('pkg.a')\n")
    result = load_tool().measure(pkg)
    assert result["circles"] == [["pkg.a", "pkg.b"]]
    assert {(s, d) for s, d, _ in result["upward"]} == {("pkg.a", "pkg.b"), ("pkg.b", "pkg.a")}
    assert result["floor_of"]["pkg.c"] > result["floor_of"]["pkg.a"]
